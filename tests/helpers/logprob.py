"""Shared scaffolding of the log-prob operator tests (tests/ops/logprob): random logits with
masked entries, the row-invariance and negative-control checks, and the accuracy check of a
forward value and its gradient against the float64 reference."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.validation.common import check_row_invariance

#: ``@given(**ROW_CASES)``: the cases of the row-invariance tests (rows ``n``, vocabulary ``v``,
#: temperature, fraction of masked logits; ``data`` draws the row trials).
ROW_CASES = dict(
    data=st.data(),
    n=st.integers(1, 24),
    v=st.integers(1, 2600),
    temperature=st.sampled_from((1.0, 0.7, 1.3)),
    masked=st.sampled_from([0.0, 0.0, 0.3]),
)

#: Row subsets and orders of a 64-row batch for the negative controls: sub-batches below 32
#: rows and full-size permutations (a batch-size-dependent reduction differs between them).
SPLIT_TRIALS = [list(range(0, 62, 2)), list(range(63, 1, -2)), list(range(64))[::-1]]


def masked_logits(shape, dtype: str, *, seed: int = 0, scale: float = 3.0, masked: float = 0.0):
    """``randn(*shape) * scale`` in ``dtype``, a fraction ``masked`` of entries set to ``-inf``
    (every row keeps entry 0 finite). Returns the logits and the generator, for further draws."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * scale
    if masked:
        drop = torch.rand(*shape, generator=g) < masked
        drop[..., 0] = False  # every row keeps a finite entry
        x = x.masked_fill(drop, float("-inf"))
    return x.to(getattr(torch, dtype)), g


def assert_row_invariant(fn, inputs, trials, temperature: float) -> None:
    """``fn(*inputs, temperature)`` is row invariant, forward and gradient, over ``trials``."""
    rep = check_row_invariance(fn, inputs, trials, (temperature,), grads=True)
    assert rep.ok, str(rep)


def assert_negative_control_caught(bad, ours, inputs) -> None:
    """The checker catches the non-invariant ``bad`` on :data:`SPLIT_TRIALS`, and passes ``ours``."""
    assert not check_row_invariance(bad, inputs, SPLIT_TRIALS, (1.0,)).ok
    rep = check_row_invariance(ours, inputs, SPLIT_TRIALS, (1.0,), grads=True)
    assert rep.ok, str(rep)


def assert_accurate(op: str, dt: torch.dtype, y, y64, x, x64) -> None:
    """``y`` and ``x.grad`` meet the contract's forward / backward tolerances against the float64
    ``y64`` and ``x64.grad``; the gradient has the input's dtype."""
    fwd = contracts.tolerance(op, dt, "forward")
    bwd = contracts.tolerance(op, dt, "backward")
    assert fwd.check(y, y64), fwd.max_violation(y, y64)
    assert x.grad.dtype == dt
    assert bwd.check(x.grad, x64.grad), bwd.max_violation(x.grad, x64.grad)
