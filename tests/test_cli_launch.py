"""``autotune launch script.py ...``, run as a user runs it: a real process per rank, a real
gloo group, the script written like any torchrun script (no autotune import).

Each job carries a token in its environment that every rank inherits, so a test can tell
that no rank of its job outlived the command.
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
from typing import Any

import psutil
import pytest
from test_bad_input import _unprivileged_prefix

from autotune.cli import main
from autotune.emulate import available

# A hang guard for every job, not a measurement: a passing job ends long before.
GUARD_S = 300.0

# Behaviour comes from the arguments, key=value tokens; every other token is only echoed.
SCRIPT = '''
"""A torchrun-style script: it reads its rank from the environment and sets up its own
process group."""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

args = sys.argv[1:]
opts = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("-"))


def leave(code):
    # Skips interpreter teardown, which after a gloo job now and then aborts (SIGABRT)
    # and would turn the status under test into another.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
# one write with its newline: under torchrun the ranks share one stdout pipe, and
# print's separate write of "\\n" let two ranks' lines run together
sys.stdout.write(json.dumps({"rank": rank, "world": dist.get_world_size(), "sum": total.item(),
                             "argv": args, "local_rank": os.environ["LOCAL_RANK"],
                             "master": os.environ["MASTER_ADDR"]}) + "\\n")
sys.stdout.flush()
print(f"rank {rank} on stderr", file=sys.stderr, flush=True)
if "wait" in opts:  # until the test has read rank 0's first line
    while not Path(opts["wait"]).exists():
        time.sleep(0.05)
if "fail" in opts:
    who, code = map(int, opts["fail"].split(":"))
    if rank == who:
        leave(code)
if opts.get("then") == "sleep":
    while True:
        time.sleep(1)
dist.all_reduce(total)  # with a rank gone, this waits for it
leave(int(opts.get("exit", "0")))
'''


class Job:
    """``python -m autotune launch ...`` in a session of its own; stdout and stderr kept
    apart, stdout readable line by line while the job runs."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.token = uuid.uuid4().hex
        self.stderr_path = tmp / f"stderr-{self.token}.txt"
        # TMPDIR: the rank logs a job without --log-dir keeps land in the test's folder
        env = dict(os.environ, LAUNCH_TEST_TOKEN=self.token, TMPDIR=str(tmp))
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "autotune", "launch", *args], cwd=tmp, env=env,
                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
            )

    def finish(self) -> tuple[int, str, str]:
        """Wait for the command; its status, stdout and stderr."""
        try:
            out, _ = self.proc.communicate(timeout=GUARD_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running after {GUARD_S:.0f} s:\n{self.stderr()}")
        return self.proc.returncode, out, self.stderr()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def ranks(self) -> list[psutil.Process]:
        """Live processes (not zombies) of this job's ranks."""
        found = []
        for p in psutil.process_iter():
            try:
                env = p.environ()
                if (env.get("LAUNCH_TEST_TOKEN") == self.token and "RANK" in env
                        and p.status() != psutil.STATUS_ZOMBIE):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def kill(self) -> None:
        for p in self.ranks():
            p.kill()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def error_line(stderr: str) -> str:
    """The launcher's one error line; no traceback of its own."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("autotune: error: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def script_line(text: str) -> dict[str, Any]:
    """The script's JSON line in a rank's output (torch may log warnings around it)."""
    return json.loads(next(ln for ln in text.splitlines() if ln.startswith("{")))


def assert_no_rank_left(job: Job) -> None:
    left = job.ranks()
    assert not left, f"left behind: {[(p.pid, p.cmdline()) for p in left]}"


# ----------------------------------------------------------------------------- runs


@pytest.mark.multirank
def test_rank0_streams_live_others_log_and_arguments_pass_through(
    tmp_path: Path, script: Path
) -> None:
    flag = tmp_path / "go"
    logs = tmp_path / "logs"
    # Flags of autotune's own after the script, and a "--", are the script's.
    passed = [f"wait={flag}", "--hosts", "9", "--", "--timeout", "-h"]
    job = Job(tmp_path, "--nproc-per-node", "2", "--log-dir", str(logs),
              "--timeout", str(GUARD_S), str(script), *passed)
    assert job.proc.stdout is not None
    first = job.proc.stdout.readline()  # every rank waits for the flag, so this is live
    flag.touch()
    status, rest, stderr = job.finish()
    assert status == 0, stderr
    line = json.loads(first)
    assert line == {"rank": 0, "world": 2, "sum": 3.0, "argv": passed, "local_rank": "0",
                    "master": "127.0.0.1"}
    assert rest == ""  # rank 1's line went to its log, not here
    assert "rank 0 on stderr" in stderr  # rank 0's stderr goes to stderr
    assert str(logs) in stderr  # the directory is named
    rank1 = (logs / "rank1.log").read_text()
    assert script_line(rank1)["rank"] == 1
    assert "rank 1 on stderr" in rank1
    assert not (logs / "rank0.log").exists()


@pytest.mark.multirank
def test_the_exit_status_of_the_ranks_is_propagated(tmp_path: Path, script: Path) -> None:
    status, out, stderr = Job(tmp_path, "--nproc-per-node", "2", str(script), "exit=5").finish()
    assert status == 5, stderr
    assert "exited with status 5" in error_line(stderr)
    assert script_line(out)["sum"] == 3.0


@pytest.mark.multirank
@pytest.mark.parametrize("others", ["collective", "sleep"])
def test_a_failing_rank_ends_the_others_and_is_named(
    tmp_path: Path, script: Path, others: str
) -> None:
    """Rank 1 exits 3; rank 0 then waits in a collective that rank 1 never joins (gloo
    sees the connection close) or sleeps and never notices (it is ended)."""
    args = ["fail=1:3"] + (["then=sleep"] if others == "sleep" else [])
    job = Job(tmp_path, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
              "--timeout", str(GUARD_S), str(script), *args)
    status, _, stderr = job.finish()
    assert status == 3, stderr
    line = error_line(stderr)
    assert line.startswith("autotune: error: rank 1 exited with status 3"), line
    assert str(tmp_path / "logs" / "rank1.log") in line
    assert "timeout" not in line
    assert_no_rank_left(job)


@pytest.mark.multirank
def test_the_job_timeout_ends_every_rank(tmp_path: Path, script: Path) -> None:
    job = Job(tmp_path, "--nproc-per-node", "2", "--timeout", "3", str(script), "then=sleep")
    status, _, stderr = job.finish()
    assert status == 1, stderr
    assert "ran past its 3 s timeout" in error_line(stderr)
    assert_no_rank_left(job)


@pytest.mark.multirank
@pytest.mark.parametrize("sig, expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_end_every_rank(
    tmp_path: Path, script: Path, sig: signal.Signals, expected: int
) -> None:
    job = Job(tmp_path, "--nproc-per-node", "2", str(script), "then=sleep")
    assert job.proc.stdout is not None
    assert json.loads(job.proc.stdout.readline())["rank"] == 0, job.stderr()
    deadline = time.monotonic() + GUARD_S
    while len(job.ranks()) < 2:  # rank 1 may still be starting up
        assert time.monotonic() < deadline, job.stderr()
        time.sleep(0.05)
    job.proc.send_signal(sig)
    status, _, stderr = job.finish()
    assert status == expected, stderr
    assert "Traceback" not in stderr
    assert_no_rank_left(job)


@pytest.mark.multirank
def test_the_same_script_runs_under_torchrun(tmp_path: Path, script: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(script), "exit=0", "--hosts", "9"],
        cwd=tmp_path, capture_output=True, text=True, timeout=GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert sorted(ln["rank"] for ln in lines) == [0, 1]
    assert all(ln["sum"] == 3.0 and ln["argv"] == ["exit=0", "--hosts", "9"] for ln in lines)


@pytest.mark.multirank
@pytest.mark.skipif(not available()[0], reason=f"emulated cluster: {available()[1]}")
def test_on_an_emulated_cluster(tmp_path: Path, script: Path) -> None:
    job = Job(tmp_path, "--hosts", "2", "--nproc-per-node", "1", "--link", "100mbit",
              "--log-dir", str(tmp_path / "logs"), str(script), "fail=1:4")
    status, out, stderr = job.finish()
    assert status == 4, stderr
    assert error_line(stderr).startswith("autotune: error: rank 1 exited with status 4")
    # Each host is its own machine: local rank 0 on both, the master on host 0's NIC.
    assert script_line(out) == {"rank": 0, "world": 2, "sum": 3.0, "argv": ["fail=1:4"],
                               "local_rank": "0", "master": "10.213.0.1"}
    rank1 = script_line((tmp_path / "logs" / "rank1.log").read_text())
    assert (rank1["rank"], rank1["local_rank"]) == (1, "0")
    assert_no_rank_left(job)


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "argv, words",
    [
        (["launch"], "missing the script to run"),
        (["launch", "--"], "missing the script to run"),
        (["launch", "no_such_script.py"], "script 'no_such_script.py' not found"),
        (["launch", "--hosts", "0", "SCRIPT"], "argument --hosts: expected a positive integer"),
        (["launch", "--nproc-per-node", "0", "SCRIPT"],
         "argument --nproc-per-node: expected a positive integer"),
        (["launch", "--hosts", "2", "--link", "fast", "SCRIPT"], "cannot parse link 'fast'"),
        (["launch", "--link", "1gbit", "SCRIPT"], "give --hosts 2 or more"),
        (["launch", "--timeout", "-1", "SCRIPT"], "argument --timeout: expected a positive number"),
        (["launch", "--bogus", "SCRIPT"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    argv: list[str], words: str, script: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main([str(script) if a == "SCRIPT" else a for a in argv])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("autotune: error: ") and err.count("\n") == 1, err
    assert words in err


def test_link_without_root_is_one_line_and_status_2(tmp_path: Path, script: Path) -> None:
    prefix = _unprivileged_prefix()
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", "autotune", "launch", "--hosts", "2", "--link", "1gbit",
         str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=GUARD_S,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("autotune: error: ") and proc.stderr.count("\n") == 1
    assert "needs root" in proc.stderr


@pytest.mark.multirank
def test_sigterm_ends_any_command_and_its_ranks(tmp_path: Path) -> None:
    """Not only `launch`: `autotune profile` (or tune, bench, demo) stopped by SIGTERM,
    as a scheduler stops a job, ends its ranks, writes nothing and says so (Python's
    default would die at once and leave the ranks running)."""
    token = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", "profile", "--workload", "mlp", "--budget-s", "60",
         "--out", "p.json"], cwd=tmp_path, env=dict(os.environ, LAUNCH_TEST_TOKEN=token),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )

    def ranks() -> list[psutil.Process]:
        found = []
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE and "autotune.launch" in " ".join(p.cmdline()):
                    found.append(p)
            except psutil.NoSuchProcess:
                continue
        return found

    try:
        deadline = time.monotonic() + GUARD_S
        while len(ranks()) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.1)
        started = ranks()
        time.sleep(1.0)  # into the probes
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr
    assert "terminated (SIGTERM)" in stderr and "Traceback" not in stderr, stderr
    assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not (tmp_path / "p.json").exists()
