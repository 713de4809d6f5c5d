"""The launchers' paths end to end (``launch``: ``varlen_forward``, ``cached_forward`` and the
public ops over them): every path gives every row the same bits.

GPU tests (``@pytest.mark.gpu``; the device run must show zero skips): raw-bit invariances —
packing (a sequence alone vs inside packs of others, permuted; forward and gradients,
hypothesis), prefill/decode (varlen row == full prefill == chunked prefill with several chunkings
== decode steps, contiguous and paged caches with page sizes 16/64/256 and shuffled stale pages,
hypothesis), long contexts crossing 1024-key splits (1024+1, 2048+37, 3000: decode through the
split-parallel kernel), all-``-0.0`` values; accuracy of the cached path; run-to-run determinism
of forward and backward; negative controls: PyTorch SDPA (prefill vs decode) and a planted
batch-dependent path are caught by the same bitwise checkers; bounded performance against SDPA
(prefill forward, bf16, Qwen3-8B heads).

Packing and prefill/decode invariance run hypothesis examples in bf16 (``PACKING_EXAMPLES``,
``ROLLOUT_EXAMPLES``) and fixed cases in fp32 (``FP32_PACKING_CASES``, ``FP32_ROLLOUT_CASES``):
every new fp32 specialisation recompiles kernels with IEEE products by FMA, slow to compile.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.ops.attention import ContiguousKVCache, PagedKVCache, cached_attention
from rl_engine.reference.attention import varlen_attention_f64
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common.attention import (
    check_packing_invariance,
    check_prefill_decode_invariance,
    check_run_to_run,
    chunked_schedule,
    decode_schedule,
    full_prefill_schedule,
    random_schedule,
    sdpa_rollout,
    sdpa_train,
)
from tests.backends.triton._rowwise_common import evidence, graph_us
from tests.backends.triton.attention._attention_common import (
    DTYPES,
    OPS,
    contiguous_cache,
    cpu_io,
    gpu,
    gpu_rollout,
    gpu_train,
    make_qkv,
    paged_cache,
    split,
)


# --------------------------------------------------------------------------- GPU: accuracy of the cached path


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_accuracy_cached_chunked_and_decode(dtype, paged):
    dt = getattr(torch, dtype)
    q, k, v, cu = make_qkv([1500], 2, 4, 128, dtype, seed=5)
    cache = (PagedKVCache(100, 16, 2, 128, dtype=dt, device="cuda", max_seqs=2) if paged
             else ContiguousKVCache(2, 1500, 2, 128, dtype=dt, device="cuda"))
    outs = []
    for a, b in ((0, 700), (700, 701), (701, 1499), (1499, 1500)):
        outs.append(cached_attention(q[a:b].cuda(), k[a:b].cuda(), v[a:b].cuda(), cache, [1],
                                     torch.tensor([0, b - a], device="cuda")).cpu())
    out = torch.cat(outs)
    ref = varlen_attention_f64(q, k, v, cu)
    tol = contracts.tolerance(OPS[1], dt)
    assert out.dtype == dt and tol.check(out, ref), tol.max_violation(out, ref)


# --------------------------------------------------------------------------- GPU: packing (row) invariance


@st.composite
def packing_case(draw, max_len=300):
    n = draw(st.integers(1, 5))
    lens = draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    if sum(lens) == 0:
        lens[0] = 1
    orders = [
        [draw(st.integers(0, n - 1))],
        draw(st.permutations(range(n))),
        draw(st.permutations(range(n)))[: draw(st.integers(1, n))],
    ]
    return dict(lens=lens, orders=orders, hkv=draw(st.sampled_from([1, 2])), g=draw(st.sampled_from([1, 4])),
                d=draw(st.sampled_from([32, 64, 128, 256])), window=draw(st.one_of(st.none(), st.integers(1, 130))),
                seed=draw(st.integers(0, 2**31 - 1)))


# bf16 (the speed path) runs hypothesis examples; fp32 (IEEE products by FMA: every new shape,
# head dim or window specialisation recompiles slow kernels) runs fixed cases with the same
# checkers and the same coverage: empty and 1-token sequences, GQA, windows, head dims 32/64/128
# (fp32 at D = 256: test_accuracy_forward_and_grads and the shipped-configuration test),
# KV split crossings (long contexts, below), paged page sizes 16/64/256, chunked and decode runs.
PACKING_EXAMPLES = 40
ROLLOUT_EXAMPLES = 30
FP32_PACKING_CASES = [
    dict(lens=[1, 130, 64, 0, 77], orders=[[2], [4, 1, 0, 3, 2], [3, 1]], hkv=2, g=4, d=64, window=None, seed=1),
    dict(lens=[150, 3, 65], orders=[[0], [2, 1, 0], [1, 2]], hkv=1, g=1, d=32, window=50, seed=2),
    dict(lens=[70, 129], orders=[[1], [1, 0], [0]], hkv=2, g=1, d=128, window=None, seed=3),
]
FP32_ROLLOUT_CASES = [  # + the draws of the hypothesis version: slots, page size, decode rows, chunk bound
    dict(hkv=2, g=4, d=64, lens=[150, 1, 70], window=None, scale=None, seed=5, slots=[3, 0, 4], block=16,
         n_dec=[4, 1, 2], max_chunk=17),
    dict(hkv=1, g=1, d=32, lens=[200, 33], window=40, scale=0.2, seed=6, slots=[1, 2], block=64, n_dec=[3, 0],
         max_chunk=64),
    dict(hkv=1, g=4, d=32, lens=[90], window=None, scale=0.1, seed=7, slots=[2], block=256, n_dec=[2],
         max_chunk=2),  # fp32 at D = 128 on these paths: test_long_contexts_across_kv_splits
]


def _packing_case(dtype, case):
    q, k, v, cu = make_qkv(case["lens"], case["hkv"], case["g"], case["d"], dtype, seed=case["seed"])
    rep = check_packing_invariance(gpu_train(window=case["window"]), q, k, v, cu, case["orders"], grads=True)
    assert rep.ok, str(rep)


@gpu
def test_packing_invariance_forward_and_grads_hypothesis():
    """bf16: a sequence's output and dq/dk/dv do not depend on what is packed beside it, or where."""

    @settings(max_examples=PACKING_EXAMPLES)
    @given(case=packing_case(max_len=300))
    def check(case):
        _packing_case("bfloat16", case)

    check()


@gpu
@pytest.mark.parametrize("case", FP32_PACKING_CASES, ids=["gqa4-empty-d64", "window50-d32", "d128"])
def test_packing_invariance_forward_and_grads_fp32(case):
    """fp32, fixed cases: the same packing checker (forward and grads) as the bf16 hypothesis test."""
    _packing_case("float32", case)


# --------------------------------------------------------------------------- GPU: prefill/decode invariance


@st.composite
def attention_case(draw, max_len=300, max_seqs=3):
    return dict(
        hkv=draw(st.sampled_from([1, 2])),
        g=draw(st.sampled_from([1, 4])),
        d=draw(st.sampled_from([32, 64, 128, 256])),
        lens=draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_seqs)),
        window=draw(st.one_of(st.none(), st.none(), st.integers(1, 160))),
        scale=draw(st.one_of(st.none(), st.floats(0.03, 0.4))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@gpu
def test_prefill_decode_full_chunked_decode_hypothesis():
    """bf16: full prefill (contiguous cache, permuted slots, stale data), random chunks in random
    batches (paged, page size 16/64/256, fragmented stale pool), prefill then decode steps, and
    decode-heavy continuous batching: every row equals the train path's."""

    @settings(max_examples=ROLLOUT_EXAMPLES)
    @given(case=attention_case(max_len=300), data=st.data())
    def check(case, data):
        lens = case["lens"]
        _prefill_decode_case("bfloat16", case, slots=data.draw(st.permutations(range(len(lens) + 2)))[: len(lens)],
                             block=data.draw(st.sampled_from([16, 64, 256])),
                             n_dec=[data.draw(st.integers(0, min(4, n))) for n in lens],
                             max_chunk=data.draw(st.sampled_from([2, 17, 64, 200])))

    check()


@gpu
@pytest.mark.parametrize("case", FP32_ROLLOUT_CASES,
                         ids=["gqa4-paged16", "window40-paged64", "gqa4-paged256-chunk2"])
def test_prefill_decode_full_chunked_decode_fp32(case):
    """fp32, fixed cases: the runs and checker of the bf16 hypothesis test."""
    _prefill_decode_case("float32", case, **{k: case[k] for k in ("slots", "block", "n_dec", "max_chunk")})


def _prefill_decode_case(dtype, case, *, slots, block, n_dec, max_chunk):
    lens = case["lens"]
    q, k, v, cu = make_qkv(lens, case["hkv"], case["g"], case["d"], dtype, case["seed"])
    rng = random.Random(case["seed"])
    kw = dict(scale=case["scale"], window=case["window"])
    runs = [
        ("full prefill, contiguous", gpu_rollout(contiguous_cache(stale=True), slots=slots, **kw),
         full_prefill_schedule(lens)),
        (f"random chunks, paged block {block}", gpu_rollout(paged_cache(block), **kw),
         random_schedule(lens, rng, max_chunk=max_chunk)),
        ("prefill then decode, paged block 16", gpu_rollout(paged_cache(16, fragment=False), **kw),
         decode_schedule(lens, [n - r for n, r in zip(lens, n_dec)])),
        ("continuous batching, paged block 64", gpu_rollout(paged_cache(64), **kw),
         random_schedule(lens, rng, max_chunk=8, max_steps=10)),
    ]
    rep = check_prefill_decode_invariance(gpu_train(**kw), runs, q, k, v, cu)
    assert rep.ok, str(rep)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [16, 64, 256])
@pytest.mark.parametrize(
    "lens,window",
    [([1025, 3], None), ([2085, 1], None), ([3000, 40], 1500)],
    ids=["1024+1", "2048+37", "3000-window1500"],
)
def test_long_contexts_across_kv_splits(dtype, block, lens, window):
    """Sequences longer than one KV split: full prefill, several chunkings (paged, shuffled
    pages) and decode steps through the split-parallel kernel all give the train path's rows."""
    q, k, v, cu = make_qkv(lens, 2, 4, 128, dtype, seed=sum(lens) + block)
    kw = dict(window=window)
    runs = [
        ("full prefill, contiguous", gpu_rollout(contiguous_cache(stale=True), **kw), full_prefill_schedule(lens)),
        ("chunks n/3,1,1023,64,5, paged", gpu_rollout(paged_cache(block), **kw),
         chunked_schedule([split(n, [n // 3, 1, 1023, 64, 5]) for n in lens])),
        ("chunks 1000,24,1,..., paged", gpu_rollout(paged_cache(block), **kw),
         chunked_schedule([split(n, [1000, 24, 1, 511, 513]) for n in lens])),
        ("decode last 40, paged", gpu_rollout(paged_cache(block, fragment=False), **kw),
         decode_schedule(lens, [max(n - 40, 0) for n in lens])),
    ]
    rep = check_prefill_decode_invariance(gpu_train(**kw), runs, q, k, v, cu)
    assert rep.ok, str(rep)
    assert rep.cases == 8


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_zero_values_do_not_depend_on_masked_slots(dtype):
    lens = [150, 70]
    q, k, v, cu = make_qkv(lens, 1, 4, 64, dtype, seed=21)
    v = torch.full_like(v, -0.0)
    runs = [
        ("full prefill, stale contiguous", gpu_rollout(contiguous_cache(stale=True)), full_prefill_schedule(lens)),
        ("decode, stale paged", gpu_rollout(paged_cache(16)), decode_schedule(lens, [n - 5 for n in lens])),
        ("chunks", gpu_rollout(contiguous_cache(stale=True)), chunked_schedule([[1, 63, 2, 84], [7, 63]])),
    ]
    rep = check_prefill_decode_invariance(gpu_train(), runs, q, k, v, cu)
    assert rep.ok, str(rep)


# --------------------------------------------------------------------------- GPU: negative controls


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_sdpa_prefill_vs_decode_is_caught(dtype):
    """PyTorch SDPA on the GPU: causal prefill rows differ from chunked/decode rows of the same
    tokens; the same checker and data pass the Triton implementation."""
    lens = [300, 777, 129]
    q, k, v, cu = make_qkv(lens, 2, 4, 128, dtype, seed=11)
    sched = decode_schedule(lens, [n - 8 for n in lens])
    chunks = chunked_schedule([split(n, [64, 100]) for n in lens])
    bad = check_prefill_decode_invariance(
        cpu_io(sdpa_train()),
        [("sdpa decode", lambda q_, k_, v_, cu_, s: sdpa_rollout()(q_.cuda(), k_.cuda(), v_.cuda(), cu_, s), sched),
         ("sdpa chunked", lambda q_, k_, v_, cu_, s: sdpa_rollout()(q_.cuda(), k_.cuda(), v_.cuda(), cu_, s), chunks)],
        q, k, v, cu)
    assert not bad.ok, "SDPA prefill-vs-decode was not caught"
    good = check_prefill_decode_invariance(gpu_train(), [("rlk decode", gpu_rollout(), sched),
                                                         ("rlk chunked", gpu_rollout(paged_cache(16)), chunks)],
                                           q, k, v, cu)
    assert good.ok, str(good)
    assert good.cases == 6


@gpu
def test_negative_control_config_dependent_rows_are_caught():
    """A planted path whose rows depend on the batch: packs of several sequences run with bf16
    operands (another product over D), a sequence alone in fp32. The packing checker must catch
    it; the shipped kernels pass the same checker and data."""
    from rl_engine.backends.triton.attention import launch as L

    q, k, v, cu = make_qkv([200, 70, 129], 2, 4, 64, "float32", seed=12)

    def planted(q_, k_, v_, cu_):
        q_, k_, v_, cu_ = q_.detach().cuda(), k_.detach().cuda(), v_.detach().cuda(), cu_.cuda()
        if cu_.shape[0] > 2:  # several sequences: bf16 operands (a different product over D)
            out, _, _ = L.varlen_forward(q_.bfloat16(), k_.bfloat16(), v_.bfloat16(), cu_, 64**-0.5, None)
            return out.float().cpu()
        return L.varlen_forward(q_, k_, v_, cu_, 64**-0.5, None)[0].cpu()

    orders = [[1], [2, 0], [0, 2, 1]]
    assert not check_packing_invariance(planted, q, k, v, cu, orders).ok
    assert check_packing_invariance(gpu_train(), q, k, v, cu, orders, grads=True).ok


# --------------------------------------------------------------------------- GPU: determinism and performance


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism_forward_and_grads(dtype):
    q, k, v, cu = make_qkv([1500, 1, 260], 2, 4, 128 if dtype == "bfloat16" else 64, dtype, seed=9)
    rep = check_run_to_run(lambda q_, k_, v_: gpu_train(window=1100)(q_, k_, v_, cu), [q, k, v], runs=3, grads=True)
    assert rep.ok, str(rep)
    assert rep.cases == 8
    roll = gpu_rollout(paged_cache(16))
    sched = decode_schedule([1500, 1, 260], [1490, 0, 250])
    a, b = roll(q, k, v, cu, sched), roll(q, k, v, cu, sched)
    assert same_bits(a, b)


@gpu
def test_bounded_performance_vs_sdpa():
    """Prefill forward, bf16, Qwen3-8B heads (32 q / 8 kv, D = 128), 4 × 4096 tokens: within 4×
    of SDPA (causal, GQA) time in the same run (CUDA graphs). A regression guard, not the
    target: this is the training forward (fp32 output and lse stored too), measured 1.37× and
    1.33× SDPA's time on the H200 (``bounded_perf_attention`` evidence); the throughput target
    (≥ 0.9× SDPA) is tracked by benchmarks/operators/bench_attention_gpu.py
    (reports/gpu/h200/attention.json)."""
    import torch.nn.functional as F

    from rl_engine.backends.triton.attention import launch as L

    B, S, Hq, Hkv, D = 4, 4096, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B * S, Hq, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(B * S, Hkv, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(B * S, Hkv, D, device="cuda", generator=g).bfloat16()
    cu = torch.arange(0, B * S + 1, S, device="cuda")
    qs, ks, vs = (t.view(B, S, -1, D).transpose(1, 2).contiguous() for t in (q, k, v))
    ours = graph_us(lambda: L.varlen_forward(q, k, v, cu, D**-0.5, None))
    theirs = graph_us(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
    evidence("bounded_perf_attention", {"shape": [B, S, Hq, Hkv, D], "ours_us": ours, "sdpa_us": theirs})
    assert ours <= 4.0 * theirs, f"{ours:.1f} us vs SDPA {theirs:.1f} us"
