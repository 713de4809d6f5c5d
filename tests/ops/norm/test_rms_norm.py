"""norm.rms_norm and norm.fused_add_rms_norm: accuracy vs float64 (forward and every gradient),
row invariance on raw bits (forward and input gradients) with negative controls, closeness to
HF Qwen3RMSNorm, run-to-run determinism including dweight, bad input, custom-op checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.utils.reductions import fixed_order_sum
from rl_engine.ops import norm
from rl_engine.reference.norm import fused_add_rms_norm_f64, rms_norm_f64
from rl_engine.runtime.registry import reference_for
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common import check_row_invariance
from rl_engine.utils.checks import nan_policy
from tests.helpers.determinism import run_to_run_failures, thread_count_failures
from tests.helpers.strategies import DTYPES, row_trials
from tests.helpers.threads import threads

EPS = 1e-6


def _data(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    x = (torch.randn(shape, generator=g) * 3).to(dt)
    r = torch.randn(shape, generator=g).to(dt)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dt)
    return x, r, w


# ----------------------------------------------------------------------------- row invariance


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), m=st.integers(1, 40), heads=st.sampled_from([None, 1, 3]), h=st.sampled_from([1, 7, 48, 64, 65, 130]))
def test_rms_norm_row_invariance_forward_and_grad(dtype, data, m, heads, h):
    shape = (m, h) if heads is None else (m, heads, h)
    x, _, w = _data(shape, dtype, seed=m * 31 + h)
    with threads(1):  # tiny calls; thread-count independence is tested below
        rep = check_row_invariance(norm.rms_norm, [x], data.draw(row_trials(m)), (w, EPS), grads=True)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), m=st.integers(1, 40), h=st.sampled_from([1, 7, 64, 65, 130]))
def test_fused_add_rms_norm_row_invariance_forward_and_grad(dtype, data, m, h):
    x, r, w = _data((m, h), dtype, seed=m * 17 + h)
    with threads(1):  # tiny calls; thread-count independence is tested below
        rep = check_row_invariance(norm.fused_add_rms_norm, [x, r], data.draw(row_trials(m)), (w, EPS), grads=True)
    assert rep.ok, str(rep)


def _split_rms_norm(x, w, eps):
    """Deliberately NOT row invariant: at decode-sized batches (≤ 4 rows) the sum of squares is
    split in two halves whose partial sums are stored in x.dtype, as a split-reduction kernel
    tuned for small batches would do; larger batches reduce each row in one pass."""
    H = x.shape[-1]
    h = x.float().reshape(-1, H)
    if h.shape[0] <= 4:
        half = H // 2
        ss = fixed_order_sum(h[:, :half] ** 2).to(x.dtype).float() + fixed_order_sum(h[:, half:] ** 2).to(x.dtype).float()
    else:
        ss = fixed_order_sum(h * h)
    r = torch.sqrt(ss / H + eps).reciprocal().unsqueeze(-1)
    return (w.float() * (h * r).to(x.dtype).float()).to(x.dtype).reshape(x.shape)


def _split_fused(x, res, w, eps):
    new = (x.float() + res.float()).to(x.dtype)
    return _split_rms_norm(new, w, eps), new


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_batch_dependent_split_is_caught(dtype):
    """A reduction whose split depends on the batch size must fail the same checker that ours passes."""
    x, r, w = _data((24, 200), dtype, seed=3)
    trials = [[0], [5, 17], [23, 1, 2], list(range(24))[::-1]]
    bad = check_row_invariance(_split_rms_norm, [x], trials, (w, EPS), grads=True)
    assert not bad.ok
    assert check_row_invariance(norm.rms_norm, [x], trials, (w, EPS), grads=True).ok
    bad_fused = check_row_invariance(_split_fused, [x, r], trials, (w, EPS), grads=True)
    assert not bad_fused.ok
    assert check_row_invariance(norm.fused_add_rms_norm, [x, r], trials, (w, EPS), grads=True).ok


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (33, 200), (4, 3, 128), (7, 4096)])
def test_rms_norm_accuracy_forward_and_grads(dtype, shape):
    dt = getattr(torch, dtype)
    x, _, w = _data(shape, dtype, seed=1)
    x.requires_grad_()
    w.requires_grad_()
    y = norm.rms_norm(x, w, EPS)
    up = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dt)
    y.backward(up)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    y64 = rms_norm_f64(x64, w64, EPS)
    y64.backward(up.double())
    fwd = contracts.tolerance("norm.rms_norm", dt, "forward")
    bwd = contracts.tolerance("norm.rms_norm", dt, "backward")
    assert y.dtype == dt and y.shape == x.shape
    assert fwd.check(y, y64), fwd.max_violation(y, y64)
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad)):
        assert got.dtype == dt
        assert bwd.check(got, want), bwd.max_violation(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (33, 200), (2, 5, 96)])
def test_fused_add_rms_norm_accuracy_forward_and_grads(dtype, shape):
    op = "norm.fused_add_rms_norm"
    dt = getattr(torch, dtype)
    x, r, w = _data(shape, dtype, seed=4)
    for t in (x, r, w):
        t.requires_grad_()
    out, new_res = norm.fused_add_rms_norm(x, r, w, EPS)
    g = torch.Generator().manual_seed(5)
    up_out = torch.randn(out.shape, generator=g).to(dt)
    up_res = torch.randn(out.shape, generator=g).to(dt)
    torch.autograd.backward([out, new_res], [up_out, up_res])
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    out64, res64 = fused_add_rms_norm_f64(x64, r64, w64, EPS)
    torch.autograd.backward([out64, res64], [up_out.double(), up_res.double()])
    fwd = contracts.tolerance(op, dt, "forward")
    bwd = contracts.tolerance(op, dt, "backward")
    assert fwd.check(out, out64), fwd.max_violation(out, out64)
    assert fwd.check(new_res, res64), fwd.max_violation(new_res, res64)
    for got, want in ((x.grad, x64.grad), (r.grad, r64.grad), (w.grad, w64.grad)):
        assert got.dtype == dt
        assert bwd.check(got, want), bwd.max_violation(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_add_then_rms_norm_bitwise(dtype):
    x, r, w = _data((9, 3, 80), dtype, seed=6)
    out, new_res = norm.fused_add_rms_norm(x, r, w, EPS)
    assert same_bits(new_res, x + r)  # one IEEE addition rounded once to x.dtype
    assert same_bits(out, norm.rms_norm(new_res, w, EPS))


def _sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """IEEE (correctly rounded) fp32 sqrt: Python's math.sqrt is IEEE float64 sqrt, and rounding
    it to fp32 is the fp32 IEEE result. ``torch.sqrt`` on CPU is not (MKL's vector sqrt)."""
    return torch.tensor([math.sqrt(t) for t in v.flatten().tolist()], dtype=torch.float64).float().reshape(v.shape)


def _hf_qwen3_rms_norm(x, w, eps, mean=lambda v: v.mean(-1, keepdim=True), rsqrt=torch.rsqrt):
    """HF Qwen3RMSNorm.forward, its math order verbatim (the mean and rsqrt are swappable)."""
    h = x.to(torch.float32)
    variance = mean(h.pow(2))
    h = h * rsqrt(variance + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_points_are_hf_qwen3_rms_norm(dtype):
    """HF's formula with its two non-fixed steps replaced (mean -> fixed_order_sum / H, rsqrt ->
    1/sqrt, IEEE) is bit for bit our operator: the rounding points are HF's."""
    x, _, w = _data((64, 3, 200), dtype, seed=7)
    hf_fixed = _hf_qwen3_rms_norm(
        x, w, EPS, mean=lambda v: (fixed_order_sum(v) / v.shape[-1]).unsqueeze(-1), rsqrt=lambda v: 1 / _sqrt_rn(v)
    )
    assert same_bits(norm.rms_norm(x, w, EPS), hf_fixed)


def test_bf16_within_one_ulp_of_verbatim_hf():
    """bf16: the fp32 differences (sum order, rsqrt) move the rounded value by at most one ulp."""
    x, _, _ = _data((64, 4096), "bfloat16", seed=7)
    w = torch.ones(4096, dtype=torch.bfloat16)
    ours = norm.rms_norm(x, w, EPS)
    hf = _hf_qwen3_rms_norm(x, w, EPS)
    ulp = (torch.nextafter(hf.abs(), torch.full_like(hf, float("inf"))) - hf.abs()).double()
    assert bool(((ours.double() - hf.double()).abs() <= ulp).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_fallback_takes_the_dispatch_arguments(dtype):
    """The diagnostic-policy fallback is called with the implementation's arguments."""
    dt = getattr(torch, dtype)
    x, r, w = _data((5, 2, 48), dtype, seed=10)
    y = reference_for("norm.rms_norm")(x, w, EPS)
    assert y.dtype == dt and contracts.tolerance("norm.rms_norm", dt).check(y, norm.rms_norm(x, w, EPS))
    out, new = reference_for("norm.fused_add_rms_norm")(x, r, w, EPS)
    ours = norm.fused_add_rms_norm(x, r, w, EPS)
    tol = contracts.tolerance("norm.fused_add_rms_norm", dt)
    assert tol.check(out, ours[0]) and tol.check(new, ours[1])


# ----------------------------------------------------------------------------- determinism, input


@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism_including_weight_grad(dtype):
    x, r, w = _data((150, 3, 96), dtype, seed=8)
    assert run_to_run_failures(lambda a, b: norm.rms_norm(a, b, EPS), [x, w]) == []
    assert run_to_run_failures(lambda a, b, c: norm.fused_add_rms_norm(a, b, c, EPS), [x, r, w]) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_do_not_depend_on_thread_count(dtype):
    x, r, w = _data((300, 2, 256), dtype, seed=12)
    assert thread_count_failures(lambda a, b: norm.rms_norm(a, b, EPS), [x, w]) == []
    assert thread_count_failures(lambda a, b, c: norm.fused_add_rms_norm(a, b, c, EPS), [x, r, w]) == []


def test_bad_input_messages_name_the_argument():
    x, r, w = _data((4, 8), "float32")
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor"):
        norm.rms_norm([[1.0]], w)
    with pytest.raises(ValueError, match="^x: expected dtype"):
        norm.rms_norm(x.half(), w)
    with pytest.raises(ValueError, match="^weight: expected dtype"):
        norm.rms_norm(x, w.bfloat16())
    with pytest.raises(ValueError, match="^weight: expected shape"):
        norm.rms_norm(x, torch.ones(9))
    with pytest.raises(ValueError, match="^weight: expected 1 dimensions"):
        norm.rms_norm(x, torch.ones(1, 8))
    with pytest.raises(ValueError, match="^x: expected a contiguous"):
        norm.rms_norm(torch.randn(8, 4).t(), w)
    with pytest.raises(ValueError, match="^x: contains NaN"):
        norm.rms_norm(torch.full((2, 8), float("nan")), w)
    norm.rms_norm(x, torch.full((8,), float("nan")))  # parameters are not scanned by default
    with nan_policy("raise_all"), pytest.raises(ValueError, match="^weight: contains NaN"):
        norm.rms_norm(x, torch.full((8,), float("nan")))
    with pytest.raises(ValueError, match="^x: expected a non-empty last dimension"):
        norm.rms_norm(torch.empty(3, 0), torch.empty(0))
    with pytest.raises(ValueError, match="^x: expected at least 1 dimensions"):
        norm.rms_norm(torch.tensor(1.0), w)
    for eps in (0.0, -1e-6, float("nan"), float("inf"), True, "1e-6"):
        with pytest.raises(ValueError, match="^eps: expected a finite float > 0"):
            norm.rms_norm(x, w, eps)
    with pytest.raises(ValueError, match="^residual: expected shape"):
        norm.fused_add_rms_norm(x, torch.randn(4, 9), w)
    with pytest.raises(ValueError, match="^residual: expected dtype"):
        norm.fused_add_rms_norm(x, r.bfloat16(), w)
    with pytest.raises(ValueError, match="device"):
        norm.rms_norm(torch.empty(4, 8, device="meta"), torch.empty(8, device="meta"))


def test_empty_batch_gives_empty_output_and_zero_weight_grad():
    w = torch.ones(8, requires_grad=True)
    x = torch.empty(0, 8, requires_grad=True)
    y = norm.rms_norm(x, w)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros(8))


def test_custom_ops_pass_opcheck():
    import rl_engine.backends.cpu.norm  # noqa: F401  (registers torch.ops.rlk.*)

    x, r, w = _data((3, 2, 16), "bfloat16", seed=9)
    g = torch.randn(3, 2, 16).bfloat16()
    cases = [
        (torch.ops.rlk.rms_norm_cpu.default, (x.requires_grad_(), w.requires_grad_(), EPS)),
        (torch.ops.rlk.rms_norm_cpu_backward.default, (g, x.detach(), w.detach(), EPS)),
        (torch.ops.rlk.fused_add_rms_norm_cpu.default, (x.detach().requires_grad_(), r.requires_grad_(), w.detach().requires_grad_(), EPS)),
        (torch.ops.rlk.fused_add_rms_norm_cpu_backward.default, (g, g.clone(), x.detach(), w.detach(), EPS)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
