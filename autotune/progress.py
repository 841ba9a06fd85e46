"""Progress of long work on ranks, shown as rich progress bars by the process that waits.

Ranks started by :func:`autotune.launch.launch` report through their stdout: one line
per update, ``@@autotune-progress {"phase": ..., "fraction": ...}``, which the parent
consumes (see ``launch(on_line=...)``) and draws. Under torchrun, where no parent
waits, rank 0 draws the bars itself. Only rank 0 reports.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

__all__ = ["PREFIX", "rank_reporter", "line_reader", "Bars"]

PREFIX = "@@autotune-progress "
# Set by the parent for ranks whose progress it draws.
ENV = "AUTOTUNE_PROGRESS"

Report = Callable[[str, float], None]


def rank_reporter(rank: int) -> Report:
    """A ``report(phase, fraction)`` for this rank: protocol lines on stdout when a
    parent draws them, a no-op on ranks other than 0 or when nobody listens."""
    if rank != 0 or os.environ.get(ENV) != "stdout":
        return lambda phase, fraction: None

    def report(phase: str, fraction: float) -> None:
        sys.stdout.write(PREFIX + json.dumps({"phase": phase, "fraction": fraction}) + "\n")
        sys.stdout.flush()

    return report


def line_reader(report: Report) -> Callable[[int, str], bool]:
    """For ``launch(on_line=...)``: hand protocol lines to ``report``, pass the others
    through (a line that is not one returns False, so it is logged as usual)."""

    def on_line(rank: int, line: str) -> bool:
        if not line.startswith(PREFIX):
            return False
        try:
            data = json.loads(line[len(PREFIX):])
            report(str(data["phase"]), float(data["fraction"]))
        except (ValueError, KeyError, TypeError):
            return False
        return True

    return on_line


class Bars:
    """Rich progress bars, one per phase, fed by protocol lines or direct calls."""

    def __init__(self, console: Console, phases: list[str]) -> None:
        self._progress = Progress(
            TextColumn("{task.description:<10}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._tasks: dict[str, TaskID] = {
            p: self._progress.add_task(p, total=1.0) for p in phases
        }

    def __enter__(self) -> Bars:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def report(self, phase: str, fraction: float) -> None:
        task = self._tasks.get(phase)
        if task is None:
            task = self._tasks[phase] = self._progress.add_task(phase, total=1.0)
        # a phase that reports means every earlier phase is done
        for name, other in self._tasks.items():
            if name == phase:
                break
            self._progress.update(other, completed=1.0)
        self._progress.update(task, completed=max(0.0, min(1.0, fraction)))

    def finish(self) -> None:
        for task in self._tasks.values():
            self._progress.update(task, completed=1.0)

    def on_line(self, rank: int, line: str) -> bool:
        """For ``launch(on_line=...)``: draw protocol lines, pass the others through."""
        return line_reader(self.report)(rank, line)
