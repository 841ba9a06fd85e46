"""Take a profile: the network, compute and codec probes in turn, on every rank.

:func:`rank_profile` runs on each rank of the job (started by ``autotune profile``'s
launcher, or by torchrun) and returns the profile as a dict on rank 0.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from autotune._version import __version__
from autotune.launch import Placement, init_from_env, launch, set_rank_threads
from autotune.measure import STEADY_STEP_S, rank_measure
from autotune.presets import DEFAULT_PRESETS
from autotune.probes.codecs import probe_codecs
from autotune.probes.compute import probe_compute
from autotune.probes.network import probe_network
from autotune.probes.profile import Profile
from autotune.progress import Report, line_reader, rank_reporter
from autotune.workloads import describe, resolve_workload

__all__ = ["PHASES", "BUDGET_SHARES", "rank_profile", "environment", "profile_job", "take_profile"]

PHASES = ["network", "compute", "codecs", "calibrate"]
# Share of the probing budget each phase gets: the network needs the most for large
# messages on slow links; the codec probe is bounded by the model's distinct shapes.
# Calibration measures a fixed number of steps (it is not cut by the budget).
BUDGET_SHARES = {"network": 0.45, "compute": 0.3, "codecs": 0.25}
# Policies measured for the cost model's residual: the baselines, and a few random mixed
# policies (their own seed) that spread the residual's features.
CALIBRATION_RANDOM = 4
CALIBRATION_SEED = 4242
# Steps whose gradients the codec probe replays (error feedback needs several).
CAPTURE_STEPS = 4


def environment(link: str | None = None) -> dict[str, Any]:
    """Where the profile was taken: what a profile from elsewhere must be read against."""
    backend = dist.get_backend()
    device = "cuda" if backend == "nccl" else "cpu"
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "autotune": __version__,
        "python": platform.python_version(),
        "backend": backend,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "world_size": dist.get_world_size(),
        "nproc_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "threads_per_rank": torch.get_num_threads(),
        "cpu_count": os.cpu_count() or 1,
        "link": link,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return env


def rank_profile(
    workload: str,
    budget_s: float = 60.0,
    steps: int = 10,
    link: str | None = None,
    report: Report | None = None,
    calibrate: list[dict[str, Any] | None] | str | None = "default",
) -> dict[str, Any] | None:
    """Probe the live job; rank 0 returns the profile dict, other ranks None.

    Args:
        workload: workload spec (built-in name, ``file.py:fn`` or ``module:fn``).
        budget_s: seconds of probing in all; split by :data:`BUDGET_SHARES`.
        steps: measured compute-probe steps.
        link: the emulated link (recorded in the environment), if any.
        report: progress callback (default: protocol lines to a launching parent).
        calibrate: policies (dicts; None for plain DDP) whose step times are measured for
            the cost model's residual; ``"default"`` for :func:`calibration_policies`;
            None or [] to skip.
    """
    started = time.perf_counter()
    rank = dist.get_rank()
    report = report or rank_reporter(rank)
    set_rank_threads()
    work = resolve_workload(workload)

    network = probe_network(
        budget_s=budget_s * BUDGET_SHARES["network"],
        progress=lambda f: report("network", f),
    )
    report("compute", 0.0)
    compute, grads = probe_compute(
        work, steps=steps, budget_s=budget_s * BUDGET_SHARES["compute"], capture=CAPTURE_STEPS
    )
    report("codecs", 0.0)
    codecs = probe_codecs(
        grads, dist.get_world_size(), budget_s=budget_s * BUDGET_SHARES["codecs"],
        distribute=True,  # each rank measures a share of the grid
    )
    report("calibrate", 0.0)
    hosts = len(set(network["hosts"]))
    if calibrate == "default":
        calibrate = calibration_policies(work, hierarchical=1 < hosts < dist.get_world_size())
    calibration = _calibrate(workload, list(calibrate or []), report)
    report("calibrate", 1.0)
    env = environment(link)
    env.update(hosts=hosts, wall_s=time.perf_counter() - started)
    info = describe(work)
    data = {
        "version": 1,
        "env": env,
        "workload": {"name": work.name, "spec": workload, **{k: v for k, v in info.items() if k != "name"}},
        "network": network,
        "compute": compute,
        "codecs": codecs,
        "calibration": calibration,
    }
    if rank != 0:
        return None
    return Profile.from_dict(data, source="probed profile").to_dict()


def calibration_policies(work: Any, hierarchical: bool = False) -> list[dict[str, Any] | None]:
    """The default presets (plain DDP, fp16, PowerSGD rank 1 and 4: None for plain DDP,
    the others our equivalents), and a few random mixed policies; on hosts of several
    ranks (``hierarchical``) also the presets' hierarchical variants, whose intra-host
    stages the residual must learn to cost."""
    import random

    from autotune.probes.sampling import random_policy

    params = [(n, p.numel()) for n, p in work.model.named_parameters() if p.requires_grad]
    rng = random.Random(CALIBRATION_SEED)
    out: list[dict[str, Any] | None] = [None if p.plain else p.policy(None) for p in DEFAULT_PRESETS]
    out += [random_policy(params, rng).to_dict() for _ in range(CALIBRATION_RANDOM)]
    if hierarchical:
        out += [p.policy(None) | {"topology": "hierarchical"} for p in DEFAULT_PRESETS]
    return out


def _calibrate(workload: str, policies: list[dict[str, Any] | None], report: Report) -> dict[str, Any]:
    """Measured step times of ``policies`` on this job, interleaved."""
    if not policies:
        return {"results": []}
    setups = [{"name": f"c{i}", "kind": "ddp"} if p is None else
              {"name": f"c{i}", "kind": "policy", "policy": p} for i, p in enumerate(policies)]
    # warmup 3, as measuring does: after 2, the first timed step of every set-up (plain
    # DDP too) was 15-40% slower than the rest (2x2 ranks on 2 cores), which biased a
    # median of four steps; a set-up of second-long steps (a slow link's) is steady
    # sooner and measured in two steps (STEADY_STEP_S)
    measured = rank_measure(workload, setups, rounds=2, block=2, warmup=3, steady_s=STEADY_STEP_S)
    return {"results": [
        {"policy": p, "step_s": r["step_s_median"], "all_s": r["step_s"]}
        for p, r in zip(policies, measured["results"])
    ]}


def profile_job(
    placement: Placement,
    *,
    timeout: float = 1800.0,
    on_line: Callable[[int, str], bool] | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    """Start the ranks ``placement`` describes, run :func:`rank_profile` (``kwargs``) on
    each, and return rank 0's validated :class:`~autotune.probes.profile.Profile`."""
    from autotune.probes.profile import Profile

    data = launch("autotune.probes.run:rank_profile", kwargs=kwargs, placement=placement,
                  timeout=timeout, on_line=on_line, env=env)[0]
    return Profile.from_dict(data, source="probed profile")


def take_profile(
    workload: str,
    placement: Placement | None,
    *,
    budget_s: float = 60.0,
    steps: int = 10,
    link: str | None = None,
    report: Report | None = None,
) -> Profile | None:
    """Profile a job: start its ranks where ``placement`` says and run
    :func:`rank_profile` on each, or, with ``placement`` None, take part as one rank of
    a job torchrun started (this process initialises the process group from its
    environment).

    A bad ``workload`` fails on the ranks; resolve it first
    (:func:`autotune.workloads.resolve_workload`) to fail before any starts.

    Args:
        workload: workload spec (built-in name, ``file.py:fn`` or ``module:fn``).
        placement: where the ranks run (:func:`autotune.launch.local_placement` or an
            emulated cluster); None under torchrun.
        budget_s: seconds of probing in all (see :data:`BUDGET_SHARES`); the launched
            job may take ``max(600, 10 x budget_s)`` seconds.
        steps: measured compute-probe steps.
        link: the emulated link, recorded in the profile's environment.
        report: ``report(phase, fraction)`` for progress over :data:`PHASES`, called in
            this process (None: none).

    Returns:
        The validated Profile; None on ranks other than 0 under torchrun.
    """
    from autotune.probes.profile import Profile

    kwargs: dict[str, Any] = {"workload": workload, "budget_s": budget_s, "steps": steps,
                              "link": link}
    if placement is None:
        init_from_env()
        quiet: Report = lambda phase, fraction: None  # noqa: E731
        data = rank_profile(**kwargs, report=report if report and dist.get_rank() == 0 else quiet)
        return None if data is None else Profile.from_dict(data, source="probed profile")
    profile: Profile = profile_job(
        placement, timeout=max(600.0, 10 * budget_s),
        on_line=None if report is None else line_reader(report),
        env=None if report is None else {"AUTOTUNE_PROGRESS": "stdout"}, **kwargs)
    return profile
