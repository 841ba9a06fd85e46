"""Online revision of the policy while training runs (see controller.py)."""

from __future__ import annotations

from autotune.online.controller import Controller, OnlineConfig

__all__ = ["Controller", "OnlineConfig"]
