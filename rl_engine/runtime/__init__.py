"""Runtime: contract-aware registry and dispatch, execution policy, provenance.

See :mod:`rl_engine.runtime.registry` for the dispatch rules.
"""

from rl_engine.runtime import provenance
from rl_engine.runtime.policy import POLICIES, Policy, current_policy, use_policy
from rl_engine.runtime.registry import (
    Implementation,
    NoEligibleImplementation,
    Request,
    dispatch,
    implementations,
    make_request,
    reference_for,
    register,
    register_reference,
    select,
)

__all__ = [
    "Implementation",
    "NoEligibleImplementation",
    "Request",
    "POLICIES",
    "Policy",
    "current_policy",
    "dispatch",
    "implementations",
    "make_request",
    "provenance",
    "reference_for",
    "register",
    "register_reference",
    "select",
    "use_policy",
]
