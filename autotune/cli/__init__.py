"""The ``autotune`` command line.

Each subcommand lives in a module of this package with two functions:
``add_<name>_parser(subparsers)`` declares its arguments and sets ``func=cmd_<name>``;
``cmd_<name>(args) -> int`` runs it and returns the exit status. To add one, write the
module and add its name, summary and ``add_<name>_parser`` to
:data:`~autotune.cli._base.COMMANDS`. Only the module of the subcommand that is run is
loaded (as pip loads its commands), so each imports what it needs at its top.

Exit status: 0 success, 1 failure (e.g. a rank of the job failed), 2 bad input (any other
:class:`~autotune.errors.AutotuneError`, a bad path, a usage error), 130 interrupted;
``autotune launch`` exits with its script's status instead of 1 when a rank fails.
Errors are reported as exactly one line, ``autotune: error: <message>``, on stderr, never
as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Iterable, Sequence

from autotune._version import __version__
from autotune.cli._base import (
    COMMANDS,
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    PROG,
    Formatter,
    Parser,
    Terminated,
    UsageError,
)
from autotune.errors import AutotuneError, RankFailure

__all__ = ["main", "build_parser"]


# ---------------------------------------------------------------------------- main

def build_parser(load: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``autotune`` parser.

    Args:
        load: the subcommands whose modules are loaded to declare their arguments
            (None: all of them); every other one is listed with its summary only.
    """
    load = set(COMMANDS) if load is None else set(load)
    parser = Parser(
        prog=PROG,
        description="Adaptive gradient-communication auto-tuner for PyTorch DDP.",
        formatter_class=Formatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=Parser
    )
    for name, (summary, builder) in COMMANDS.items():
        if name in load:
            module, _, function = builder.partition(":")
            getattr(importlib.import_module(module), function)(subparsers)
        else:
            subparsers.add_parser(name, help=summary, add_help=False)
    return parser


def _named(argv: Sequence[str]) -> list[str]:
    """The subcommand ``argv`` runs, as a list: empty without one (``--help``, ``--version``)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return [first] if first in COMMANDS else []


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
    argv = sys.argv[1:] if argv is None else list(argv)
    # SIGTERM (a scheduler's stop, `kill`) ends the command the way Ctrl-C does; without
    # this, Python dies at once and leaves the ranks it launched running
    old_term = (signal.signal(signal.SIGTERM, _on_sigterm)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        args = build_parser(_named(argv)).parse_args(argv)
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
    except Terminated:
        print(f"{PROG}: terminated (SIGTERM); its ranks were ended", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as exc:
        # --help and --version exit through argparse; hand their status back instead
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or EXIT_OK
        print(exc.code, file=sys.stderr)
        return EXIT_FAILURE
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated


if __name__ == "__main__":
    sys.exit(main())
