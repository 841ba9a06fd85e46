"""What every subcommand shares: the parser classes, exit statuses, the console."""

from __future__ import annotations

import argparse
from typing import NoReturn

from rich.console import Console

# what add_subparsers() returns; subcommand modules add their parsers to it
Subparsers = argparse._SubParsersAction

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; raised from its handler, like Ctrl-C's KeyboardInterrupt, so that
    every way out runs: ranks ended, emulated hosts removed, no half-written file."""

PROG = "autotune"

COMMANDS: dict[str, tuple[str, str]] = {
    "profile": ("measure the cluster and the model: network, compute and codec probes",
                "autotune.cli.profile:add_profile_parser"),
    "tune": ("search the fastest policy within a compression-error budget",
             "autotune.cli.tune:add_tune_parser"),
    "simulate": ("predict step time and its breakdown for a policy and the baselines, with what-ifs",
                 "autotune.cli.simulate:add_simulate_parser"),
    "bench": ("measure step times of a policy, the baselines and the compute-only floor",
              "autotune.cli.bench:add_bench_parser"),
    "show": ("print a policy or a profile", "autotune.cli.show:add_show_parser"),
    "report": ("write an HTML report: step timelines, step time against bandwidth, the search",
               "autotune.cli.report:add_report_parser"),
    "demo": ("profile, tune and benchmark a built-in workload against the baselines",
             "autotune.cli.demo:add_demo_parser"),
    "launch": ("run a torchrun-style training script on local ranks or an emulated cluster",
               "autotune.cli.launch:add_launch_parser"),
}
"""Every subcommand, in the order ``--help`` lists them: its one-line summary, and the
function (``module:name``) that declares its arguments and sets ``func`` to what runs it.
A subcommand's module imports what it needs at its top; it is loaded only when that
subcommand is named, so ``autotune --help`` loads none of them."""


class UsageError(Exception):
    """A command line argparse rejected; reported like any other bad input."""


class Parser(argparse.ArgumentParser):
    # argparse prints the usage and a message and exits by itself; raising instead lets
    # main() report usage errors in the same one-line form as every other bad input.
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show each flag's default, and keep the line breaks of descriptions and examples."""


def add_command(subparsers: Subparsers, name: str, description: str = "") -> argparse.ArgumentParser:
    """Add the parser of subcommand ``name`` of :data:`COMMANDS`, formatted like the main one."""
    summary = COMMANDS[name][0]
    return subparsers.add_parser(
        name,
        help=summary,
        description=description or summary,
        formatter_class=Formatter,
    )


def console() -> Console:
    """A rich console for stdout.

    On a terminal it wraps to the terminal; into a pipe or file it is wide, so that long
    parameter names are written whole rather than cut at rich's 80-column default.
    """
    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=max(out.width, 240))
    return out


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value
