"""A simulated step as Chrome trace-event JSON (opens in Perfetto or chrome://tracing).

Tracks (threads of one process): ``compute`` (forward, backward, optimizer), ``codec``
(encode/decode on the communication thread) and ``comm`` (collectives on the channel);
overlapping work therefore shows side by side. Times are microseconds from the start of
the step.
"""

from __future__ import annotations

import os
from typing import Any

from autotune.errors import ProfileError
from autotune.jsonio import dumps, write_atomic
from autotune.models.simulator import StepEstimate

__all__ = ["trace_events", "write_trace"]

_TRACKS = {"compute": 1, "codec": 2, "comm": 3}


def trace_events(est: StepEstimate, title: str = "autotune step") -> dict[str, Any]:
    """The trace-event JSON object of one simulated step."""
    us = 1e6
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": title}},
    ]
    for name, tid in _TRACKS.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"sort_index": tid}})

    def span(track: str, name: str, start: float, end: float, args: dict[str, Any] | None = None) -> None:
        events.append({"name": name, "cat": track, "ph": "X", "pid": 1, "tid": _TRACKS[track],
                       "ts": round(start * us, 3), "dur": round(max(0.0, end - start) * us, 3),
                       "args": args or {}})

    other = max(0.0, est.compute_s - est.forward_s - est.optimizer_s - (est.backward_s - 0.0))
    back0 = est.forward_s
    span("compute", "forward", 0.0, est.forward_s)
    span("compute", "backward", back0, back0 + est.backward_s)
    comm_end = back0 + max(est.backward_s, max((b.end_s for b in est.buckets), default=0.0))
    span("compute", "optimizer", comm_end, comm_end + est.optimizer_s)
    for b in est.buckets:
        for track, label, s, e in b.spans:
            span(track, label, back0 + s, back0 + e, {"bucket": b.index, "params": b.params,
                                                     "ready_ms": round(b.ready_s * 1e3, 3)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_s": est.step_s, "exposed_comm_s": est.exposed_comm_s,
                          "other_compute_s": other}}


def write_trace(path: str | os.PathLike[str], est: StepEstimate, title: str = "autotune step") -> None:
    write_atomic(path, dumps(trace_events(est, title), indent=None) + "\n", ProfileError, "trace")
