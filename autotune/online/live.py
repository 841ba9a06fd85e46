"""What ``wrap(model, "auto")`` measures on the live job, and the profile made from it.

No separate probe run and no workload function: the user's own training steps are the
measurement. On rank 0, for a few steps of plain DDP:

* **compute**: each step from its boundary (the start of the forward pass) to the next;
  the forward pass's end (a forward hook on the module), each parameter's
  gradient-ready time (``register_post_accumulate_grad_hook``, relative to the end of
  the forward pass) and the completion of every bucket (the hook's
  :class:`~autotune.runtime.hook.BucketRecord`). The compute-only floor of a step is
  the step without its exposed communication: forward + backward (to the last ready
  gradient) + what follows the last bucket (optimizer, data loading);
* **gradients**: a copy of this rank's own gradient of every parameter, taken as it is
  accumulated (before DDP averages it), for the codec probe;
* the **network** is probed by every rank at one step boundary
  (:func:`~autotune.probes.network.probe_network`, allreduce and allgather only, a
  budget of about a second), and the **codecs** on the copied gradients by rank 0 in
  the background (:func:`~autotune.probes.codecs.probe_codecs`, without collectives).

:func:`live_profile` assembles a :class:`~autotune.probes.profile.Profile` from these,
which the cost model and the search read as any other.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from autotune.probes.codecs import probe_codecs
from autotune.probes.profile import Profile
from autotune.probes.run import environment

__all__ = ["LiveProfiler", "live_environment", "live_profile"]


class LiveProfiler:
    """Rank 0's instruments on the live model, idle except on the steps it is armed for.

    Args:
        module: the wrapped model's module (``ddp.module``).
        state: the hook's state, whose bucket records tell when each bucket finished.
    """

    def __init__(self, module: torch.nn.Module, state: Any) -> None:
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._state = state
        self._lock = threading.Lock()
        self._step: dict[str, Any] | None = None  # the armed step's marks
        self.steps: list[dict[str, Any]] = []  # finished steps
        self.grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in self.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._ready(j))
                         for j, (_, p) in enumerate(self.params)]
        self._handles.append(module.register_forward_hook(self._forward_end))
        state.listeners.append(self._on_record)

    # ---------------------------------------------------------------- marks
    def arm(self, start: float, capture: bool) -> None:
        """Instrument the step starting now (called at its boundary)."""
        with self._lock:
            self._step = {"start": start, "index": self._state.step, "forward_end": None,
                          "ready": [math.nan] * len(self.params), "done": -math.inf,
                          "capture": capture, "grads": {}}

    def finish(self, end: float) -> None:
        """Close the armed step at the next boundary."""
        with self._lock:
            s, self._step = self._step, None
        if s is None or s["forward_end"] is None:
            return
        ready = [r - s["forward_end"] for r in s["ready"]]
        last = max((r for r in s["ready"] if not math.isnan(r)), default=s["forward_end"])
        forward = s["forward_end"] - s["start"]
        backward = max(last - s["forward_end"], 0.0)
        tail = max(end - max(s["done"], last), 0.0)
        self.steps.append({"forward_s": forward, "backward_s": backward, "optimizer_s": tail,
                           "floor_s": forward + backward + tail, "step_s": end - s["start"],
                           "ready": ready})
        if s["capture"]:
            for name, p in self.params:  # a parameter unused this step: a zero gradient
                g = s["grads"].get(name)
                self.grads[name].append(g if g is not None else torch.zeros_like(p, device="cpu"))

    def _ready(self, j: int) -> Any:
        name = self.params[j][0]

        def hook(param: torch.Tensor) -> None:
            s = self._step
            if s is None:
                return
            s["ready"][j] = time.perf_counter()
            if s["capture"] and param.grad is not None:
                # this rank's own gradient: DDP averages it only when its bucket is reduced
                s["grads"][name] = param.grad.detach().to("cpu", copy=True)

        return hook

    def _forward_end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        s = self._step
        if s is not None and torch.is_grad_enabled():
            s["forward_end"] = time.perf_counter()

    def _on_record(self, record: Any) -> None:
        with self._lock:
            s = self._step
            if s is not None and record.step == s["index"]:
                s["done"] = max(s["done"], record.start + record.seconds)

    def close(self) -> None:
        """Remove every hook and listener."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._on_record in self._state.listeners:
            self._state.listeners.remove(self._on_record)

    # -------------------------------------------------------------- results
    def compute_section(self) -> dict[str, Any]:
        """The profile's ``compute`` section from the finished steps."""
        if not self.steps:
            raise RuntimeError("no instrumented step finished")
        ready = []
        for j in range(len(self.params)):
            values = [s["ready"][j] for s in self.steps if not math.isnan(s["ready"][j])]
            ready.append(max(statistics.median(values), 0.0) if values else None)
        ranked = sorted((t, j) for j, t in enumerate(ready) if t is not None)
        order: list[int | None] = [None] * len(ready)
        for position, (_, j) in enumerate(ranked):
            order[j] = position
        return {
            "source": "live",  # measured on the user's own steps under plain DDP
            "steps": len(self.steps),
            "device": self.params[0][1].device.type,
            "threads": torch.get_num_threads(),
            "step_s": [s["floor_s"] for s in self.steps],
            "forward_s": [s["forward_s"] for s in self.steps],
            "backward_s": [s["backward_s"] for s in self.steps],
            "optimizer_s": [s["optimizer_s"] for s in self.steps],
            "ddp_step_s": [s["step_s"] for s in self.steps],
            "params": [
                {"name": n, "shape": list(p.shape), "numel": p.numel(),
                 "dtype": str(p.dtype).removeprefix("torch."), "ready_s": ready[j],
                 "ready_order": order[j]}
                for j, (n, p) in enumerate(self.params)
            ],
        }


def live_environment(network: Mapping[str, Any]) -> dict[str, Any]:
    """The profile's ``env`` section of the live job (any rank, process group up)."""
    env = environment(None)
    env.update(hosts=len(set(network["hosts"])), source="wrap(model, 'auto')")
    if dist.get_backend() != "nccl":
        env["device"] = "cpu"
    return env


def live_profile(
    compute: Mapping[str, Any],
    grads: Mapping[str, Sequence[torch.Tensor]],
    network: Mapping[str, Any],
    *,
    env: Mapping[str, Any],
    model_name: str,
    world_size: int,
    codec_budget_s: float,
    calibration: Sequence[Mapping[str, Any]] = (),
) -> Profile:
    """A profile of the live job (no collectives, no process group needed): the codec
    probe runs here, on the copied gradients.

    Args:
        compute: :meth:`LiveProfiler.compute_section`.
        grads: the copied gradients per parameter, oldest first.
        network: what :func:`~autotune.probes.network.probe_network` returned.
        env: :func:`live_environment`.
        model_name: what the profile calls the workload (the module's class).
        world_size: ranks of the job.
        codec_budget_s: seconds the codec probe may take.
        calibration: measured ``{"policy", "step_s"}`` pairs (plain DDP: policy None).
    """
    codecs = probe_codecs(grads, world_size, budget_s=codec_budget_s)
    return Profile.from_dict({
        "version": 1, "env": dict(env),
        "workload": {"name": model_name, "spec": "live"},
        "network": dict(network), "compute": dict(compute), "codecs": codecs,
        "calibration": {"results": [dict(c) for c in calibration]},
    }, source="live profile")
