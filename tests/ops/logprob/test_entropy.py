"""logprob.entropy: row invariance (forward and grad) with a negative control, accuracy vs
float64 (including near-deterministic and masked rows), determinism and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings

from rl_engine import contracts
from rl_engine.ops import logprob
from rl_engine.reference.logprob import entropy_f64
from tests.helpers.determinism import run_to_run_failures
from tests.helpers.logprob import ROW_CASES, assert_accurate, assert_negative_control_caught, assert_row_invariant, masked_logits
from tests.helpers.strategies import DTYPES, row_trials
from tests.helpers.threads import threads

OP = "logprob.entropy"


def _logits(n, v, dtype, seed=0, scale=3.0, masked=0.0):
    return masked_logits((n, v), dtype, seed=seed, scale=scale, masked=masked)[0]


def batch_dependent_entropy(logits, temperature=1.0):
    """Negative control: small batches sum ``p·log p`` in 4 vocabulary parts, large ones in one."""
    z = logits.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    terms = logp.exp() * logp
    if z.shape[0] < 32:
        return -torch.stack([p.sum(-1) for p in terms.chunk(4, dim=-1)], dim=-1).sum(-1)
    return -terms.sum(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(**ROW_CASES)
def test_row_invariance_forward_and_grad(dtype, data, n, v, temperature, masked):
    with threads(1):
        x = _logits(n, v, dtype, seed=n * 89 + v, masked=masked)
        assert_row_invariant(logprob.entropy, [x], data.draw(row_trials(n)), temperature)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_batch_dependent_split_is_caught(dtype):
    assert_negative_control_caught(batch_dependent_entropy, logprob.entropy, [_logits(64, 3000, dtype, seed=13)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3), (13, 1024), (6, 2900), (2, 4, 1100)])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_accuracy_forward_and_grad(dtype, shape, temperature):
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape, generator=g) * 4).to(dt).requires_grad_()
    h = logprob.entropy(x, temperature)
    assert h.dtype == torch.float32 and h.shape == shape[:-1]
    up = torch.randn(h.shape, generator=g)
    h.backward(up)
    x64 = x.detach().double().requires_grad_()
    h64 = entropy_f64(x64, temperature)
    h64.backward(up.double())
    assert_accurate(OP, dt, h, h64, x, x64)


def test_special_rows():
    """Uniform rows give log V, a dominant logit gives ~0 (never negative or NaN), masked entries
    and whole masked blocks are ignored, and gradients stay finite."""
    V = 3000
    x = torch.zeros(4, V)
    x[1, 5] = 200.0  # every other probability underflows
    x[2, :1500] = float("-inf")  # one and a half blocks masked: uniform over the rest
    x[3] = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 30
    x = x.requires_grad_()
    h = logprob.entropy(x)
    tol = contracts.tolerance(OP, torch.float32)
    assert tol.check(h[0], torch.tensor(math.log(V), dtype=torch.float64))
    assert 0.0 <= float(h[1].detach()) <= 1e-30
    assert tol.check(h[2], torch.tensor(math.log(V - 1500), dtype=torch.float64))
    assert tol.check(h, entropy_f64(x.detach()))
    h.sum().backward()
    assert bool(torch.isfinite(x.grad).all())
    assert bool((x.grad[2, :1500] == 0).all())


def test_run_to_run_determinism():
    assert run_to_run_failures(lambda x: logprob.entropy(x, 0.7), [_logits(40, 2100, "bfloat16", seed=2)]) == []


def test_bad_input_messages_name_the_argument():
    with pytest.raises(ValueError, match="^logits: expected dtype"):
        logprob.entropy(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^logits: rows \[0\] have no finite entry"):
        logprob.entropy(torch.full((1, 4), float("-inf")))
    with pytest.raises(ValueError, match="^logits: expected at least 1 dimensions"):
        logprob.entropy(torch.tensor(1.0))
    with pytest.raises(ValueError, match="^temperature: expected a finite value > 0"):
        logprob.entropy(torch.zeros(2, 3), float("inf"))
