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

PROG = "autotune"


class UsageError(Exception):
    """A command line argparse rejected; reported like any other bad input."""


class Parser(argparse.ArgumentParser):
    # argparse prints the usage and a message and exits by itself; raising instead lets
    # main() report usage errors in the same one-line form as every other bad input.
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show each flag's default, and keep the line breaks of descriptions and examples."""


def add_command(
    subparsers: Subparsers, name: str, summary: str, description: str = ""
) -> argparse.ArgumentParser:
    """Add a subcommand parser that formats its help like the main one."""
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
