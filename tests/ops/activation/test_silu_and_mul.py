"""activation.silu_and_mul: accuracy vs float64 (forward and gradient), row and chunk invariance
on raw bits with negative controls, run-to-run determinism, bad input, custom-op checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.ops import activation
from rl_engine.reference.activation import silu_and_mul_f64
from rl_engine.runtime.registry import reference_for
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common import check_row_invariance
from tests.helpers.determinism import run_to_run_failures, thread_count_failures
from tests.helpers.strategies import DTYPES, row_trials
from tests.helpers.threads import threads

OP = "activation.silu_and_mul"


def _data(shape, dtype, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), m=st.integers(1, 40), d=st.sampled_from([1, 5, 16, 31, 33, 100]), lead=st.sampled_from([(), (2,)]))
def test_row_invariance_forward_and_grad(dtype, data, m, d, lead):
    x = _data((m, *lead, 2 * d), dtype, seed=m * 13 + d)
    with threads(1):  # tiny calls; thread-count independence is tested below
        rep = check_row_invariance(activation.silu_and_mul, [x], data.draw(row_trials(m)), grads=True)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=30)
@given(start=st.integers(0, 90), length=st.integers(1, 100))
def test_feature_chunk_invariance(dtype, start, length):
    """A tensor-parallel shard (the same feature columns of the gate and up halves) gives the
    same bits as those columns of the full output."""
    d = 100
    x = _data((37, 2 * d), dtype, seed=1)
    stop = min(start + length, d)
    shard = torch.cat([x[:, start:stop], x[:, d + start : d + stop]], -1).contiguous()
    assert same_bits(activation.silu_and_mul(shard), activation.silu_and_mul(x)[:, start:stop])


def _native_silu_and_mul(x):
    """HF-style: F.silu on the (contiguous) gate tensor times the up tensor."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d].contiguous()) * x[..., d:]


def _batch_dependent_rounding(x):
    """Deliberately NOT row invariant: small batches round silu(a) to x.dtype before the product
    (vLLM's order), larger ones round once — a kernel choice that follows the batch size."""
    d = x.shape[-1] // 2
    a, b = x[..., :d].float(), x[..., d:].float()
    s = a / (torch.exp(-a) + 1.0)
    if x.shape[0] <= 4:
        s = s.to(x.dtype).float()
    return (s * b).to(x.dtype)


def test_negative_control_native_silu_fp32_is_caught():
    """F.silu's scalar tail differs from its vectorised body in fp32 (measured): a row alone,
    whose elements land in the tail, differs from the same row inside a batch."""
    x = _data((37, 62), "float32", seed=2)
    trials = [[i] for i in range(37)]
    assert not check_row_invariance(_native_silu_and_mul, [x], trials, grads=True).ok
    assert check_row_invariance(activation.silu_and_mul, [x], trials, grads=True).ok


def test_negative_control_batch_dependent_rounding_bf16_is_caught():
    """bf16 hides one-fp32-ulp differences almost always, so the bf16 control moves a rounding point."""
    x = _data((37, 62), "bfloat16", seed=2)
    trials = [[0], [3, 1], list(range(37))[::-1]]
    assert not check_row_invariance(_batch_dependent_rounding, [x], trials).ok
    assert check_row_invariance(activation.silu_and_mul, [x], trials, grads=True).ok


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (33, 200), (4, 3, 256)])
def test_accuracy_forward_and_grad(dtype, shape):
    dt = getattr(torch, dtype)
    x = _data(shape, dtype, seed=3).requires_grad_()
    y = activation.silu_and_mul(x)
    up = _data(y.shape, dtype, seed=4, scale=1.0)
    y.backward(up)
    x64 = x.detach().double().requires_grad_()
    y64 = silu_and_mul_f64(x64)
    y64.backward(up.double())
    fwd = contracts.tolerance(OP, dt, "forward")
    bwd = contracts.tolerance(OP, dt, "backward")
    assert y.dtype == dt and y.shape == (*shape[:-1], shape[-1] // 2)
    assert fwd.check(y, y64), fwd.max_violation(y, y64)
    assert x.grad.dtype == dt
    assert bwd.check(x.grad, x64.grad), bwd.max_violation(x.grad, x64.grad)


def test_bf16_within_one_ulp_of_hf_rounding():
    """HF / vLLM round silu(a) to bf16 before the product; we round once: at most one ulp apart."""
    x = _data((256, 2048), "bfloat16", seed=8)
    hf = F.silu(x[:, :1024].contiguous()) * x[:, 1024:]
    ulp = torch.nextafter(hf.abs(), torch.full_like(hf, float("inf"))).double() - hf.abs().double()
    assert bool(((activation.silu_and_mul(x).double() - hf.double()).abs() <= ulp).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_fallback_takes_the_dispatch_arguments(dtype):
    dt = getattr(torch, dtype)
    x = _data((5, 2, 20), dtype, seed=9)
    y = reference_for(OP)(x)
    assert y.dtype == dt and contracts.tolerance(OP, dt).check(y, activation.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_inputs_stay_finite(dtype):
    """exp(-a) overflows to inf for a < -88: silu(a) -> -0, its gradient -> 0, never NaN."""
    x = torch.tensor([[-1e4, -100.0, -88.7, 0.0, 88.7, 1e4, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], dtype=getattr(torch, dtype))
    x.requires_grad_()
    y = activation.silu_and_mul(x)
    y.backward(torch.ones_like(y))
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(x.grad).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism(dtype):
    x = _data((300, 2, 130), dtype, seed=5)
    assert run_to_run_failures(activation.silu_and_mul, [x]) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_do_not_depend_on_thread_count(dtype):
    assert thread_count_failures(activation.silu_and_mul, [_data((300, 2, 258), dtype, seed=7)]) == []


def test_bad_input_messages_name_the_argument():
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor"):
        activation.silu_and_mul([1.0, 2.0])
    with pytest.raises(ValueError, match="^x: expected dtype"):
        activation.silu_and_mul(torch.randn(2, 4).half())
    with pytest.raises(ValueError, match="^x: expected a positive even last dimension"):
        activation.silu_and_mul(torch.randn(2, 5))
    with pytest.raises(ValueError, match="^x: expected a positive even last dimension"):
        activation.silu_and_mul(torch.randn(2, 0))
    with pytest.raises(ValueError, match="^x: expected at least 1 dimensions"):
        activation.silu_and_mul(torch.tensor(1.0))
    with pytest.raises(ValueError, match="^x: expected a contiguous"):
        activation.silu_and_mul(torch.randn(4, 6).t())
    with pytest.raises(ValueError, match="^x: contains NaN"):
        activation.silu_and_mul(torch.full((2, 4), float("nan")))
    with pytest.raises(ValueError, match="device"):
        activation.silu_and_mul(torch.empty(2, 4, device="meta"))


def test_empty_batch_gives_empty_output():
    assert activation.silu_and_mul(torch.empty(0, 6)).shape == (0, 3)


def test_custom_ops_pass_opcheck():
    import rl_engine.backends.cpu.activation  # noqa: F401  (registers torch.ops.rlk.*)

    x = _data((4, 3, 10), "bfloat16", seed=6)
    torch.library.opcheck(torch.ops.rlk.silu_and_mul_cpu.default, (x.requires_grad_(),))
    torch.library.opcheck(torch.ops.rlk.silu_and_mul_cpu_backward.default, (_data((4, 3, 5), "bfloat16"), x.detach()))
