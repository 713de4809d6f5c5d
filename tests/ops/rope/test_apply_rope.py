"""rope.apply_rope and its table rope_cos_sin: accuracy vs float64 (forward and gradient), row
invariance over tokens with their positions (prefill / chunked prefill / decode / packing) on
raw bits with a negative control, the table's exactness, determinism, bad input, custom ops."""

from __future__ import annotations

import decimal

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.ops import rope
from rl_engine.reference.rope import apply_rope_f64
from rl_engine.runtime.registry import reference_for
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common import check_row_invariance
from tests.helpers.determinism import run_to_run_failures, thread_count_failures
from tests.helpers.strategies import DTYPES, row_trials
from tests.helpers.threads import threads

OP = "rope.apply_rope"


def _x(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def _rope(theta, rotary_dim=None):
    return lambda x, p: rope.apply_rope(x, p, theta=theta, rotary_dim=rotary_dim)


# ----------------------------------------------------------------------------- row invariance


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(
    data=st.data(),
    t=st.integers(1, 40),
    heads=st.sampled_from([1, 3]),
    dims=st.sampled_from([(2, None), (8, None), (16, 8), (64, None), (66, 32)]),
    theta=st.sampled_from([10000.0, 1e6]),
    max_pos=st.sampled_from([64, 40960, 2**31 - 1]),
)
def test_row_invariance_over_tokens_with_positions(dtype, data, t, heads, dims, theta, max_pos):
    D, R = dims
    x = _x((t, heads, D), dtype, seed=t * 7 + D)
    positions = torch.randint(0, max_pos, (t,), generator=torch.Generator().manual_seed(t))
    with threads(1):  # tiny calls; thread-count independence is tested below
        rep = check_row_invariance(_rope(theta, R), [x, positions], data.draw(row_trials(t)), grads=True)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunked_prefill_and_decode_give_the_same_bits(dtype):
    T, theta = 300, 1e6
    x = _x((T, 4, 128), dtype, seed=1)
    pos = torch.arange(T)
    full = rope.apply_rope(x, pos, theta=theta)
    for s, e in ((0, 1), (0, 77), (77, 200), (200, 300)):  # chunked prefill
        assert same_bits(rope.apply_rope(x[s:e].contiguous(), pos[s:e].contiguous(), theta=theta), full[s:e])
    for p in (0, 1, 63, 64, 299):  # decode: one token at position p
        assert same_bits(rope.apply_rope(x[p : p + 1].contiguous(), pos[p : p + 1].contiguous(), theta=theta), full[p : p + 1])
    # continuous batching: three sequences' decode tokens at unrelated positions in one call
    rows = torch.tensor([5, 299, 128])
    assert same_bits(rope.apply_rope(x[rows], pos[rows], theta=theta), full[rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_with_per_sequence_positions(dtype):
    """Two sequences packed in one call, positions restarting at 0, equal separate calls."""
    a, b = _x((50, 2, 64), dtype, seed=2), _x((30, 2, 64), dtype, seed=3)
    packed = rope.apply_rope(torch.cat([a, b]), torch.cat([torch.arange(50), torch.arange(30)]))
    assert same_bits(packed[:50], rope.apply_rope(a, torch.arange(50)))
    assert same_bits(packed[50:], rope.apply_rope(b, torch.arange(30)))


def _implicit_positions_rope(x, positions):
    """Deliberately NOT row invariant: ignores the explicit positions and rotates row t by t
    (positions implied by the row index — the bug explicit positions exist to prevent)."""
    return rope.apply_rope(x, torch.arange(x.shape[0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_implicit_positions_is_caught(dtype):
    x = _x((20, 2, 32), dtype, seed=4)
    positions = torch.arange(20)
    trials = [[7], [3, 4], list(range(20))[::-1]]
    assert not check_row_invariance(_implicit_positions_rope, [x, positions], trials, grads=True).ok
    assert check_row_invariance(_rope(10000.0), [x, positions], trials, grads=True).ok


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "t,h,d,rotary_dim,theta,max_pos",
    [(1, 1, 2, None, 10000.0, 10), (33, 4, 128, None, 1e6, 32768), (17, 2, 64, 32, 10000.0, 2**31 - 1), (5, 3, 10, 6, 500.0, 100)],
)
def test_accuracy_forward_and_grad(dtype, t, h, d, rotary_dim, theta, max_pos):
    dt = getattr(torch, dtype)
    x = _x((t, h, d), dtype, seed=5).requires_grad_()
    pos = torch.randint(0, max_pos, (t,), generator=torch.Generator().manual_seed(6))
    y = rope.apply_rope(x, pos, theta=theta, rotary_dim=rotary_dim)
    up = _x(y.shape, dtype, seed=7)
    y.backward(up)
    x64 = x.detach().double().requires_grad_()
    y64 = apply_rope_f64(x64, pos, theta=theta, rotary_dim=rotary_dim)
    y64.backward(up.double())
    fwd = contracts.tolerance(OP, dt, "forward")
    bwd = contracts.tolerance(OP, dt, "backward")
    assert y.dtype == dt and y.shape == x.shape
    assert fwd.check(y, y64), fwd.max_violation(y, y64)
    assert x.grad.dtype == dt
    assert bwd.check(x.grad, x64.grad), bwd.max_violation(x.grad, x64.grad)
    R = d if rotary_dim is None else rotary_dim
    assert same_bits(y[..., R:], x[..., R:].detach())  # the pass-through features are copied
    assert same_bits(x.grad[..., R:], up[..., R:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_fallback_takes_the_dispatch_arguments(dtype):
    dt = getattr(torch, dtype)
    x, pos = _x((6, 2, 16), dtype, seed=17), torch.arange(6) * 1000
    y = reference_for(OP)(x, pos, 1e6, 8)
    assert y.dtype == dt and contracts.tolerance(OP, dt).check(y, rope.apply_rope(x, pos, theta=1e6, rotary_dim=8))


def test_table_is_the_rounded_cosine_of_the_float64_angle():
    """rope_cos_sin: within half an fp32 ulp (+1e-15) of libm's float64 cos/sin of the float64
    angle position * inv_freq_i, positions up to 2^31 - 1."""
    g = torch.Generator().manual_seed(8)
    pos = torch.cat([torch.arange(0, 2000), torch.randint(0, 2**31, (2000,), generator=g), torch.tensor([2**31 - 1])])
    R, theta = 128, 1e6
    cos, sin = rope.rope_cos_sin(pos, R, theta)
    inv = rope.rope_inv_freq(R, theta)
    # theta^e from 60-digit decimal arithmetic, then one IEEE division: the table's definition
    # (the C library's pow is not correctly rounded everywhere and picks its code path by CPU).
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        want = tuple(1.0 / float(decimal.Decimal(theta) ** decimal.Decimal((2 * i) / R)) for i in range(R // 2))
    assert inv == want
    assert all(math.isclose(a, 1.0 / theta ** ((2 * i) / R), rel_tol=3e-16) for i, a in enumerate(inv))
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (pos.numel(), R // 2)
    idx = torch.randint(0, pos.numel(), (3000,), generator=g).tolist()
    cols = torch.randint(0, R // 2, (3000,), generator=g).tolist()
    for t, i in zip(idx, cols):
        angle = float(pos[t]) * inv[i]
        for got, want in ((float(cos[t, i]), math.cos(angle)), (float(sin[t, i]), math.sin(angle))):
            a = torch.tensor(abs(got), dtype=torch.float32)
            half_ulp = 0.5 * float(torch.nextafter(a, torch.tensor(math.inf)) - a)
            assert abs(got - want) <= half_ulp + 1e-15, (t, i, got, want)


def test_table_entry_depends_only_on_position_and_frequency():
    pos = torch.randint(0, 2**31, (999,), generator=torch.Generator().manual_seed(9))
    cos, sin = rope.rope_cos_sin(pos, 96, 10000.0)
    for k in (0, 1, 500, 998):
        c1, s1 = rope.rope_cos_sin(pos[k : k + 1].contiguous(), 96, 10000.0)
        assert same_bits(c1, cos[k : k + 1]) and same_bits(s1, sin[k : k + 1])


# ----------------------------------------------------------------------------- determinism, input


@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism(dtype):
    x = _x((200, 4, 64), dtype, seed=10)
    pos = torch.randint(0, 100000, (200,), generator=torch.Generator().manual_seed(11))
    assert run_to_run_failures(lambda a: rope.apply_rope(a, pos, theta=1e6), [x]) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_do_not_depend_on_thread_count(dtype):
    x = _x((300, 4, 128), dtype, seed=14)
    pos = torch.randint(0, 2**31, (300,), generator=torch.Generator().manual_seed(15))
    assert thread_count_failures(lambda a: rope.apply_rope(a, pos, theta=1e6), [x]) == []


def test_bad_input_messages_name_the_argument():
    x = torch.randn(4, 2, 8)
    p = torch.arange(4)
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor"):
        rope.apply_rope([[1.0]], p)
    with pytest.raises(ValueError, match="^x: expected dtype"):
        rope.apply_rope(x.half(), p)
    with pytest.raises(ValueError, match="^x: expected 3 dimensions"):
        rope.apply_rope(torch.randn(4, 8), p)
    with pytest.raises(ValueError, match="^x: expected a contiguous"):
        rope.apply_rope(torch.randn(2, 4, 8).transpose(0, 1), p)
    with pytest.raises(ValueError, match="^x: contains NaN"):
        rope.apply_rope(torch.full((4, 2, 8), float("nan")), p)
    with pytest.raises(ValueError, match="^positions: expected dtype"):
        rope.apply_rope(x, p.float())
    with pytest.raises(ValueError, match=r"^positions: expected shape \[4\]"):
        rope.apply_rope(x, torch.arange(5))
    with pytest.raises(ValueError, match="^positions: expected 1 dimensions"):
        rope.apply_rope(x, p[None])
    with pytest.raises(ValueError, match="^positions: expected values in"):
        rope.apply_rope(x, torch.tensor([0, 1, -1, 2]))
    with pytest.raises(ValueError, match="^positions: expected values in"):
        rope.apply_rope(x, torch.tensor([0, 1, 2**31, 2]))
    for theta in (0.0, -1.0, float("inf"), float("nan"), None):
        with pytest.raises(ValueError, match="^theta: expected a finite float > 0"):
            rope.apply_rope(x, p, theta=theta)
    for rd in (0, 3, 10, -2, 4.0, True):
        with pytest.raises(ValueError, match="^rotary_dim: expected an even int"):
            rope.apply_rope(x, p, rotary_dim=rd)
    with pytest.raises(ValueError, match="^rotary_dim: expected an even int"):
        rope.apply_rope(torch.randn(4, 2, 7), p)  # odd head_dim and no rotary_dim
    with pytest.raises(ValueError, match="^positions: expected a 1-D int32/int64 tensor"):
        rope.rope_cos_sin(torch.arange(4.0), 8)
    with pytest.raises(ValueError, match="device"):
        rope.apply_rope(torch.empty(4, 2, 8, device="meta"), torch.empty(4, dtype=torch.int64, device="meta"))


def test_device_positions_are_checked_once_by_the_table_lookup(monkeypatch):
    """Where the entry point may not read positions back (a GPU under the default policy), it
    leaves the range to the table lookup, ``rope_cos_sin``, which checks the tighter bound of the
    table it reads: one check per call, and out-of-range positions are still refused. Simulated
    on the CPU by making the entry point see a non-readable device; the lookup, which still reads
    back here, gives the error the device assertion stands for. Negative control: with the entry's
    own check spied on, a readable device calls it once."""
    import rl_engine.ops.rope as entry

    calls = []
    real = entry.check_index_range
    monkeypatch.setattr(entry, "check_index_range", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1])
    x = torch.randn(4, 2, 8)
    rope.apply_rope(x, torch.arange(4))
    assert calls == ["positions"]
    monkeypatch.setattr(entry, "reads_back", lambda t: False)
    calls.clear()
    rope.apply_rope(x, torch.arange(4))
    assert calls == []
    with pytest.raises(ValueError, match="^positions: expected values in"):
        rope.apply_rope(x, torch.tensor([0, 1, -1, 2]))


def test_int32_positions_and_empty_batch():
    x = _x((6, 2, 16), "float32", seed=12)
    assert same_bits(rope.apply_rope(x, torch.arange(6, dtype=torch.int32)), rope.apply_rope(x, torch.arange(6)))
    assert rope.apply_rope(torch.empty(0, 2, 16), torch.empty(0, dtype=torch.int64)).shape == (0, 2, 16)


def test_custom_ops_pass_opcheck():
    import rl_engine.backends.cpu.rope  # noqa: F401  (registers torch.ops.rlk.*)

    x = _x((3, 2, 8), "bfloat16", seed=13)
    pos = torch.tensor([0, 5, 9])
    torch.library.opcheck(torch.ops.rlk.apply_rope_cpu.default, (x.requires_grad_(), pos, 10000.0, 6))
    torch.library.opcheck(torch.ops.rlk.apply_rope_cpu_backward.default, (x.detach(), pos, 10000.0, 8))


def test_cached_table_equals_direct_computation():
    """The per-(R, theta, device) cache of rows 0..N-1 is gathered by position; entries computed
    directly (as for positions beyond the cacheable range) have the same bits."""
    from rl_engine.utils import rope_tables as tables

    pos = torch.cat([torch.arange(3000), torch.randint(0, 40000, (2000,), generator=torch.Generator().manual_seed(16))])
    for R, theta in ((128, 1e6), (10, 500.0)):
        cached = tables.rope_cos_sin(pos, R, theta)
        direct = tables._direct(pos, tables.rope_inv_freq(R, theta))
        assert (R, theta, "cpu") in tables._cache
        assert same_bits(cached[0], direct[0]) and same_bits(cached[1], direct[1])
