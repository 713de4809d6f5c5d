"""gemm.linear: accuracy vs float64, row/chunk invariance (forward and gradients), negative
control, dispatch and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.ops import gemm
from rl_engine.reference.gemm import linear_f64
from rl_engine.utils.bits import same_bits
from rl_engine.utils.checks import nan_policy
from rl_engine.validation.common import check_row_invariance
from tests.helpers.strategies import DTYPES, row_trials

OP = "gemm.linear"


def _data(m, k, n, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    x = torch.randn(m, k, generator=g).to(dt)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dt)
    b = torch.randn(n, generator=g).to(dt) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), m=st.integers(1, 150), k=st.sampled_from([8, 48, 64, 96]), n=st.integers(1, 70), bias=st.booleans())
def test_row_invariance_forward_and_grad(dtype, data, m, k, n, bias):
    x, w, b = _data(m, k, n, dtype, seed=m * 7 + n, bias=bias)
    trials = data.draw(row_trials(m))
    rep = check_row_invariance(gemm.linear, [x], trials, (w, b), grads=True)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=30)
@given(start=st.integers(0, 1500), length=st.integers(1, 1100))
def test_output_feature_chunk_invariance(dtype, start, length):
    x, w, _ = _data(70, 32, 2100, dtype, seed=1, bias=False)
    full = gemm.linear(x, w)
    stop = min(start + length, 2100)
    part = gemm.linear(x, w[start:stop].contiguous())
    assert same_bits(part, full[:, start:stop]), "column chunk differs from the full product"


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_native_linear_is_caught(dtype):
    """The native whole-batch matmul is not row invariant on CPU: the same checker must say so."""
    x, w, b = _data(300, 4096, 1024, dtype, seed=3)
    trials = [[0], [5, 17], list(range(0, 300, 3))]
    rep = check_row_invariance(lambda x_, w_, b_: F.linear(x_, w_, b_), [x], trials, (w, b))
    assert not rep.ok
    ours = check_row_invariance(gemm.linear, [x], trials, (w, b))
    assert ours.ok, str(ours)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64, 10), (65, 128, 1030), (3, 7, 5, 33)])
def test_accuracy_forward_and_grads(dtype, shape):
    *lead, k, n = shape
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    x = torch.randn(*lead, k, generator=g).to(dt).requires_grad_()
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dt).requires_grad_()
    b = torch.randn(n, generator=g).to(dt).requires_grad_()
    y = gemm.linear(x, w, b)
    up = torch.randn(y.shape, generator=g).to(dt)
    y.backward(up)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = linear_f64(x64, w64, b64)
    y64.backward(up.double())
    fwd = contracts.tolerance(OP, dt, "forward")
    bwd = contracts.tolerance(OP, dt, "backward")
    assert y.dtype == dt
    assert fwd.check(y, y64), fwd.max_violation(y, y64)
    # gradients are compared against the float64 gradient scaled to the bf16/fp32 output grid
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert got.dtype == dt
        assert bwd.check(got, want), bwd.max_violation(got, want)


def test_run_to_run_determinism_including_weight_grad():
    x, w, b = _data(130, 96, 40, "float32", seed=5)
    outs = []
    for _ in range(3):
        xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
        y = gemm.linear(xx, ww, bb)
        y.backward(torch.ones_like(y))
        outs.append((y, xx.grad, ww.grad, bb.grad))
    for a, b_ in zip(outs[0], outs[1]):
        assert same_bits(a, b_)
    for a, b_ in zip(outs[0], outs[2]):
        assert same_bits(a, b_)


def test_bad_input_messages_name_the_argument():
    x, w, b = _data(4, 8, 3, "float32")
    with pytest.raises(ValueError, match="^weight: expected shape"):
        gemm.linear(x, torch.randn(3, 9))
    with pytest.raises(ValueError, match="^weight: expected dtype"):
        gemm.linear(x, w.double())
    with pytest.raises(ValueError, match="^x: expected dtype"):
        gemm.linear(x.half(), w)
    with pytest.raises(ValueError, match="^bias: expected shape"):
        gemm.linear(x, w, torch.randn(4))
    with pytest.raises(ValueError, match="^x: expected a contiguous"):
        gemm.linear(torch.randn(8, 4).t(), w)
    with pytest.raises(ValueError, match="^x: contains NaN"):
        gemm.linear(torch.full((2, 8), float("nan")), w)
    gemm.linear(x, torch.full((3, 8), float("nan")))  # parameters are scanned only under raise_all
    with nan_policy("raise_all"), pytest.raises(ValueError, match="^weight: contains NaN"):
        gemm.linear(x, torch.full((3, 8), float("nan")))
    with nan_policy("propagate"):
        assert torch.isnan(gemm.linear(torch.full((2, 8), float("nan")), w)).all()
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor"):
        gemm.linear([[1.0]], w)
    meta = torch.empty(4, 8, device="meta")
    with pytest.raises(ValueError, match="device"):
        gemm.linear(meta, w)


def test_empty_batch_gives_empty_output():
    x, w, b = _data(0, 8, 3, "float32")
    assert gemm.linear(x, w, b).shape == (0, 3)
