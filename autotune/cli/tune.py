"""``autotune tune``: search the best policy for a profile; write policy JSON."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autotune.cli._base import EXIT_OK, Subparsers, add_command, console, positive_int
from autotune.cli.profile import check_out_path, placement
from autotune.cli.tables import print_verification
from autotune.errors import AutotuneError
from autotune.probes.profile import Profile, load_profile
from autotune.search.defaults import (
    DEFAULT_BUDGET_S,
    DEFAULT_CANDIDATES,
    DEFAULT_EXACT_MARGIN,
    DEFAULT_MAX_ERROR,
    candidate_pool,
)
from autotune.search.tuner import tune
from autotune.search.verify import candidates, learned, verify_result
from autotune.workloads import resolve_workload


def _max_error(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def add_tune_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "tune",
        "Fit the cost model to a profile, then search bucket size and per-parameter\n"
        "compressors with Optuna (baselines first: plain DDP at several bucket sizes,\n"
        "fp16, bf16, PowerSGD rank 1 and 4), refine layer by layer, then verify: measure\n"
        "the best candidates beside plain DDP and PyTorch's own hooks on the cluster the\n"
        "profile describes (its workload, hosts, ranks per host, link), interleaved, until\n"
        "a bootstrap 95% interval separates the fastest or --verify-budget ends, and write\n"
        "the measured fastest within the error budget. When a baseline wins, its\n"
        "equivalent policy is written, and the table says so.\n\n"
        "examples:\n  autotune tune profile.json --out policy.json\n"
        "  autotune tune profile.json --storage sqlite:///study.db --study-name cnn --trials 500\n"
        "  autotune tune profile.json --no-verify",
    )
    parser.add_argument("profile", type=Path, help="profile.json from `autotune profile`")
    parser.add_argument("--out", type=Path, default=Path("policy.json"), help="policy file to write")
    parser.add_argument("--max-error", type=_max_error, default=DEFAULT_MAX_ERROR,
                        help="compression-error budget: relative error of the whole gradient "
                             "over the profiled steps, or of its worst layer where one is above "
                             "0.85 (see docs; bench/convergence.py justifies the default)")
    parser.add_argument("--trials", type=positive_int, default=200, help="Optuna trials")
    parser.add_argument("--seed", type=int, default=0, help="sampler seed (same profile and seed: "
                                                            "same policy)")
    parser.add_argument("--verify", type=int, default=DEFAULT_CANDIDATES, metavar="K",
                        help="measure K tuned candidates (spread over the predicted error/time "
                             "Pareto front) beside plain DDP, PyTorch's own hooks and our "
                             "policies for the same methods on the live job, interleaved, and "
                             "write the measured fastest within the error budget (a tie goes to "
                             f"the simpler) (default: {DEFAULT_CANDIDATES}; 0 or --no-verify: "
                             "choose by prediction alone). What it measures of our policies is "
                             "added to the profile's calibration, which the cost model learns from")
    parser.add_argument("--no-verify", dest="verify", action="store_const", const=0,
                        help="choose by the cost model's prediction alone (no job is started)")
    parser.add_argument("--verify-budget", type=_positive_seconds, default=DEFAULT_BUDGET_S,
                        metavar="SECONDS",
                        help="measurement time, after the first round every set-up runs, after "
                             "which the lowest median wins even if its lead is within noise "
                             f"(default: {DEFAULT_BUDGET_S:g})")
    parser.add_argument("--exact-margin", type=_fraction, default=DEFAULT_EXACT_MARGIN,
                        metavar="FRACTION",
                        help="write an exact set-up (error 0: plain DDP, rowsparse, a lossless "
                             "mix) measured within this fraction of a faster lossy one instead "
                             f"(default: {DEFAULT_EXACT_MARGIN:g}: the fastest within the error budget wins, "
                             "ties going to the simpler)")
    parser.add_argument("--storage", default=None,
                        help="Optuna storage URL, e.g. sqlite:///study.db (default: in memory)")
    parser.add_argument("--study-name", default=None,
                        help="study to create or resume (default: autotune-<profile fingerprint>)")
    parser.add_argument("--workload", default=None,
                        help="with --verify: the workload (default: the profile's); its model "
                             "must have the profiled parameters (names and shapes), else exit 2. "
                             "A file.py:fn workload runs that file's code")
    parser.add_argument("--nproc-per-node", type=positive_int, default=None,
                        help="with --verify: ranks per host (default: the profile's); a cluster "
                             "other than the profiled one is allowed, with a warning")
    parser.add_argument("--hosts", type=positive_int, default=None,
                        help="with --verify: emulated hosts (default: the profile's)")
    parser.add_argument("--link", default=None, help="with --verify: emulated link (default: the profile's)")
    parser.set_defaults(func=cmd_tune)
    return parser


def cmd_tune(args: argparse.Namespace) -> int:
    out = console()
    profile = load_profile(args.profile)
    check_out_path(args.out, "policy")
    if args.verify < 0:
        raise AutotuneError(f"--verify takes a number of candidates >= 0, got {args.verify}")
    if args.storage is not None and "://" not in args.storage:
        raise AutotuneError(f"--storage must be an Optuna storage URL such as sqlite:///study.db, "
                            f"got {args.storage!r}")
    if args.verify:
        _verify_job(args, profile)  # before the search: a wrong workload fails in seconds
    progress = Progress(TextColumn("trials"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=out)
    with progress:
        task = progress.add_task("trials", total=args.trials)
        result = tune(profile, max_error=args.max_error, trials=args.trials, seed=args.seed,
                      storage=args.storage, study_name=args.study_name,
                      progress=lambda done, total: progress.update(task, completed=done),
                      top_k=candidate_pool(args.verify))
    policy = result.policy
    verified = None
    if args.verify:
        policy, verified = _verify(args, profile, result, out)
    policy.save(args.out)
    _print(out, result, policy, verified)
    if verified:
        _learn(out, args.profile, profile, verified)
    out.print(f"wrote {args.out} (policy {policy.id}; {result.trials} trials in the study, "
              f"{result.wall_s:.1f} s)")
    return EXIT_OK


def _learn(out: Any, path: Path, profile: Profile, report: dict[str, Any]) -> None:
    """Add what verification measured of our own policies to the profile's calibration,
    which the cost model's residual is fitted on: every verification teaches the next
    tune. The profile is rewritten atomically."""
    replace(profile, calibration=learned(profile.calibration, report)).save(path)
    accuracy = report.get("_summary", {}).get("model_accuracy") or {}
    line = f"added the verification's measurements to {path}'s calibration (the next tune fits on them)"
    if accuracy:
        tau, apart = accuracy.get("kendall_tau_baselines"), accuracy.get("kendall_tau_baselines_separated")
        line += (f"; the cost model's predicted ratio to DDP erred by {accuracy['median_ratio_error']:.1%} "
                 "(median)" + (f", Kendall tau among the baselines {tau:.2f}" if tau is not None else "")
                 + (f" ({apart:.2f} over the {accuracy['separated_pairs']} pairs measured apart)"
                    if apart is not None else ""))
    out.print(line, soft_wrap=True)


def _verify_job(args: argparse.Namespace, profile: Any) -> None:
    """Fill the live job's flags from the profile, and check the job against it.

    Another workload is an error: the candidates name the profiled parameters, and their
    predicted costs are of the profiled shapes. Another cluster (ranks, hosts, link) is
    allowed with a warning: a policy applies to any world size, and --verify chooses by
    what it measures on the live job, so only the ranking that picked the candidates
    was made for the profiled cluster.
    """
    env = profile.env
    args.workload = args.workload or profile.workload.spec or profile.workload.name
    args.hosts = args.hosts or (env.hosts if env.link else 1)
    args.nproc_per_node = args.nproc_per_node or max(1, env.world_size // args.hosts)
    # an emulated link needs emulated hosts: `--hosts 1` verifies on local ranks
    args.link = args.link or (env.link if args.hosts > 1 else None)
    profile.check_model(resolve_workload(args.workload).model, f"--workload {args.workload}")
    profiled = (env.world_size, env.hosts, env.link)
    live = (args.hosts * args.nproc_per_node, args.hosts, args.link)
    if live != profiled:
        def job(world: int, hosts: int, link: str | None) -> str:
            return f"{world} rank(s) on {hosts} host(s)" + (f" at {link}" if link else "")

        Console(stderr=True, highlight=False).print(
            f"[yellow]warning:[/yellow] the profile was taken on {job(*profiled)}; verifying on "
            f"{job(*live)}. The candidates were ranked by predictions for the profiled "
            "cluster; the measurement on this one chooses among them.",
            soft_wrap=True,
        )


def _verify(args: argparse.Namespace, profile: Any, result: Any, out: Any) -> tuple[Any, dict[str, Any]]:
    count = len(candidates(result, args.verify))
    backend = profile.env.backend
    with placement(args) as where, out.status(
        f"verifying {count} candidates beside the baselines on the live job "
        f"(at most {args.verify_budget:g} s of measurement)"
    ):
        return verify_result(result, args.verify, args.workload, where,
                             budget_s=args.verify_budget, backend=backend,
                             exact_margin=args.exact_margin)


def budget_line(max_error: float) -> str:
    """What the error budget in force means, from bench/convergence.py."""
    line = f"error budget {max_error:g}"
    if max_error == DEFAULT_MAX_ERROR:
        line += (" (the default: its policies lost 1.0 point of accuracy on digits, 0.3-1.2 on "
                 "the cnn and none on the transformer; PowerSGD rank 1 at 0.70-0.95 lost 2, 42 "
                 "and 12; see bench/convergence.py)")
    return line


def _print(out: Any, result: Any, policy: Any, verified: dict[str, Any] | None) -> None:
    out.print(budget_line(float(policy.meta.get("max_error", DEFAULT_MAX_ERROR))), soft_wrap=True)
    if verified:
        print_verification(out, policy.meta)
        return
    ref = next((b.predicted_s for b in result.baselines if b.name == "ddp"), result.tuned.predicted_s)
    table = Table(title="predicted step time (the cost model fitted to the profile; not verified)")
    for col in ["policy", "predicted ms", "speedup vs DDP", "error", "within budget"]:
        table.add_column(col, justify="left" if col == "policy" else "right")
    chosen = policy.meta.get("chosen", result.chosen)
    for c in [*result.baselines, result.tuned]:
        name = ("tuned" if c is result.tuned else c.name) + ("  <- written" if (
            (c is result.tuned and chosen == "tuned") or c.name == chosen) else "")
        table.add_row(name, f"{c.predicted_s * 1e3:.1f}", f"{ref / c.predicted_s:.2f}x",
                      f"{c.error:.3f}", "yes" if c.feasible else "no")
    out.print(table)
