"""logprob.log_softmax: row invariance (forward and grad) with a negative control, accuracy vs
float64, fp32 output, -inf handling, determinism, dispatch and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from rl_engine import contracts, runtime
from rl_engine.ops import logprob
from rl_engine.reference.logprob import log_softmax_f64
from tests.helpers.determinism import run_to_run_failures
from tests.helpers.logprob import ROW_CASES, assert_accurate, assert_negative_control_caught, assert_row_invariant, masked_logits
from tests.helpers.strategies import DTYPES, row_trials
from tests.helpers.threads import threads

OP = "logprob.log_softmax"


def _logits(n, v, dtype, seed=0, scale=3.0, masked=0.0):
    return masked_logits((n, v), dtype, seed=seed, scale=scale, masked=masked)[0]


def split_vocab_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Negative control: like split-K at small batch, a small batch reduces the vocabulary in 4
    parts and combines the partial log-sum-exps; a large batch reduces it in one pass. Row
    values then depend on how many rows are in the call."""
    z = logits.float() / temperature
    if z.shape[0] < 32:
        parts = torch.stack([torch.logsumexp(p, dim=-1) for p in z.chunk(4, dim=-1)], dim=-1)
        lse = torch.logsumexp(parts, dim=-1)
    else:
        lse = torch.logsumexp(z, dim=-1)
    return z - lse.unsqueeze(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(**ROW_CASES)
def test_row_invariance_forward_and_grad(dtype, data, n, v, temperature, masked):
    with threads(1):
        x = _logits(n, v, dtype, seed=n * 131 + v, masked=masked)
        assert_row_invariant(logprob.log_softmax, [x], data.draw(row_trials(n)), temperature)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_split_reduction_is_caught(dtype):
    """A reduction whose split depends on the batch size must fail the same checker."""
    assert_negative_control_caught(split_vocab_log_softmax, logprob.log_softmax, [_logits(64, 3000, dtype, seed=7)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 5), (17, 1024), (9, 2049), (2, 3, 1500)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_accuracy_forward_and_grad(dtype, shape, temperature):
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=g) * 4).to(dt).requires_grad_()
    y = logprob.log_softmax(x, temperature)
    assert y.dtype == torch.float32 and y.shape == x.shape
    up = torch.randn(y.shape, generator=g)
    y.backward(up)
    x64 = x.detach().double().requires_grad_()
    y64 = log_softmax_f64(x64, temperature)
    y64.backward(up.double())
    assert_accurate(OP, dt, y, y64, x, x64)


def test_minus_inf_logits_are_supported():
    x = _logits(6, 2100, "float32", seed=3, masked=0.5)
    x[2, :1024] = float("-inf")  # a whole block masked
    x = x.requires_grad_()
    y = logprob.log_softmax(x)
    finite = torch.isfinite(x)
    assert bool(torch.isneginf(y[~finite]).all())
    ref = log_softmax_f64(x.detach())
    tol = contracts.tolerance(OP, torch.float32)
    assert tol.check(y[finite], ref[finite])
    y.backward(torch.where(finite, torch.ones_like(y), torch.zeros_like(y)))
    assert bool(torch.isfinite(x.grad).all())


def test_run_to_run_determinism():
    assert run_to_run_failures(lambda x: logprob.log_softmax(x, 0.9), [_logits(33, 2500, "bfloat16")]) == []


def test_dispatch_provenance_and_fallback():
    x = _logits(2, 10, "float32")
    with runtime.provenance.record() as recs:
        logprob.log_softmax(x)
    assert [(r.op, r.impl_id, r.fallback) for r in recs] == [(OP, "cpu.canonical_lse", False)]
    # a request for an invariance no implementation declares: strict raises, diagnostic falls back
    req = runtime.make_request(OP, x, requires=frozenset({"tp_size"}))
    with pytest.raises(runtime.NoEligibleImplementation, match="cpu.canonical_lse"):
        runtime.dispatch(req, x, 1.0)
    with runtime.use_policy("diagnostic"), runtime.provenance.record() as recs:
        y = runtime.dispatch(req, x, 1.0)
    assert recs[0].fallback and y.dtype == torch.float32
    assert contracts.tolerance(OP, torch.float32).check(y, log_softmax_f64(x))


def test_bad_input_messages_name_the_argument():
    x = _logits(2, 10, "float32")
    with pytest.raises(ValueError, match="^logits: expected dtype"):
        logprob.log_softmax(x.half())
    with pytest.raises(ValueError, match="^logits: expected a non-empty vocabulary"):
        logprob.log_softmax(torch.empty(3, 0))
    with pytest.raises(ValueError, match="^logits: expected a contiguous"):
        logprob.log_softmax(torch.randn(10, 4).t())
    with pytest.raises(ValueError, match="^logits: contains NaN"):
        logprob.log_softmax(torch.full((2, 4), float("nan")))
    with pytest.raises(ValueError, match=r"^logits: rows \[1\] have no finite entry"):
        logprob.log_softmax(torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]]))
    with pytest.raises(ValueError, match=r"^logits: rows \[0\] are not finite"):
        logprob.log_softmax(torch.tensor([[0.0, float("inf")]]))
    with pytest.raises(ValueError, match=r"^logits: rows \[0\] are not finite"):
        logprob.log_softmax(torch.tensor([[3e38, 1.0]]), 0.5)
    with pytest.raises(ValueError, match="^temperature: expected a finite value > 0"):
        logprob.log_softmax(x, 0.0)
    with pytest.raises(ValueError, match="^temperature: expected a finite value > 0"):
        logprob.log_softmax(x, float("nan"))
    with pytest.raises(TypeError, match="^temperature: expected a Python float"):
        logprob.log_softmax(x, torch.tensor(1.0))
    with pytest.raises(TypeError, match="^logits: expected a torch.Tensor"):
        logprob.log_softmax([[1.0]])
    with pytest.raises(ValueError, match="device"):
        logprob.log_softmax(torch.empty(2, 4, device="meta"))


def test_empty_batch():
    assert logprob.log_softmax(torch.empty(0, 7)).shape == (0, 7)
