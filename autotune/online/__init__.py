"""Online revision of the policy while training runs (see controller.py), attached to
the runtime's wrapped model by attach.py, whose ``wrap`` is ``autotune.wrap``."""

from __future__ import annotations

from autotune.online.attach import ONLINE_KNOBS, attach, rank_measure, wrap
from autotune.online.controller import Controller, OnlineConfig

__all__ = ["ONLINE_KNOBS", "Controller", "OnlineConfig", "attach", "rank_measure", "wrap"]
