"""The package version, on the ground floor: saved models and profiles record it, and
``autotune --version`` prints it, without importing the public face (``autotune``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("ddp-autotune")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"
