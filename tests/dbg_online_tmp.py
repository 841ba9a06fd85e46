import statistics, time
from typing import Any
import torch, torch.distributed as dist
import autotune
from autotune.policies import Policy
from autotune.workloads import resolve_workload
from test_online import _train, NONE

def rank_dbg(profile: str, steps: int = 70) -> dict[str, Any]:
    work = resolve_workload("mlp")
    ddp = autotune.wrap(work.model, Policy.from_dict(NONE), online=True, profile=profile,
                        budget_s=2.0, trials=10)
    ctl = ddp.controller
    log = []
    if dist.get_rank() == 0:
        orig = ctl._watch
        def spy():
            w = ctl._window
            steps_s = list(w.step_s)
            settle, refr, ref = ctl._settle, list(ctl._ref_ratios), ctl._ref
            out = orig()
            log.append({"step": ctl.step, "n": len(steps_s), "med": statistics.median(steps_s) if steps_s else None,
                        "settle": settle, "ref_ratios": refr, "ref": ref, "scale": ctl._scale, "strikes": ctl._strikes,
                        "pending": ctl._pending is not None})
            return out
        ctl._watch = spy
    opt = torch.optim.SGD(work.model.parameters(), lr=0.05)
    _train(ddp, work, steps, opt,
           lambda step: time.sleep(0.2 if step >= 30 or (10 <= step < 15) else 0.01))
    return {"log": log, "events": ctl.events}
