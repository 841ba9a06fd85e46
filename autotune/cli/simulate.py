"""``autotune simulate``: predicted step time and breakdown, with what-if questions."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from rich.table import Table

from autotune.cli._base import EXIT_OK, Subparsers, add_command, console, positive_float
from autotune.cli.profile import check_out_path
from autotune.errors import AutotuneError, ProfileError
from autotune.links import parse_link
from autotune.models.cost_model import CostModel
from autotune.models.external import full_model
from autotune.models.simulator import WhatIf
from autotune.models.trace import write_trace
from autotune.models.zhang2020 import default_vec_add, paper_model, read_zhang2020
from autotune.policies import Policy, load_policy
from autotune.probes.profile import load_profile
from autotune.search.tuner import baseline_policies


def _rates(text: str) -> list[float]:
    try:
        return [parse_link(part.strip()).rate_bps for part in text.split(",") if part.strip()]
    except AutotuneError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"compression ratios must be >= 1, got {text!r}")
    return values


def add_simulate_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "simulate",
        "Predict one training step from a profile: plain DDP, fp16, PowerSGD rank 1 and 4\n"
        "everywhere, and --policy if given; for every --world-size x --bandwidth point.\n\n"
        "Zhang et al. 2020's V100 logs can be read instead of a profile (--zhang2020);\n"
        "--paper-model then applies that paper's own assumptions (5 ms / 64 MB flushes,\n"
        "ring allreduce, compression divides network time only), otherwise autotune's full\n"
        "model with a real compressor per ratio and its encode/decode time.\n\n"
        "examples:\n  autotune simulate profile.json --policy policy.json --bandwidth 100mbit,10gbit\n"
        "  autotune simulate --zhang2020 resnet50.bk.log --paper-model --world-size 16,32,64 \\\n"
        "      --bandwidth 1gbit,10gbit,100gbit --compression 1,2,5 --json",
    )
    parser.add_argument("profile", nargs="?", type=Path, help="profile.json from `autotune profile`")
    parser.add_argument("--policy", type=Path, help="a policy to predict beside the baselines")
    parser.add_argument("--bandwidth", type=_rates, default=None,
                        help="link rates to ask about, e.g. 100mbit,1gbit,10gbit (default: as measured)")
    parser.add_argument("--world-size", type=_ints, default=None,
                        help="world sizes to ask about, e.g. 2,8,64 (default: as measured)")
    parser.add_argument("--hosts", type=_ints, default=None,
                        help="hosts the ranks spread over, e.g. 2,4 (default: ranks per host as "
                             "measured); with several ranks per host, every policy is also "
                             "predicted hierarchical (summed inside hosts, compressed between them)")
    parser.add_argument("--intra-link", type=_rates, default=None, metavar="RATE",
                        help="intra-host link rate for hierarchical predictions, e.g. 100gbit "
                             "(default: as measured; needed when the profile had one rank per host)")
    parser.add_argument("--compute-speed", type=positive_float, default=1.0,
                        help="compute this many times faster (profile mode)")
    parser.add_argument("--trace", type=Path, help="write the policy's (or DDP's) timeline as "
                        "Chrome trace-event JSON (open in https://ui.perfetto.dev)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--zhang2020", type=Path, metavar="LOG",
                        help="a *.bk.log from Zhang et al. 2020 instead of a profile")
    parser.add_argument("--paper-model", action="store_true",
                        help="with --zhang2020: the paper's own cost model")
    parser.add_argument("--compression", type=_floats, default=[1.0],
                        help="with --zhang2020: compression ratios, e.g. 1,2,5")
    parser.set_defaults(func=cmd_simulate)
    return parser


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.trace is not None:
        check_out_path(args.trace, "trace")
    if args.zhang2020 is not None:
        if args.profile is not None or args.policy is not None:
            raise ProfileError("--zhang2020 replaces the profile; give one or the other, and no --policy")
        results = _zhang(args)
    else:
        if args.paper_model:
            raise ProfileError("--paper-model applies to --zhang2020 logs only")
        if args.profile is None:
            raise ProfileError("give a profile.json (or --zhang2020 LOG)")
        results = _profile(args)
    if args.json:
        sys.stdout.write(json.dumps({"results": results}, indent=1) + "\n")
    else:
        _print(results)
    return EXIT_OK


def _profile(args: argparse.Namespace) -> list[dict[str, Any]]:
    profile = load_profile(args.profile)
    model = CostModel.fit(profile)
    configs: list[tuple[str, Policy | None]] = []
    if args.policy is not None:
        policy = load_policy(args.policy)
        unknown = sorted(set(policy.layers) - set(profile.compute.param_names))
        if unknown:
            raise ProfileError(f"{args.policy}: names parameters the profiled model lacks: "
                               f"{', '.join(unknown[:5])}")
        configs.append(("policy", policy))
    configs += baseline_policies().items()
    worlds = args.world_size or [model.world_size]
    rates = args.bandwidth or [model.link_bps]
    hosts_grid: list[int | None] = list(args.hosts) if args.hosts else [None]
    intra = args.intra_link[0] if args.intra_link else None
    results = []
    traced = None
    for (name, policy), world, hosts, rate in itertools.product(configs, worlds, hosts_grid, rates):
        what_if = WhatIf(
            world_size=world if world != model.world_size else None,
            bandwidth_bps=rate if rate is not None and rate != model.link_bps else None,
            compute_speed=args.compute_speed, hosts=hosts, intra_bandwidth_bps=intra,
        )
        layout = model.layout(what_if, world)
        variants = [(name, policy)]
        if layout.hierarchical:  # the same method, summed inside each host first
            flat = policy if policy is not None else Policy.uniform("none")
            variants.append((f"{name} hierarchical",
                             Policy.from_dict({**flat.to_dict(), "topology": "hierarchical"})))
        for label, variant in variants:
            est = model.predict(variant, what_if)
            results.append({"name": label, "world_size": world, "hosts": layout.hosts,
                            "bandwidth_bps": rate, "step_s": est.step_s,
                            **{k: v for k, v in est.breakdown().items() if k != "step_s"},
                            "wire_bytes": est.wire_bytes, "collectives": est.collectives})
        if traced is None:
            traced = (name, est)
    if args.trace is not None and traced is not None:
        write_trace(args.trace, traced[1], title=f"{traced[0]} on {profile.workload.name}")
    return results


def _zhang(args: argparse.Namespace) -> list[dict[str, Any]]:
    profile = read_zhang2020(args.zhang2020)
    vec_add = default_vec_add(profile)
    worlds = args.world_size or [16, 32, 64]
    rates = args.bandwidth or [1e9, 10e9, 100e9]
    results = []
    for world, rate, ratio in itertools.product(worlds, rates, args.compression):
        if args.paper_model:
            r = paper_model(profile, world, rate, ratio, vec_add)
            results.append({"name": "paper", "model": profile.name, "world_size": world,
                            "bandwidth_bps": rate, "compression": ratio, "step_s": r["step_s"],
                            "exposed_comm_s": r["exposed_comm_s"],
                            "scaling_factor": r["scaling_factor"]})
        else:
            r = full_model(profile, world, rate, ratio, vec_add)
            r.pop("policy", None)
            results.append(r)
    return results


def _print(results: list[dict[str, Any]]) -> None:
    out = console()
    zhang = "compression" in results[0] if results else False
    table = Table(title="predicted step time" + (" (Zhang et al. 2020 profile)" if zhang else ""))
    cols = ["config", "world", *([] if zhang else ["hosts"]), "link Gbit/s", "step ms"]
    cols += (["compression", "scaling factor"] if zhang else
             ["compute ms", "codec ms", "comm ms", "exposed ms", "wire MB"])
    for col in cols:
        table.add_column(col, justify="left" if col == "config" else "right")
    for r in results:
        rate = f"{r['bandwidth_bps'] / 1e9:g}" if r.get("bandwidth_bps") else "measured"
        row = [r.get("compressor", r["name"]), str(r["world_size"]),
               *([] if zhang else [str(r["hosts"])]), rate, f"{r['step_s'] * 1e3:.1f}"]
        if zhang:
            row += [f"{r['compression']:g}", f"{r['scaling_factor']:.3f}"]
        else:
            # bytes this rank hands to collectives per step (data-dependent methods at
            # the profile's measured row densities)
            row += [f"{r['compute_s'] * 1e3:.1f}", f"{r['codec_s'] * 1e3:.1f}",
                    f"{r['comm_s'] * 1e3:.1f}", f"{r['exposed_comm_s'] * 1e3:.1f}",
                    f"{r['wire_bytes'] / 1e6:.3f}"]
        table.add_row(*row)
    out.print(table)
