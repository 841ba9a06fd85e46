"""``autotune demo``: the README's main job, end to end on a built-in workload.

Profile the job, tune a policy, and measure it against the baselines, interleaved: on
an emulated 1 Gbit link between two hosts when run as root (network namespaces), on
plain loopback otherwise. Writes profile.json, study.db, policy.json, bench.json and the
report (report/index.html; needs the ``report`` extra, else the demo says how to get it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from autotune.cli._base import (
    EXIT_OK,
    Subparsers,
    add_command,
    console,
    positive_float,
    positive_int,
)


def add_demo_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "demo",
        "profile, tune and benchmark a built-in workload against the baselines",
        "The main job: on the built-in workload with 2 ranks, take a profile, tune a\n"
        "policy, and measure it next to plain DDP, fp16, PowerSGD rank 1 and 4 (PyTorch's\n"
        "own hooks) and the compute-only floor. As root the two ranks sit on two emulated\n"
        "hosts joined by a shaped link (--link, default 1gbit); otherwise on loopback.\n"
        "Writes OUT_DIR/profile.json, study.db, policy.json, bench.json and\n"
        "OUT_DIR/report/index.html (`autotune report`, needs matplotlib).",
    )
    parser.add_argument("--workload", default="cnn",
                        help="built-in name, path/to/file.py:function or package.module:function "
                             "(a file or module is imported: this runs that file's code, as "
                             "`python file.py` would)")
    parser.add_argument("--link", default="1gbit",
                        help="emulated link between the two hosts when run as root ('none': loopback)")
    parser.add_argument("--budget-s", type=positive_float, default=40.0, help="probing budget")
    parser.add_argument("--trials", type=positive_int, default=200, help="tuning trials")
    parser.add_argument("--steps", type=positive_int, default=9, help="measured steps per configuration")
    parser.add_argument("--out-dir", type=Path, default=Path("."),
                        help="where profile.json, policy.json, the study, bench.json and report/ are written")
    parser.set_defaults(func=cmd_demo)
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    from autotune.cli.bench import DEFAULT_BASELINES, print_bench, run_bench
    from autotune.cli.profile import take_profile
    from autotune.cli.simulate import baseline_policies
    from autotune.emulate import available
    from autotune.errors import AutotuneError
    from autotune.jsonio import write_atomic
    from autotune.report import require_matplotlib, write_report
    from autotune.report.data import load_study
    from autotune.search.tuner import tune

    out = console()
    try:
        require_matplotlib()
        no_report = None
    except AutotuneError as exc:  # the demo still runs; it says at the end what is missing
        no_report = str(exc)
    started = time.perf_counter()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    emulate, why = available()
    if args.link == "none" or not emulate:
        where = "2 local ranks on loopback" + ("" if args.link == "none" else f" ({why})")
        args.hosts, args.nproc_per_node, args.link = 1, 2, None
    else:
        where = f"2 emulated hosts joined by a {args.link} link, one rank each"
        args.hosts, args.nproc_per_node = 2, 1
    out.print(f"[bold]autotune demo[/bold]: {args.workload} on {where}")

    out.rule("1. profile")
    profile = take_profile(args)
    profile.save(args.out_dir / "profile.json")
    out.print(f"wrote {args.out_dir / 'profile.json'}")

    out.rule("2. tune")
    storage = f"sqlite:///{(args.out_dir / 'study.db').resolve()}"
    result = tune(profile, trials=args.trials, storage=storage)
    result.policy.save(args.out_dir / "policy.json")
    layers = sorted({s.label() for s in result.policy.layers.values()}) or ["none"]
    out.print(f"wrote {args.out_dir / 'policy.json'}: {result.chosen} policy {result.policy.id}, "
              f"bucket cap {result.policy.bucket_cap_mb:g} MB, compressors: {', '.join(layers)}; "
              f"predicted {result.policy.meta['predicted_step_s'] * 1e3:.0f} ms per step")

    out.rule("3. measure, interleaved")
    args.baselines = list(DEFAULT_BASELINES)
    args.block, args.warmup = 3, 3
    bench = run_bench(args, result.policy)
    print_bench(bench)
    write_atomic(args.out_dir / "bench.json", json.dumps(bench, indent=1) + "\n", AutotuneError, "results")
    medians = {r["name"]: r["step_s_median"] for r in bench["results"]}
    best_base = min(medians[n] for n in DEFAULT_BASELINES)
    out.print(f"tuned policy: {medians['ddp'] / medians['policy']:.2f}x plain DDP, "
              f"{best_base / medians['policy']:.2f}x the best baseline, "
              f"{medians['policy'] / medians['floor']:.2f}x the compute-only floor "
              f"(demo took {time.perf_counter() - started:.0f} s)")

    out.rule("4. report")
    if no_report is not None:
        out.print(f"no report written: {no_report}")
        return EXIT_OK
    page = write_report(profile, args.out_dir / "report", baseline_policies(), policy=result.policy,
                        study=load_study(storage, None, profile), bench=bench)
    out.print(f"wrote {page}: open it in a browser")
    return EXIT_OK
