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
from typing import Any

from autotune.cli._base import (
    EXIT_OK,
    Subparsers,
    add_command,
    console,
    positive_float,
    positive_int,
)
from autotune.cli.bench import DEFAULT_BASELINES, measure, print_bench
from autotune.cli.profile import cluster, probe
from autotune.cli.tables import print_verification
from autotune.emulate import available
from autotune.errors import AutotuneError
from autotune.jsonio import write_atomic
from autotune.report import require_matplotlib, write_report
from autotune.report.data import load_study
from autotune.search.defaults import candidate_pool
from autotune.search.tuner import baseline_policies, tune
from autotune.search.verify import DEFAULT_CANDIDATES, verify_result
from autotune.workloads import resolve_workload


def add_demo_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "demo",
        "The main job: on the built-in workload with 2 ranks, take a profile, tune a\n"
        "policy, and measure it next to plain DDP, fp16, PowerSGD rank 1 and 4 (PyTorch's\n"
        "own hooks) and the compute-only floor. As root the ranks sit on emulated hosts\n"
        "(--hosts, default 2, with --nproc-per-node ranks each, default 1) joined by a\n"
        "shaped link (--link, default 1gbit); otherwise 2 ranks on loopback.\n"
        "Writes OUT_DIR/profile.json, study.db, policy.json, bench.json and\n"
        "OUT_DIR/report/index.html (`autotune report`, needs matplotlib).",
    )
    parser.add_argument("--workload", default="cnn",
                        help="built-in name, path/to/file.py:function or package.module:function "
                             "(a file or module is imported: this runs that file's code, as "
                             "`python file.py` would)")
    parser.add_argument("--link", default="1gbit",
                        help="emulated link between the hosts when run as root ('none': loopback)")
    parser.add_argument("--hosts", type=positive_int, default=2,
                        help="emulated hosts when run as root (with --link none or without "
                             "root: one host)")
    parser.add_argument("--nproc-per-node", type=positive_int, default=None,
                        help="ranks per host (default: 1 on emulated hosts, 2 on one host)")
    parser.add_argument("--budget-s", type=positive_float, default=40.0, help="probing budget")
    parser.add_argument("--trials", type=positive_int, default=200, help="tuning trials")
    parser.add_argument("--steps", type=positive_int, default=9, help="measured steps per configuration")
    parser.add_argument("--out-dir", type=Path, default=Path("."),
                        help="where profile.json, policy.json, the study, bench.json and report/ are written")
    parser.set_defaults(func=cmd_demo)
    return parser


def verdict(bench: dict[str, Any], result: Any, policy: Any) -> str:
    """One sentence: how much faster than DDP the written policy measured, against which
    best baseline, at what error; the best baseline overall and the best within the
    error budget are both named, each with its error."""
    medians = {r["name"]: r["step_s_median"] for r in bench["results"]}
    budget = float(policy.meta.get("max_error", 0.0))
    errors = {b.name: b.error for b in result.baselines}
    errors["ddp"] = 0.0
    names = [n for n in medians if n not in ("policy", "floor") and n in errors]
    ours, error = medians["policy"], float(policy.meta.get("error", 0.0))
    best = min(names, key=lambda n: medians[n])
    within = [n for n in names if errors[n] <= budget]
    text = (f"the written policy ({policy.meta.get('chosen')}, error {error:.3f}) measured "
            f"{medians['ddp'] / ours:.2f}x faster than plain DDP; the best baseline overall is "
            f"{best} at {medians[best] * 1e3:.0f} ms (error {errors[best]:.3f}"
            + (", over" if errors[best] > budget else ", within")
            + f" the {budget:g} budget), {medians[best] / ours:.2f}x the written policy's time")
    if within and best not in within:
        ok = min(within, key=lambda n: medians[n])
        text += (f"; the best within the budget is {ok} at {medians[ok] * 1e3:.0f} ms "
                 f"(error {errors[ok]:.3f}), {medians[ok] / ours:.2f}x")
    return text


def cmd_demo(args: argparse.Namespace) -> int:
    out = console()
    try:
        require_matplotlib()
        no_report = None
    except AutotuneError as exc:  # the demo still runs; it says at the end what is missing
        no_report = str(exc)
    started = time.perf_counter()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    emulate, why = available()
    link: str | None = args.link
    if link == "none" or not emulate or args.hosts == 1:
        hosts, nproc_per_node, link = 1, args.nproc_per_node or 2, None
        reason = "" if args.link == "none" or args.hosts == 1 else f" ({why})"
        where = f"{nproc_per_node} local ranks on loopback{reason}"
    else:
        hosts, nproc_per_node = args.hosts, args.nproc_per_node or 1
        where = (f"{hosts} emulated hosts joined by a {link} link, "
                 + ("one rank each" if nproc_per_node == 1 else f"{nproc_per_node} ranks each"))
    out.print(f"[bold]autotune demo[/bold]: {args.workload} on {where}")

    out.rule("1. profile")
    resolve_workload(args.workload)  # a bad spec fails here, before any rank starts
    with cluster(hosts, nproc_per_node, link) as ranks:
        profile = probe(args.workload, ranks, args.budget_s, args.steps, link)
    profile.save(args.out_dir / "profile.json")
    out.print(f"wrote {args.out_dir / 'profile.json'}")

    out.rule("2. tune, then verify by measurement")
    storage = f"sqlite:///{(args.out_dir / 'study.db').resolve()}"
    result = tune(profile, trials=args.trials, storage=storage, top_k=candidate_pool(DEFAULT_CANDIDATES))
    with cluster(hosts, nproc_per_node, link) as ranks, \
            out.status("verifying the best candidates beside the baselines"):
        policy, _ = verify_result(result, DEFAULT_CANDIDATES, args.workload, ranks,
                                  backend=profile.env.backend)
    print_verification(out, policy.meta)
    policy.save(args.out_dir / "policy.json")
    layers = sorted({s.label() for s in policy.layers.values()}) or [policy.default.label()]
    out.print(f"wrote {args.out_dir / 'policy.json'}: {policy.meta['chosen']} policy {policy.id}, "
              f"bucket cap {policy.bucket_cap_mb:g} MB, compressors: {', '.join(layers)}")

    out.rule("3. measure, interleaved")
    with cluster(hosts, nproc_per_node, link) as ranks:
        bench = measure(args.workload, ranks, list(DEFAULT_BASELINES), policy, args.steps,
                        block=3, warmup=3)
    bench.update(link=link, hosts=hosts, nproc_per_node=nproc_per_node)
    print_bench(bench)
    write_atomic(args.out_dir / "bench.json", json.dumps(bench, indent=1) + "\n", AutotuneError, "results")
    out.print(verdict(bench, result, policy) + f" (demo took {time.perf_counter() - started:.0f} s)",
              soft_wrap=True)

    out.rule("4. report")
    if no_report is not None:
        out.print(f"no report written: {no_report}")
        return EXIT_OK
    page = write_report(profile, args.out_dir / "report", baseline_policies(), policy=policy,
                        study=load_study(storage, None, profile), bench=bench)
    out.print(f"wrote {page}: open it in a browser")
    return EXIT_OK
