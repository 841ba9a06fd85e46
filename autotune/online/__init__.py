"""Online revision of the policy while training runs (see controller.py), attached to
the runtime's wrapped model by attach.py, whose ``wrap`` is ``autotune.wrap``. The
controller (and what it needs: the cost model, scikit-learn, the search) loads only when
a wrap asks for online revision or the auto mode."""

from __future__ import annotations

from autotune.online.attach import ONLINE_KNOBS, attach, rank_measure, wrap
from autotune.online.config import OnlineConfig

__all__ = ["ONLINE_KNOBS", "OnlineConfig", "attach", "rank_measure", "wrap"]
