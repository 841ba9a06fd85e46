"""The ``autotune`` command line.

Every subcommand is two functions in this module: ``add_<name>_parser(subparsers)``
declares its arguments and sets ``func=cmd_<name>``; ``cmd_<name>(args) -> int`` runs it
and returns the exit status. To add one, write both and append ``add_<name>_parser`` to
:data:`SUBCOMMANDS`.

Exit status: 0 success, 1 failure, 2 bad input (any :class:`~autotune.errors.AutotuneError`,
a bad path, a usage error), 130 interrupted. Bad input is reported as exactly one line,
``autotune: error: <message>``, on stderr, never as a traceback.

Importing the ``autotune`` package loads the training path (torch included); anything
heavier (optuna, scikit-learn) is imported inside the ``cmd_<name>`` that needs it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autotune.errors import AutotuneError, RankFailure
from autotune.policies import Policy, load_policy

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = ["main", "build_parser", "SUBCOMMANDS"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it

PROG = "autotune"


class UsageError(Exception):
    """A command line argparse rejected; reported like any other bad input."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the usage and a message and exits by itself; raising instead lets
    # main() report usage errors in the same one-line form as every other bad input.
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show each flag's default, and keep the line breaks of descriptions and examples."""


def _version() -> str:
    """The package version: ``autotune.__version__`` if set, else the installed one."""
    import autotune

    version = getattr(autotune, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version("ddp-autotune")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _add_command(
    subparsers: Subparsers, name: str, summary: str, description: str = ""
) -> argparse.ArgumentParser:
    """Add a subcommand parser that formats its help like the main one."""
    return subparsers.add_parser(
        name,
        help=summary,
        description=description or summary,
        formatter_class=_Formatter,
    )


def _console() -> Console:
    """A rich console for stdout.

    On a terminal it wraps to the terminal; into a pipe or file it is wide, so that long
    parameter names are written whole rather than cut at rich's 80-column default.
    """
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=max(console.width, 240))
    return console


# ---------------------------------------------------------------------------- show


def add_show_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Declare ``autotune show POLICY.json [--json]``."""
    parser = _add_command(
        subparsers,
        "show",
        "print a policy: bucket size, default compressor and one row per layer",
        "Validate a policy file and print it: its id, bucket cap, default compressor,\n"
        "and the compressor of every parameter with its own entry.\n\n"
        "example:\n  autotune show policy.json\n  autotune show policy.json --json | jq .layers",
    )
    parser.add_argument("policy", metavar="POLICY.json", help="the policy file to show")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the policy as canonical JSON instead of a table",
    )
    parser.set_defaults(func=cmd_show)
    return parser


def cmd_show(args: argparse.Namespace) -> int:
    """Print the policy file ``args.policy`` as a table, or as JSON with ``--json``."""
    policy = load_policy(args.policy)
    if args.json:
        sys.stdout.write(policy.to_json() + "\n")
    else:
        _print_policy(_console(), policy, source=args.policy)
    return EXIT_OK


def _print_policy(console: Console, policy: Policy, source: str) -> None:
    console.print(Text.assemble(("policy ", "bold"), (policy.id, "bold cyan"), f"  ({source})"))
    console.print(f"bucket cap: {policy.bucket_cap_mb:g} MB")
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
    nested = len(policy.meta) - len(scalars)
    if nested:
        console.print(Text(f"meta: {nested} nested entries not shown (see --json)", style="dim"))


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


# ---------------------------------------------------------------------------- demo


def add_demo_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Declare ``autotune demo``."""
    parser = _add_command(
        subparsers,
        "demo",
        "train a built-in workload on local ranks under plain DDP and a mixed policy",
        "Train the built-in workload on local gloo ranks, interleaving plain DDP and a\n"
        "policy that compresses large tensors, and print each compressor's bytes on the\n"
        "wire and the step times. Writes the policy to OUT_DIR/policy.json.",
    )
    parser.add_argument("--workload", default="cnn",
                        help="built-in name, path/to/file.py:function or package.module:function")
    parser.add_argument("--nproc-per-node", type=_positive_int, default=2,
                        help="local ranks to run")
    parser.add_argument("--rounds", type=_positive_int, default=4,
                        help="interleaved blocks per set-up")
    parser.add_argument("--block", type=_positive_int, default=5, help="steps per block")
    parser.add_argument("--out-dir", type=Path, default=Path("."),
                        help="where policy.json is written")
    parser.set_defaults(func=cmd_demo)
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    from autotune.demo import run_demo

    run_demo(_console(), args.workload, args.nproc_per_node, args.rounds, args.block,
             args.out_dir)
    return EXIT_OK


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


# ---------------------------------------------------------------------------- main

SUBCOMMANDS: list[Callable[[Subparsers], argparse.ArgumentParser]] = [
    add_show_parser,
    add_demo_parser,
]
"""Parser builders of the subcommands, in the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The ``autotune`` parser with every subcommand of :data:`SUBCOMMANDS`."""
    parser = _Parser(
        prog=PROG,
        description="Adaptive gradient-communication auto-tuner for PyTorch DDP.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Parser
    )
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def _error(message: str) -> None:
    # Plain print, not rich: rich would wrap a long message over several lines, and
    # scripts rely on exactly one line.
    one_line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    print(f"{PROG}: error: {one_line}", file=sys.stderr)


def _os_error_message(exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    return f"{exc.filename}: {reason}" if exc.filename is not None else reason


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autotune`` command line.

    Args:
        argv: the arguments after the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The exit status, for ``sys.exit(main())``.
    """
    try:
        args = build_parser().parse_args(argv)
        status = int(args.func(args))
        sys.stdout.flush()  # surface a closed pipe here, where it is handled
        return status
    except RankFailure as exc:  # the job failed; the input was fine
        _error(str(exc))
        return EXIT_FAILURE
    except (UsageError, AutotuneError) as exc:
        _error(str(exc))
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        # The reader went away (`autotune show p.json | head`): not an input error. Point
        # stdout at /dev/null so that the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    except OSError as exc:
        _error(_os_error_message(exc))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as exc:
        # --help and --version exit through argparse; hand their status back instead
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or EXIT_OK
        print(exc.code, file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
