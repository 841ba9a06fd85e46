"""``autotune report``: a static HTML page with figures from a profile and what followed."""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.cli._base import EXIT_OK, Subparsers, add_command, console
from autotune.errors import AutotuneError
from autotune.policies import load_policy
from autotune.probes.profile import load_profile
from autotune.report import require_matplotlib, write_report
from autotune.report.data import load_bench, load_revisions, load_study
from autotune.search.tuner import baseline_policies


def add_report_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "report",
        "Write OUT/index.html with PNG figures (readable offline): the predicted timeline\n"
        "of one step for plain DDP and the policy; step time against link rate for plain\n"
        "DDP, fp16, PowerSGD rank 1 and 4 and the policy, with the rate below which\n"
        "compression pays; a study's trials as error against predicted step time with the\n"
        "Pareto front; a per-layer table; measurements beside predictions (--bench,\n"
        "--revisions). Needs matplotlib: pip install 'ddp-autotune[report]'.\n\n"
        "examples:\n  autotune report profile.json --policy policy.json -o report/\n"
        "  autotune report profile.json --policy policy.json --study sqlite:///study.db \\\n"
        "      --study-name cnn --bench bench.json -o report/",
    )
    parser.add_argument("profile", type=Path, help="profile.json from `autotune profile`")
    parser.add_argument("--policy", type=Path, help="the tuned policy.json")
    parser.add_argument("--study", default=None, metavar="STORAGE",
                        help="Optuna storage of `autotune tune --storage`, e.g. sqlite:///study.db")
    parser.add_argument("--study-name", default=None,
                        help="the study in --study; if omitted, the tuner's name for this profile, "
                             "or the storage's only study")
    parser.add_argument("--bench", type=Path, default=None,
                        help="measured step times: `autotune bench --json` output or "
                             "bench/results/tuned_vs_baselines.json")
    parser.add_argument("--revisions", type=Path, default=None,
                        help="the online controller's JSONL log (autotune.wrap(..., log=...))")
    parser.add_argument("-o", "--out", type=Path, default=Path("report"),
                        help="directory to write index.html and the figures into")
    parser.set_defaults(func=cmd_report)
    return parser


def cmd_report(args: argparse.Namespace) -> int:
    require_matplotlib()  # before the heavy imports: a missing extra is told at once

    if args.study_name is not None and args.study is None:
        raise AutotuneError("--study-name needs --study (the Optuna storage URL)")
    if args.out.exists() and not args.out.is_dir():
        raise AutotuneError(f"{args.out}: exists and is not a directory")
    profile = load_profile(args.profile)
    policy = load_policy(args.policy) if args.policy is not None else None
    study = load_study(args.study, args.study_name, profile) if args.study is not None else None
    bench = load_bench(args.bench) if args.bench is not None else None
    revisions = load_revisions(args.revisions) if args.revisions is not None else ()
    out = console()
    with out.status("fitting the cost model and drawing the figures"):
        page = write_report(profile, args.out, baseline_policies(), policy=policy, study=study,
                            bench=bench, revisions=revisions)
    out.print(f"wrote {page}")
    return EXIT_OK
