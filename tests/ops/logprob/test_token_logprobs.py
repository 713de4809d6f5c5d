"""logprob.token_logprobs: row invariance (forward and grad) with a negative control, equality
with log_softmax, accuracy vs float64, shapes, determinism and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from rl_engine.ops import logprob
from rl_engine.reference.logprob import token_logprobs_f64
from rl_engine.utils.bits import same_bits
from tests.helpers.determinism import run_to_run_failures
from tests.helpers.logprob import ROW_CASES, assert_accurate, assert_negative_control_caught, assert_row_invariant, masked_logits
from tests.helpers.strategies import DTYPES, row_trials
from tests.helpers.threads import threads

OP = "logprob.token_logprobs"


def _data(n, v, dtype, seed=0, scale=3.0, masked=0.0, lead=None):
    shape = (n,) if lead is None else lead
    x, g = masked_logits((*shape, v), dtype, seed=seed, scale=scale, masked=masked)
    t = torch.randint(0, v, shape, generator=g)
    return x, t


def batch_dependent_token_logprobs(logits, targets, temperature=1.0):
    """Negative control: the vocabulary is reduced in 4 parts for small batches, in one pass for
    large ones (as split-K kernels do at small M)."""
    z = logits.float() / temperature
    if z.shape[0] < 32:
        lse = torch.stack([torch.logsumexp(p, dim=-1) for p in z.chunk(4, dim=-1)], dim=-1).logsumexp(-1)
    else:
        lse = torch.logsumexp(z, dim=-1)
    return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(**ROW_CASES)
def test_row_invariance_forward_and_grad(dtype, data, n, v, temperature, masked):
    with threads(1):
        x, t = _data(n, v, dtype, seed=n * 97 + v, masked=masked)
        assert_row_invariant(logprob.token_logprobs, [x, t], data.draw(row_trials(n)), temperature)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_batch_dependent_split_is_caught(dtype):
    assert_negative_control_caught(batch_dependent_token_logprobs, logprob.token_logprobs, list(_data(64, 3000, dtype, seed=11)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_raw_bit_equal_to_log_softmax_gather(dtype, temperature):
    x, t = _data(40, 3100, dtype, seed=2, masked=0.1)
    lp = logprob.token_logprobs(x, t, temperature)
    ls = logprob.log_softmax(x, temperature)
    assert same_bits(lp, ls.gather(1, t.unsqueeze(1)).squeeze(1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(1,), (19,), (3, 5)])
@pytest.mark.parametrize("v", [7, 1024, 2500])
def test_accuracy_forward_and_grad(dtype, lead, v):
    dt = getattr(torch, dtype)
    x, t = _data(0, v, dtype, seed=v, lead=lead, scale=4.0)
    x = x.requires_grad_()
    lp = logprob.token_logprobs(x, t, 0.9)
    assert lp.dtype == torch.float32 and lp.shape == t.shape
    up = torch.randn(lp.shape, generator=torch.Generator().manual_seed(5))
    lp.backward(up)
    x64 = x.detach().double().requires_grad_()
    lp64 = token_logprobs_f64(x64, t, 0.9)
    lp64.backward(up.double())
    assert_accurate(OP, dt, lp, lp64, x, x64)


def test_int32_targets_give_the_same_bits():
    x, t = _data(9, 2000, "float32", seed=4)
    assert same_bits(logprob.token_logprobs(x, t), logprob.token_logprobs(x, t.int()))


def test_run_to_run_determinism():
    x, t = _data(50, 2200, "bfloat16", seed=6)
    assert run_to_run_failures(lambda x_: logprob.token_logprobs(x_, t, 1.1), [x]) == []


def test_bad_input_messages_name_the_argument():
    x, t = _data(3, 10, "float32")
    with pytest.raises(ValueError, match=r"^targets: expected token ids in \[0, 10\), got -100"):
        logprob.token_logprobs(x, torch.tensor([1, -100, 2]))
    with pytest.raises(ValueError, match=r"^targets: expected token ids in \[0, 10\), got 10"):
        logprob.token_logprobs(x, torch.tensor([1, 10, 2]))
    with pytest.raises(ValueError, match=r"^targets: expected shape \(3,\)"):
        logprob.token_logprobs(x, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="^targets: expected dtype"):
        logprob.token_logprobs(x, t.float())
    with pytest.raises(TypeError, match="^targets: expected a torch.Tensor"):
        logprob.token_logprobs(x, [1, 2, 3])
    with pytest.raises(ValueError, match="^logits: expected dtype"):
        logprob.token_logprobs(x.double(), t)
    with pytest.raises(ValueError, match="^logits: contains NaN"):
        logprob.token_logprobs(torch.full((3, 10), float("nan")), t)
    with pytest.raises(ValueError, match="^temperature: expected a finite value > 0"):
        logprob.token_logprobs(x, t, -1.0)


def test_empty_batch():
    assert logprob.token_logprobs(torch.empty(0, 5), torch.empty(0, dtype=torch.long)).shape == (0,)
