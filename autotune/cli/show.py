"""``autotune show FILE``: print a policy or a profile."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autotune.cli._base import EXIT_OK, Subparsers, add_command, console
from autotune.cli.tables import print_profile, print_verification
from autotune.errors import PolicyError
from autotune.jsonio import read_json
from autotune.policies import Policy
from autotune.probes.profile import Profile


def add_show_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Declare ``autotune show FILE.json [--json]``."""
    parser = add_command(
        subparsers,
        "show",
        "Validate a policy or profile file and print it. A policy: its id, bucket cap,\n"
        "default compressor, and the compressor of every parameter with its own entry.\n"
        "A profile: link classes with fitted bandwidth and latency, the heaviest layers,\n"
        "and codec costs, as `autotune profile` prints them, with how many codec cells\n"
        "were extrapolated from row samples of large tensors and how many are missing,\n"
        "and the gradients that are row-sparse (most rows zero: embedding tables).\n\n"
        "example:\n  autotune show policy.json\n  autotune show policy.json --json | jq .layers\n"
        "  autotune show profile.json",
    )
    parser.add_argument("policy", metavar="FILE.json", help="the policy or profile file to show")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the file as canonical JSON instead of tables",
    )
    parser.set_defaults(func=cmd_show)
    return parser


def cmd_show(args: argparse.Namespace) -> int:
    """Print the policy or profile ``args.policy`` as tables, or as JSON with ``--json``."""
    data = read_json(args.policy, PolicyError, "policy or profile")
    if isinstance(data, dict) and "compute" in data and "layers" not in data:
        profile = Profile.from_dict(data, source=args.policy)
        if args.json:
            sys.stdout.write(profile.to_json() + "\n")
        else:
            print_profile(console(), profile)
        return EXIT_OK

    policy = Policy.from_dict(data, source=args.policy)
    if args.json:
        sys.stdout.write(policy.to_json() + "\n")
    else:
        _print_policy(console(), policy, source=args.policy)
    return EXIT_OK


def _print_policy(console: Console, policy: Policy, source: str) -> None:
    console.print(Text.assemble(("policy ", "bold"), (policy.id, "bold cyan"), f"  ({source})"))
    console.print(f"bucket cap: {policy.bucket_cap_mb:g} MB")
    if policy.topology != "flat":
        console.print(f"topology: {policy.topology} (summed inside each host, compressed "
                      "between one leader per host)")
    console.print(Text(f"default: {policy.default.label()}"))
    table = Table(title=f"{len(policy.layers)} layer entries", title_justify="left")
    table.add_column("parameter", no_wrap=True)
    table.add_column("compressor", no_wrap=True)
    table.add_column("params")
    table.add_row(
        Text("(default: every other parameter)", style="italic"),
        Text(policy.default.name),
        Text(_params(policy.default.kwargs)),
    )
    for name, spec in policy.layers.items():
        # Text, not markup: a name may contain "[", which rich would take as a tag
        table.add_row(Text(name), Text(spec.name), Text(_params(spec.kwargs)))
    console.print(table)
    scalars = {k: v for k, v in policy.meta.items() if isinstance(v, (str, int, float, bool))}
    for key, value in scalars.items():
        console.print(Text(f"meta.{key}: {value}", style="dim"))
    if policy.meta.get("verified"):
        print_verification(console, policy.meta)
    nested = len(policy.meta) - len(scalars) - (1 if policy.meta.get("verified") else 0)
    if nested:
        console.print(Text(f"meta: {nested} nested entries not shown (see --json)", style="dim"))


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


