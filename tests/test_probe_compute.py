"""The compute probe: per-module and per-parameter timings, on one process and on 2 ranks.

No timing thresholds here (CPU speed drifts 1.5x on this machine); the agreement of the
module breakdown with the backward wall time is a benchmark, not a test.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autotune.errors import ProfileError
from autotune.probes.compute import backward_sum_vs_wall, probe_compute
from autotune.workloads import Workload, mlp

STEP_KEYS = ("step_s", "forward_s", "backward_s", "optimizer_s", "hooked_step_s",
             "hooked_backward_s")


def check_result(result: dict[str, Any], work: Workload, steps: int) -> None:
    """What every compute-probe result promises."""
    assert result["steps"] == steps
    for key in STEP_KEYS:
        assert len(result[key]) == steps and all(t > 0 for t in result[key]), key
    leaves = [n for n, m in work.model.named_modules() if not list(m.children())]
    assert [m["name"] for m in result["modules"]] == leaves and leaves
    for m in result["modules"]:
        assert m["forward_s"] > 0 and m["backward_s"] >= 0, m
    names = [n for n, p in work.model.named_parameters() if p.requires_grad]
    assert [p["name"] for p in result["params"]] == names
    assert all(p["ready_s"] >= 0 for p in result["params"])
    assert sorted(p["ready_order"] for p in result["params"]) == list(range(len(names)))
    # the order is that of the ready times
    by_order = sorted(result["params"], key=lambda p: p["ready_order"])
    assert [p["ready_s"] for p in by_order] == sorted(p["ready_s"] for p in by_order)
    assert result["backward_hooks_skipped"] == []
    assert result["truncated"] is False


def test_mlp_single_process() -> None:
    work = mlp()
    before = [p.detach().clone() for p in work.model.parameters()]
    result, grads = probe_compute(work, steps=3, warmup=1)
    check_result(result, work, steps=3)
    assert grads == {}
    assert result["device"] == "cpu" and result["threads"] == torch.get_num_threads()
    # ReLUs have no parameters but a backward of their own
    relus = [m for m in result["modules"] if m["type"] == "ReLU"]
    assert relus and all(m["backward_s"] > 0 for m in relus)
    # the workload's model is copied, not trained
    assert all(torch.equal(a, b) for a, b in zip(before, work.model.parameters()))
    breakdown, wall = backward_sum_vs_wall(result)
    ready_span, wall2 = backward_sum_vs_wall(result, "ready")
    assert breakdown > 0 and ready_span > 0 and wall == wall2 > 0


def rank_probe(steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # two ranks on two cores
    result, _ = probe_compute(mlp(), steps=steps, warmup=1)
    return result


@pytest.mark.multirank
def test_mlp_two_ranks(run_ranks: Any) -> None:
    a, b = run_ranks("test_probe_compute:rank_probe", steps=3)
    assert a == b, "every rank returns the aggregated result"
    assert a["world_size"] == 2
    check_result(a, mlp(), steps=3)


def test_capture_keeps_the_last_steps_gradients() -> None:
    work = mlp(hidden=16, depth=1)
    _, grads = probe_compute(work, steps=4, warmup=0, capture=2)
    params = dict(work.model.named_parameters())
    assert set(grads) == set(params)
    for name, gs in grads.items():
        assert len(gs) == 2
        assert all(g.shape == params[name].shape and g.device.type == "cpu" for g in gs)
    assert not torch.equal(grads["0.weight"][0], grads["0.weight"][1])  # different steps


def test_budget_truncates_after_three_steps() -> None:
    result, _ = probe_compute(mlp(hidden=16, depth=1), steps=20, warmup=0, budget_s=1e-6)
    assert result["truncated"] is True and result["steps"] == 3
    assert len(result["step_s"]) == len(result["hooked_step_s"]) == 3


class _InPlace(nn.Module):
    """In-place ops after modules (which break full backward hooks), a frozen
    parameter, an unused one, and a first layer whose input needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(4, 4)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.fc1(x))
        out = self.fc2(h)
        out += h  # torchvision's residual: in place on a module's output
        return self.head(F.relu(self.frozen(out), inplace=True))


def _inplace_workload() -> Workload:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=gen), torch.randint(3, (32,), generator=gen)
    return Workload(model=_InPlace(), make_batch=lambda step: (x, y), loss_fn=F.cross_entropy)


def test_inplace_ops_frozen_and_unused_parameters() -> None:
    result, _ = probe_compute(_inplace_workload(), steps=3, warmup=1)
    modules = {m["name"]: m for m in result["modules"]}
    # every module with work in backward is timed, the first layer's weight gradient too
    for name in ("fc1", "act", "fc2", "frozen", "head"):
        assert modules[name]["backward_s"] > 0, name
    assert modules["unused"]["forward_s"] == modules["unused"]["backward_s"] == 0.0
    params = {p["name"]: p for p in result["params"]}
    assert "frozen.weight" not in params  # DDP does not communicate frozen parameters
    assert params["unused.weight"]["ready_s"] is None
    assert params["unused.weight"]["ready_order"] is None
    orders = sorted(p["ready_order"] for p in params.values() if p["ready_order"] is not None)
    assert orders == list(range(len(params) - 2))
    assert result["backward_hooks_skipped"] == []


@pytest.mark.parametrize("kwargs", [{"steps": 0}, {"warmup": -1}, {"capture": -1},
                                    {"budget_s": 0.0}])
def test_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ProfileError):
        probe_compute(mlp(hidden=8, depth=1), **kwargs)


def test_a_model_without_parameters_is_refused() -> None:
    x = torch.randn(4, 3)
    work = Workload(model=nn.Tanh(), make_batch=lambda step: (x, x), loss_fn=F.mse_loss)
    with pytest.raises(ProfileError, match="no trainable parameters"):
        probe_compute(work, steps=1)
