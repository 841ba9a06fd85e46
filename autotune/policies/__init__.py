"""Policies: which compressor each gradient uses, as a validated, versioned JSON file.

>>> from autotune.policies import Policy
>>> Policy.uniform("powersgd", rank=4).spec_for("fc1.weight").label()
'powersgd(rank=4)'
"""

from __future__ import annotations

from autotune.policies.policy import POLICY_VERSION, Policy, PolicyCheck, load_policy

__all__ = ["POLICY_VERSION", "Policy", "PolicyCheck", "load_policy"]
