"""Execution policy: what happens when no implementation's contract covers a request.

* ``strict`` (the default): only an implementation whose declared contract covers the request
  may run; otherwise :class:`~rl_engine.runtime.registry.NoEligibleImplementation` is raised,
  listing every candidate and why it was rejected.
* ``diagnostic``: fall back to the float64 reference implementation, and record the fallback in
  provenance (``fallback=True``) so no report can pass it off as a contract-covered result.

The policy is a context variable, so a change is scoped to a ``with`` block (and to the current
thread / asyncio task) and restored on exit, also when the block raises.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Literal

Policy = Literal["strict", "diagnostic"]
POLICIES: tuple[Policy, ...] = ("strict", "diagnostic")

_POLICY: contextvars.ContextVar[Policy] = contextvars.ContextVar("rlk_policy", default="strict")

__all__ = ["Policy", "POLICIES", "current_policy", "use_policy"]


def current_policy() -> Policy:
    return _POLICY.get()


@contextlib.contextmanager
def use_policy(policy: Policy) -> Iterator[Policy]:
    """Run the block under ``policy`` (``"strict"`` or ``"diagnostic"``); nests; restores in ``finally``."""
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    token = _POLICY.set(policy)
    try:
        yield policy
    finally:
        _POLICY.reset(token)
