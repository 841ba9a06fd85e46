"""Faults, tested as a user meets them: a rank killed (SIGKILL) or stalled (SIGSTOP) while
``autotune profile``, ``autotune tune --verify`` or training under ``autotune.wrap`` runs,
with autotune's launcher and with torchrun. The job must end non-zero within the process
group's timeout plus 30 s, name the lost rank, and leave no process or namespace behind.

Each test starts the real command as a subprocess, waits for a marker file that the job
writes once it is in the phase under test, finds the rank's process by its environment
(``RANK``, and a token unique to the test) and signals it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from test_models import synthetic_profile

from autotune.emulate import available, cleanup_stale
from autotune.errors import AutotuneError
from autotune.launch import pg_timeout_s
from autotune.runtime.channel import Channel

# The process-group timeout every job here runs with (AUTOTUNE_PG_TIMEOUT).
PG_TIMEOUT_S = 5.0
# The bound on the time from the fault to the launcher's exit.
EXIT_BOUND_S = PG_TIMEOUT_S + 30.0
# How long a job may take to reach the phase under test: a hang guard, not a measurement.
START_S = 300.0
# What backward() raises on the surviving rank 0 (from the communication thread).
SURVIVOR = "RankFailure: rank 0: the reduction of a gradient bucket failed (a peer rank was lost"

# A workload (``--workload file.py:make``) that marks, per rank, that the rank's part of
# the job (probing or measuring) has begun: ranks build it first thing.
WORKLOAD = '''
import os
import pathlib

from autotune.workloads import resolve_workload


def make():
    rank = os.environ.get("RANK", "-cli")  # the CLI builds it too, to check the spec
    (pathlib.Path(os.environ["FAULT_MARKERS"]) / f"running-rank{rank}").touch()
    return resolve_workload("mlp")
'''

# A training script: run by torchrun, or its train() by autotune's launcher.
TRAIN = '''
import json
import pathlib
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

import autotune
from autotune.launch import init_from_env
from autotune.workloads import resolve_workload

POLICY = {"version": 1, "default": {"compressor": "powersgd", "rank": 2}}


def train(markers, steps=100000):
    out = pathlib.Path(markers)
    init_from_env()
    rank = dist.get_rank()
    work = resolve_workload("mlp")
    model = autotune.wrap(work.model, autotune.Policy.from_dict(POLICY))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = work.make_batch(step)
        opt.zero_grad()
        loss = work.loss_fn(model(x), y)
        try:
            loss.backward()
        except Exception as exc:
            (out / f"error-rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
            raise
        opt.step()
        if step == 3:  # compressed steps run on the communication thread from step 2
            timeouts = [pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                        for pg in _world.pg_map]
            (out / f"timeouts-rank{rank}.json").write_text(json.dumps(timeouts))
            (out / f"running-rank{rank}").touch()
        time.sleep(0.01)


if __name__ == "__main__":
    train(sys.argv[1])
'''

LAUNCH = '''
import sys

from autotune.launch import launch

launch("fault_train:train", 2, {"markers": sys.argv[1]})
'''


class Job:
    """A command run as a user would, in a session of its own, with a unique token in
    its environment that every process it starts inherits."""

    def __init__(self, cmd: list[str], cwd: Path) -> None:
        self.token = uuid.uuid4().hex
        self.markers = cwd / "markers"
        self.markers.mkdir()
        self.log = cwd / "output.txt"
        env = dict(os.environ, FAULT_TOKEN=self.token, FAULT_MARKERS=str(self.markers),
                   AUTOTUNE_PG_TIMEOUT=str(PG_TIMEOUT_S))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def processes(self) -> list[psutil.Process]:
        """Live processes (not zombies) that carry this job's token."""
        found = []
        for p in psutil.process_iter():
            try:
                if (p.environ().get("FAULT_TOKEN") == self.token
                        and p.status() != psutil.STATUS_ZOMBIE):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def rank_process(self, rank: int) -> psutil.Process:
        ranks = [p for p in self.processes() if p.environ().get("RANK") == str(rank)]
        assert len(ranks) == 1, f"expected one process of rank {rank}, found {ranks}"
        return ranks[0]

    def wait_running(self, ranks: tuple[int, ...] = (0, 1)) -> None:
        """Until every rank has marked that it is in the phase under test."""
        deadline = time.monotonic() + START_S
        while not all((self.markers / f"running-rank{r}").exists() for r in ranks):
            assert self.proc.poll() is None, f"the job ended early:\n{self.output()}"
            assert time.monotonic() < deadline, f"the job never got going:\n{self.output()}"
            time.sleep(0.05)

    def fault(self, rank: int, sig: signal.Signals) -> float:
        """Send ``sig`` to ``rank``; returns the seconds until the command exited."""
        target = self.rank_process(rank)
        start = time.monotonic()
        target.send_signal(sig)
        try:
            self.proc.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {EXIT_BOUND_S:.0f} s after {sig.name} to rank {rank}")
        elapsed = time.monotonic() - start
        print(f"{sig.name} to rank {rank}: exit status {self.proc.returncode} after {elapsed:.1f} s")
        return elapsed

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        """Kill whatever is left (only after a failed assertion)."""
        for p in self.processes():
            p.kill()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def autotune_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "autotune", *args]


def assert_ended(job: Job, elapsed: float) -> None:
    named = [ln for ln in job.output().splitlines() if "rank 1" in ln or "rank      : 1" in ln]
    print("  " + (named[-1].strip() if named else "(no line names rank 1)"))
    assert job.proc.returncode not in (0, None), job.output()
    assert elapsed <= EXIT_BOUND_S
    left = job.processes()
    assert not left, f"left behind: {[(p.pid, p.cmdline()) for p in left]}"


def error_line(job: Job) -> str:
    """The CLI's one error line."""
    lines = [ln for ln in job.output().splitlines() if ln.startswith("autotune: error: ")]
    assert len(lines) == 1, job.output()
    assert "Traceback" not in job.output()
    return lines[0]


# --------------------------------------------------------------------------- profile
@pytest.mark.skipif(not available()[0], reason=f"emulated cluster: {available()[1]}")
@pytest.mark.multirank
def test_profile_on_an_emulated_cluster_ends_when_a_rank_is_killed(tmp_path: Path) -> None:
    (tmp_path / "fault_workload.py").write_text(WORKLOAD)
    job = Job(autotune_cmd("profile", "--workload", "fault_workload.py:make", "--hosts", "2",
                           "--nproc-per-node", "1", "--link", "1gbit", "--budget-s", "3",
                           "--steps", "3", "--out", "profile.json"), tmp_path)
    prefix = f"at{job.proc.pid}"
    try:
        job.wait_running()
        namespaces = [n for n in _namespaces() if n.startswith(prefix)]
        assert namespaces, "the ranks should run in the cluster's namespaces"
        elapsed = job.fault(1, signal.SIGKILL)
        assert_ended(job, elapsed)
        assert job.proc.returncode == 1  # a failed job, not bad input
        assert "rank 1 was killed by SIGKILL" in error_line(job)
        assert not set(namespaces) & set(_namespaces())
        assert not (tmp_path / "profile.json").exists()
    finally:
        job.close()
        cleanup_stale(prefix)


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


# ------------------------------------------------------------------------------ tune
@pytest.mark.multirank
def test_tune_verify_ends_when_a_rank_is_killed(tmp_path: Path) -> None:
    data = synthetic_profile("mlp").to_dict()
    data["env"].update(link=None, hosts=1)  # measured on 2 local ranks
    (tmp_path / "profile.json").write_text(json.dumps(data))
    (tmp_path / "fault_workload.py").write_text(WORKLOAD)
    job = Job(autotune_cmd("tune", "profile.json", "--verify", "1", "--trials", "5",
                           "--workload", "fault_workload.py:make", "--out", "policy.json"), tmp_path)
    try:
        job.wait_running()
        elapsed = job.fault(1, signal.SIGKILL)
        assert_ended(job, elapsed)
        assert job.proc.returncode == 1
        assert "rank 1 was killed by SIGKILL" in error_line(job)
        assert not (tmp_path / "policy.json").exists()
    finally:
        job.close()


# -------------------------------------------------------------------------- training
def _training(tmp_path: Path, cmd: list[str]) -> Job:
    (tmp_path / "fault_train.py").write_text(TRAIN)
    (tmp_path / "run_job.py").write_text(LAUNCH)
    return Job([arg.replace("MARKERS", str(tmp_path / "markers")) for arg in cmd], tmp_path)


@pytest.mark.multirank
def test_training_under_the_launcher_ends_when_a_rank_is_killed(tmp_path: Path) -> None:
    job = _training(tmp_path, [sys.executable, "run_job.py", "MARKERS"])
    try:
        job.wait_running()
        elapsed = job.fault(1, signal.SIGKILL)
        assert_ended(job, elapsed)
        assert "RankFailure: rank 1 was killed by SIGKILL" in job.output()
        # The survivor's collective failed on the communication thread; backward()
        # raised it with the rank and gloo's reason.
        error = (job.markers / "error-rank0.txt").read_text()
        assert SURVIVOR in error
        assert "peer" in error
        # Every process group, the hook's own included, has the timeout that was set.
        for rank in (0, 1):
            timeouts = json.loads((job.markers / f"timeouts-rank{rank}.json").read_text())
            assert len(timeouts) >= 2 and set(timeouts) == {PG_TIMEOUT_S}
    finally:
        job.close()


@pytest.mark.multirank
def test_a_stalled_rank_is_named_and_killed_when_the_timeout_expires(tmp_path: Path) -> None:
    job = _training(tmp_path, [sys.executable, "run_job.py", "MARKERS"])
    try:
        job.wait_running()
        elapsed = job.fault(1, signal.SIGSTOP)
        assert_ended(job, elapsed)  # the stopped rank is gone too
        assert "RankFailure: rank 1 stalled (stopped by a signal)" in job.output()
        assert elapsed >= PG_TIMEOUT_S  # noticed by the timeout, not before
        error = (job.markers / "error-rank0.txt").read_text()
        assert SURVIVOR in error
        assert "Timed out" in error
    finally:
        job.close()


@pytest.mark.multirank
def test_training_under_torchrun_ends_when_a_rank_is_killed(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "--max-restarts", "0"]
    job = _training(tmp_path, [*torchrun, "fault_train.py", "MARKERS"])
    try:
        job.wait_running()
        elapsed = job.fault(1, signal.SIGKILL)
        assert_ended(job, elapsed)
        out = job.output()
        # torchrun's report names the root cause: rank 1, killed.
        cause = out[out.index("Root Cause"):]
        assert "rank      : 1 (local_rank: 1)" in cause and "exitcode  : -9" in cause
        # If the survivor saw the failure before torchrun stopped it, it said so clearly.
        error = job.markers / "error-rank0.txt"
        if error.exists():
            assert SURVIVOR in error.read_text()
    finally:
        job.close()


# ------------------------------------------------------------------------- channel
def test_a_failed_job_fails_its_future_and_every_later_one() -> None:
    channel = Channel()
    calls = []

    def lost() -> torch.Tensor:
        calls.append("lost")
        raise RuntimeError("[pair.cc:553] Connection closed by peer [10.213.0.2]:4242")

    def fine() -> torch.Tensor:
        calls.append("fine")
        return torch.ones(2)

    try:
        assert torch.equal(channel.submit(fine, torch.device("cpu")).wait(), torch.ones(2))
        first = channel.submit(lost, torch.device("cpu"))
        later = channel.submit(fine, torch.device("cpu"))
        for fut in (first, later):
            # DDP sees the failure as an error of the C++ future (not a value it cannot
            # cast), with the message intact.
            with pytest.raises(RuntimeError, match=r"RankFailure: .*the reduction of a gradient "
                               r"bucket failed \(a peer rank was lost or stopped responding\), "
                               r"so training cannot continue: .*Connection closed by peer "
                               r"\[10.213.0.2\]:4242"):
                fut.wait()
        assert calls == ["fine", "lost"]  # the later job never ran on the broken group
    finally:
        channel.close()


# ---------------------------------------------------------------------- the setting
def test_pg_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOTUNE_PG_TIMEOUT", raising=False)
    assert pg_timeout_s() == 120.0
    monkeypatch.setenv("AUTOTUNE_PG_TIMEOUT", "7.5")
    assert pg_timeout_s() == 7.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        monkeypatch.setenv("AUTOTUNE_PG_TIMEOUT", bad)
        with pytest.raises(AutotuneError, match=f"AUTOTUNE_PG_TIMEOUT must be a positive number of seconds, got '{bad}'"):
            pg_timeout_s()
