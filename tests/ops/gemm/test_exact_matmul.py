"""backends.cpu.common.exact_matmul: the exact-sum GEMM under every CPU op's products.

Its claims, each on raw bits: blocking over rows and K changes nothing (the block sums are exact);
element (m, n) depends only on x[m] and w[n]; with scale_by="k" a masked slot's contents do not
reach the other terms, nor do the x values of a slot whose w column is zero (negative control:
per-row scales do let them in); fp32 accuracy is float32
rounding; zero sums are +0; non-finite operands follow IEEE rules.
"""

from __future__ import annotations

import math

import pytest
import torch

import rl_engine.backends.cpu.common as common
from rl_engine.backends.cpu.common import exact_beta, exact_bmm, exact_finish, exact_matmul, exact_partial_sums, row_exponents
from rl_engine.utils.bits import same_bits


def _randn(shape, seed, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocking_changes_no_bit(dtype, monkeypatch):
    x, w = _randn((700, 1300), 0, dtype), _randn((300, 1300), 1, dtype)
    small = exact_matmul(x, w)
    monkeypatch.setattr(common, "_ROW_BLOCK", 10**9)
    monkeypatch.setattr(common, "_K_BLOCK", 10**9)
    assert same_bits(exact_matmul(x, w), small)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elements_depend_on_their_row_and_column_only(dtype):
    x, w = _randn((97, 2048), 2, dtype), _randn((130, 2048), 3, dtype)
    full = exact_matmul(x, w)
    perm = torch.randperm(97, generator=torch.Generator().manual_seed(4))
    assert same_bits(exact_matmul(x[perm], w), full[perm])
    assert same_bits(exact_matmul(x[5:6], w[17:90]), full[5:6, 17:90])
    batched = exact_matmul(x.view(1, 97, 2048).expand(3, -1, -1), w.view(1, 130, 2048).expand(3, -1, -1))
    assert same_bits(batched[2], full)


def test_fp32_accuracy_is_float32_rounding():
    x, w = _randn((64, 4096), 5), _randn((256, 4096), 6)
    ref = x.double() @ w.double().T
    got = exact_matmul(x, w).double()
    # half an fp32 ulp of the result, plus the dropped lo·lo term and truncation (< K·2^-2β of
    # the rows' maxima, β = 20 here)
    r32 = ref.float().abs()
    ulp = (torch.nextafter(r32, torch.full_like(r32, math.inf)) - r32).double()
    tol = ulp / 2 + 4096 * 2.0**-40 * x.abs().amax(1, keepdim=True).double() * w.abs().amax(1).double()
    excess = ((got - ref).abs() - tol).max().item()
    assert excess <= 0, excess


def test_scale_by_k_keeps_masked_slots_out():
    p = torch.rand((4, 64, 64), generator=torch.Generator().manual_seed(7))
    p[:, :, 40:] = 0  # keys 40..63 are masked: probability exactly 0
    v = _randn((4, 64, 128), 8)
    v_stale = v.clone()
    v_stale[:, 40:] = _randn((4, 24, 128), 9, scale=1e6)
    assert same_bits(exact_bmm(p, v, scale_by="k"), exact_bmm(p, v_stale, scale_by="k"))
    # negative control: per-row scales of w = vᵀ span the masked keys, so their values leak in
    assert not torch.equal(exact_bmm(p, v), exact_bmm(p, v_stale))


def test_scale_by_k_keeps_slots_with_a_zero_weight_column_out():
    """dV = Pᵀ dO of an attention block where queries 40..63 have a zero upstream gradient (right
    pads): their probabilities must not coarsen the other queries' terms, so the result equals the
    block without them. Negative control: per-row scales of x = Pᵀ span those queries."""
    g = torch.Generator().manual_seed(11)
    pt = torch.rand((4, 64, 64), generator=g)  # [keys, queries]
    pt[:, :, :40] *= 2.0**-12  # the real queries' probabilities are small beside the pads'
    do = 1e-6 * torch.randn((4, 64, 128), generator=g)  # small upstream gradients of the real queries
    do[:, 40:] = 0
    alone = pt.clone()
    alone[:, :, 40:] = 0  # the same block without the zero-gradient queries
    assert same_bits(exact_bmm(pt, do, scale_by="k"), exact_bmm(alone, do, scale_by="k"))
    assert not torch.equal(exact_bmm(pt, do), exact_bmm(alone, do))


def test_zero_sums_are_positive_zero_and_empty_shapes():
    x = torch.zeros((3, 5))
    w = -torch.ones((2, 5))
    out = exact_matmul(x, w)
    assert torch.equal(out.view(torch.int32), torch.zeros((3, 2), dtype=torch.int32))
    assert exact_matmul(torch.zeros((0, 5)), w).shape == (0, 2)
    assert torch.equal(exact_matmul(torch.ones((2, 0)), torch.ones((3, 0))), torch.zeros((2, 3)))


def test_non_finite_operands_follow_ieee():
    inf, nan = math.inf, math.nan
    x = torch.tensor([[1.0, inf, 0.0], [1.0, 2.0, 3.0], [nan, 0.0, 0.0], [-inf, 1.0, 1.0]])
    w = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, -1.0, 1.0], [1.0, 1.0, -inf], [1.0, 0.0, 2.0]])
    got = exact_matmul(x, w)
    want = x.double() @ w.double().T
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()].float())


def test_bad_arguments():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        exact_matmul(torch.ones((2, 2), dtype=torch.float64), torch.ones((2, 2), dtype=torch.float64))
    with pytest.raises(ValueError, match="scale_by"):
        exact_matmul(torch.ones((2, 2)), torch.ones((2, 2)), scale_by="cols")


@pytest.mark.parametrize("row", [[1e-6, 1.0, 0.5], [-1e-6, -1.0, -0.5], [-0.01, 0.3], [0.3, -0.01], [-3.0, 2.0]])
def test_row_exponent_is_that_of_the_largest_magnitude(row):
    # 2^(e-1) <= max|t| < 2^e; a one-signed or lopsided row must not take its smaller end's exponent
    # (that scale would let the integer slices outgrow 2^β and the float64 sums stop being exact)
    e = row_exponents(torch.tensor([row])).item()
    m = max(abs(v) for v in row)
    assert 2.0 ** (e - 1) <= m < 2.0**e


def test_k_split_partial_sums_are_exact():
    # one-signed rows with a wide range: the integer partial sums of any K split add up to the whole
    g = torch.Generator().manual_seed(11)
    x = torch.rand((9, 3000), generator=g) * torch.logspace(-6, 0, 3000)
    w = torch.randn((7, 3000), generator=g)
    beta = exact_beta(3000, x.dtype, w.dtype)
    ex, ew = row_exponents(x), row_exponents(w)
    whole = exact_partial_sums(x, w, ex, ew, beta)
    a = exact_partial_sums(x[:, :1111].contiguous(), w[:, :1111].contiguous(), ex, ew, beta)
    b = exact_partial_sums(x[:, 1111:].contiguous(), w[:, 1111:].contiguous(), ex, ew, beta)
    for p, q, r in zip(whole, a, b):
        assert torch.equal(q + r, p) and torch.equal(p, p.round()) and bool((p.abs() < 2.0**53).all())
    assert same_bits(exact_finish([q + r for q, r in zip(a, b)], ex, ew, beta, torch.float32), exact_matmul(x, w))


# --------------------------------------------------------------------------- frozen_weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_weights_reuses_slices_with_the_same_bits(dtype):
    """Inside ``frozen_weights()`` a weight's slices are cut once and reused; every result keeps
    the uncached bits (row blocks and K blocks included: M and K past one block each)."""
    w = torch.nn.Parameter(_randn((300, 700), 1, dtype))
    xs = [_randn((m, 700), 2 + m, dtype) for m in (1, 5, 600)]
    want = [exact_matmul(x, w) for x in xs]
    with common.frozen_weights():
        cache = common._FROZEN.get()
        got = [exact_matmul(x, w) for x in xs]
        assert len(cache.entries) == 1 and cache.bytes == 300 * 700 * 8 * common._slices_of(dtype)
    assert common._FROZEN.get() is None
    assert all(same_bits(g, r) for g, r in zip(got, want))


def test_frozen_weights_sees_an_in_place_update():
    """An in-place update bumps the weight's version: its slices are cut again. Negative control:
    a cache keyed without the version serves the old slices, and the result changes bits."""
    x, w = _randn((4, 300), 3), torch.nn.Parameter(_randn((50, 300), 4))
    with common.frozen_weights():
        exact_matmul(x, w)
        with torch.no_grad():
            w.mul_(1.5)
        assert same_bits(exact_matmul(x, w), _uncached(x, w))
    raw, meta = common._SliceCache.__dict__["meta"], common._SliceCache.meta  # the staticmethod, its function
    try:
        common._SliceCache.meta = staticmethod(lambda t, beta: None if meta(t, beta) is None else meta(t, beta)[:4])
        with common.frozen_weights():
            first = exact_matmul(x, w)
            with torch.no_grad():
                w.mul_(1.5)
            stale = exact_matmul(x, w)
        assert same_bits(stale, first) and not same_bits(stale, _uncached(x, w))
    finally:
        common._SliceCache.meta = raw


def _uncached(x, w):
    token = common._FROZEN.set(None)
    try:
        return exact_matmul(x, w)
    finally:
        common._FROZEN.reset(token)


def test_frozen_weights_keeps_no_views_no_nonfinite_weights_and_respects_its_budget():
    x = _randn((2, 64), 5)
    w = _randn((40, 64), 6)
    bad = w.clone()
    bad[3, 7] = float("inf")
    with common.frozen_weights(budget_bytes=40 * 64 * 16):  # one float32 weight's two slices
        cache = common._FROZEN.get()
        exact_matmul(x, w.t().t())  # a view
        exact_matmul(x, bad)  # non-finite: the IEEE path, nothing kept
        assert not cache.entries
        exact_matmul(x, w)
        w2 = _randn((40, 64), 7)
        exact_matmul(x, w2)  # over the budget with both: the least recently used goes
        assert list(cache.entries) == [id(w2)] and cache.bytes == 40 * 64 * 16
        del w2
        assert not cache.entries and cache.bytes == 0  # a dead weight's entry goes with it


def test_frozen_weights_nests_restores_after_errors_and_checks_its_budget():
    with pytest.raises(ValueError, match="^budget_bytes: expected a size >= 0"):
        with common.frozen_weights(budget_bytes=-1):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        with common.frozen_weights():
            outer = common._FROZEN.get()
            with common.frozen_weights():
                assert common._FROZEN.get() is outer  # nested blocks share the outer cache
            raise RuntimeError("boom")
    assert common._FROZEN.get() is None
