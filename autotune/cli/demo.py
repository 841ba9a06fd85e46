"""``autotune demo``: the README's main job."""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.cli._base import EXIT_OK, Subparsers, add_command, console, positive_int


def add_demo_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Declare ``autotune demo``."""
    parser = add_command(
        subparsers,
        "demo",
        "train a built-in workload on local ranks under plain DDP and a mixed policy",
        "Train the built-in workload on local gloo ranks, interleaving plain DDP and a\n"
        "policy that compresses large tensors, and print each compressor's bytes on the\n"
        "wire and the step times. Writes the policy to OUT_DIR/policy.json.",
    )
    parser.add_argument("--workload", default="cnn",
                        help="built-in name, path/to/file.py:function or package.module:function")
    parser.add_argument("--nproc-per-node", type=positive_int, default=2,
                        help="local ranks to run")
    parser.add_argument("--rounds", type=positive_int, default=4,
                        help="interleaved blocks per set-up")
    parser.add_argument("--block", type=positive_int, default=5, help="steps per block")
    parser.add_argument("--out-dir", type=Path, default=Path("."),
                        help="where policy.json is written")
    parser.set_defaults(func=cmd_demo)
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    from autotune.demo import run_demo

    run_demo(console(), args.workload, args.nproc_per_node, args.rounds, args.block,
             args.out_dir)
    return EXIT_OK
