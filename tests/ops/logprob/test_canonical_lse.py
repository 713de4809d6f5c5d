"""The canonical log-sum-exp itself: the documented algorithm is what runs (an independent
block-by-block spec gives the same bits), vocabulary chunking at block boundaries changes no bit,
temperature division and gradient scaling are correctly rounded, and the elementwise functions
it relies on give the same bits wherever an element sits in a tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine.backends.cpu.common import TILE_N
from rl_engine.utils.reductions import fixed_order_sum
from rl_engine.backends.cpu.logprob.lse import VOCAB_BLOCK, LseAccumulator, finish_grad, scale_logits
from rl_engine.ops import logprob
from rl_engine.utils import portable
from rl_engine.utils.bits import same_bits
from tests.helpers.threads import threads

F32_MAX = torch.finfo(torch.float32).max


def _rows(n, v, seed=0, scale=4.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def spec_lse_entropy(z_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/operators/logprob.md, written out for one row with 0-dim fp32 tensors (``exp`` and
    ``log`` are `rl_engine.utils.portable`'s, as the CPU backend computes them: torch's own differ
    between CPUs)."""
    f = torch.float32
    m = torch.tensor(float("-inf"), dtype=f)
    s = torch.tensor(0.0, dtype=f)
    t = torch.tensor(0.0, dtype=f)
    for b0 in range(0, z_row.numel(), VOCAB_BLOCK):
        blk = z_row[b0 : b0 + VOCAB_BLOCK]
        blk = torch.cat([blk, torch.full((VOCAB_BLOCK - blk.numel(),), float("-inf"))])
        m_b = blk.max() + 0.0
        shift = torch.where(m_b == float("-inf"), torch.tensor(0.0), m_b)
        d = blk - shift
        e = portable.exp(d)
        s_b = fixed_order_sum(e)
        t_b = fixed_order_sum(e * d.clamp_min(-F32_MAX))
        m_new = torch.maximum(m, m_b)
        ref = torch.where(m_new == float("-inf"), torch.tensor(0.0), m_new)
        d_old = (m - ref).clamp_min(-F32_MAX)
        d_b = (m_b - ref).clamp_min(-F32_MAX)
        a_old, a_b = portable.exp(d_old), portable.exp(d_b)
        t = (a_old * t + (a_old * d_old) * s) + (a_b * t_b + (a_b * d_b) * s_b)
        s = s * a_old + s_b * a_b
        m = m_new
    return m + portable.log(s), portable.log(s) - t / s


def test_vocab_block_is_the_gemm_column_tile():
    assert VOCAB_BLOCK == TILE_N == logprob.VOCAB_BLOCK == 1024


@pytest.mark.parametrize("v", [1, 1023, 1024, 1025, 2600])
def test_implementation_matches_the_documented_algorithm_bit_for_bit(v):
    z = _rows(5, v, seed=v)
    z[1, : min(v - 1, 1100)] = float("-inf")  # masked entries (a whole block when v is large)
    z[2] = 0.0
    acc = LseAccumulator(5, entropy=True, vocab_size=v)
    acc.update(z, 0)
    res = acc.finish()
    for r in range(5):
        lse, ent = spec_lse_entropy(z[r])
        assert same_bits(res.lse[r], lse), r
        assert same_bits(res.entropy[r], ent), r


@settings(max_examples=60)
@given(v=st.integers(1, 5200), data=st.data(), n=st.integers(1, 6))
def test_chunked_accumulation_equals_whole_row(v, data, n):
    """Feeding the vocabulary in any block-aligned chunks gives the same bits as feeding it whole."""
    with threads(1):
        z = _rows(n, v, seed=v)
        whole = LseAccumulator(n, entropy=True, vocab_size=v)
        whole.update(z, 0)
        want = whole.finish()
        n_blocks = -(-v // VOCAB_BLOCK)
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(n_blocks - 1, 1)), max_size=4))))
        bounds = [0] + [c * VOCAB_BLOCK for c in cuts if c * VOCAB_BLOCK < v] + [v]
        acc = LseAccumulator(n, entropy=True, vocab_size=v)
        for a, b in zip(bounds, bounds[1:]):
            acc.update(z[:, a:b], a)
        got = acc.finish()
        assert same_bits(got.lse, want.lse)
        assert same_bits(got.entropy, want.entropy)


def test_signed_zero_maxima_give_identical_bits():
    a = torch.zeros(1, 2048)
    b = a.clone()
    b[0, ::3] = -0.0
    res = []
    for z in (a, b):
        acc = LseAccumulator(1, entropy=True, vocab_size=2048)
        acc.update(z, 0)
        res.append(acc.finish())
    assert same_bits(res[0].lse, res[1].lse)
    assert same_bits(res[0].entropy, res[1].entropy)


def test_accumulator_rejects_misaligned_or_incomplete_chunks():
    z = _rows(2, 3000)
    acc = LseAccumulator(2, entropy=False, vocab_size=3000)
    with pytest.raises(ValueError, match="^start: expected the next block-aligned offset 0"):
        acc.update(z[:, 5:], 5)
    with pytest.raises(ValueError, match="must span whole blocks"):
        acc.update(z[:, :1000], 0)
    acc.update(z[:, :1024], 0)
    with pytest.raises(ValueError, match="accumulated 1024 of 3000"):
        acc.finish()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.3, 2.0 / 3.0, 1e-3])
def test_temperature_is_one_correctly_rounded_division(dtype, temperature):
    x = (_rows(64, 999, seed=1) * 10).to(dtype)
    t32 = torch.tensor(temperature, dtype=torch.float32).double()
    want = (x.double() / t32).float()  # float64 quotient of fp32 operands, rounded once: exact IEEE fp32 division
    assert same_bits(scale_logits(x, temperature), want)
    assert same_bits(scale_logits(x, 1.0), x.float())


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_gradient_scaling_is_one_correctly_rounded_division(temperature):
    dz = _rows(32, 777, seed=2)
    t32 = torch.tensor(temperature, dtype=torch.float32).double()
    assert same_bits(finish_grad(dz.clone(), temperature, torch.float32), (dz.double() / t32).float())
    assert same_bits(finish_grad(dz.clone(), temperature, torch.bfloat16), (dz.double() / t32).float().bfloat16())


@pytest.mark.parametrize("fn", [torch.exp, torch.log], ids=["exp", "log"])
def test_elementwise_functions_do_not_depend_on_the_element_position(fn):
    """exp and log give the same bits for an element whether it sits in the vectorised body or
    the scalar tail of the kernel (the assumption that makes the canonical LSE row invariant)."""
    x = torch.rand(4133, generator=torch.Generator().manual_seed(0)) * 30 + 1e-3
    if fn is torch.exp:
        x = x - 25.0
    full = fn(x)
    for start in range(0, 4096, 61):
        for length in (1, 3, 7, 9, 17, 33):
            assert same_bits(fn(x[start : start + length]), full[start : start + length]), (start, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_custom_ops_pass_opcheck(dtype):
    import rl_engine.backends.cpu.logprob  # noqa: F401  (registers torch.ops.rlk.*)

    ops = torch.ops.rlk
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 1100, generator=g) * 3).to(dtype)
    t = torch.randint(0, 1100, (5,), generator=g)
    h = torch.randn(5, 16, generator=g).to(dtype)
    w = (torch.randn(1100, 16, generator=g) / 4).to(dtype)
    lp, lse = ops.token_logprobs_cpu(x, t, 0.8)
    ent, _ = ops.entropy_cpu(x, 0.8)
    ls, _ = ops.log_softmax_cpu(x, 0.8)
    up = torch.randn(5, generator=g)
    cases = [
        (ops.log_softmax_cpu.default, (x.clone().requires_grad_(), 0.8)),
        (ops.log_softmax_cpu_backward.default, (torch.randn(5, 1100, generator=g), ls, 0.8, dtype)),
        (ops.token_logprobs_cpu.default, (x.clone().requires_grad_(), t, 0.8)),
        (ops.token_logprobs_cpu_backward.default, (up, x, t, lse, 0.8)),
        (ops.entropy_cpu.default, (x.clone().requires_grad_(), 0.8)),
        (ops.entropy_cpu_backward.default, (up, x, lse, ent, 0.8)),
        (ops.linear_token_logprobs_cpu.default, (h.clone().requires_grad_(), w.clone().requires_grad_(), t, 0.8, True, 2, 1024)),
        (ops.linear_token_logprobs_cpu_backward.default, (up, up.clone(), h, w, t, lse, ent, 0.8, 2, 1024, True, True)),
    ]
    # the processed variant (kept-set records) and the fp32-logits variant of the fused op
    from rl_engine.ops.logprob import kept_set

    kept = kept_set(x, 0.8, 30, 0.9)
    t_in = kept.mask(x.float() / 0.8).float().argmax(1)  # a kept target per row
    kt, kb = kept.threshold, kept.boundary
    klp, klse = ops.token_logprobs_cpu(x, t_in, 0.8, kt, kb)
    kent, _ = ops.entropy_cpu(x, 0.8, kt, kb)
    kls, _ = ops.log_softmax_cpu(x, 0.8, kt, kb)
    cases += [
        (ops.log_softmax_cpu.default, (x.clone().requires_grad_(), 0.8, kt, kb)),
        (ops.log_softmax_cpu_backward.default, (torch.randn(5, 1100, generator=g), kls, 0.8, dtype, True)),
        (ops.token_logprobs_cpu.default, (x.clone().requires_grad_(), t_in, 0.8, kt, kb)),
        (ops.token_logprobs_cpu_backward.default, (up, x, t_in, klse, 0.8, kt, kb)),
        (ops.entropy_cpu.default, (x.clone().requires_grad_(), 0.8, kt, kb)),
        (ops.entropy_cpu_backward.default, (up, x, klse, kent, 0.8, kt, kb)),
    ]
    from rl_engine.ops.gemm import linear

    fp32 = dtype == torch.bfloat16  # the fp32-logits variant where it applies
    hk = kept_set(linear(h, w, out_dtype=torch.float32 if fp32 else None), 0.8, 30, 0.9)
    ht = hk.mask(linear(h, w, out_dtype=torch.float32).float() / 0.8).float().argmax(1)
    hlp, hent, hlse = ops.linear_token_logprobs_cpu(h, w, ht, 0.8, True, 2, 1024, hk.threshold, hk.boundary, fp32)
    cases += [
        (ops.linear_token_logprobs_cpu.default, (h.clone().requires_grad_(), w.clone().requires_grad_(), ht, 0.8, True, 2,
                                                 1024, hk.threshold, hk.boundary, fp32)),
        (ops.linear_token_logprobs_cpu_backward.default, (up, up.clone(), h, w, ht, hlse, hent, 0.8, 2, 1024, True, True,
                                                          hk.threshold, hk.boundary, fp32)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
