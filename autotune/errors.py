"""Exceptions raised by autotune.

Every error a user can cause derives from :class:`AutotuneError`; the CLI turns one into a
single line on stderr and exit status 2.
"""

from __future__ import annotations

__all__ = [
    "AutotuneError",
    "CompressorError",
    "PolicyError",
    "ProfileError",
    "WorkloadError",
    "ClusterError",
    "RankFailure",
]


class AutotuneError(Exception):
    """Root of every error autotune raises on purpose."""


class CompressorError(AutotuneError, ValueError):
    """An unknown compressor name or a bad compressor parameter."""


class PolicyError(AutotuneError, ValueError):
    """A malformed policy, or one that does not fit the model it is applied to."""


class ProfileError(AutotuneError, ValueError):
    """A malformed or incompatible profile."""


class WorkloadError(AutotuneError, ValueError):
    """A workload spec that cannot be resolved into a :class:`autotune.Workload`."""


class ClusterError(AutotuneError, RuntimeError):
    """The emulated cluster cannot be built here (no root, no iproute2, no qdisc...)."""


class RankFailure(AutotuneError, RuntimeError):
    """A rank of a distributed job failed, hung or was lost; the job was ended.

    Args:
        message: what happened, in one line.
        rank: the rank whose exit ended the job, where a launcher saw one (None, e.g.,
            for a job that ran past its timeout, or a failure seen inside a rank).
        returncode: that rank's exit code as :mod:`subprocess` reports it (negative:
            killed by that signal).
    """

    def __init__(
        self, message: str, *, rank: int | None = None, returncode: int | None = None
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.returncode = returncode
