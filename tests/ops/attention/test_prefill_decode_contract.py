"""The attention contract: a query's output row is raw-bit equal on the train path
(``varlen_attention``) and on the rollout path (``cached_attention``) under full prefill,
chunked prefill, decode in any batch, with contiguous and paged caches of any block size —
randomized (hypothesis, ≥ 300 cases per dtype), plus long sequences that cross KV splits, and
the SDPA negative control run through the same checker."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine.ops.attention import ContiguousKVCache, PagedKVCache, cached_attention
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common.attention import (
    check_prefill_decode_invariance,
    chunked_schedule,
    decode_schedule,
    full_prefill_schedule,
    random_schedule,
    rlk_rollout,
    rlk_train,
    sdpa_rollout,
    sdpa_train,
)
from tests.helpers.strategies import DTYPES

GARBAGE = 3.0e4  # stale cache content: large, so any leak into a visible row would show


def make_qkv(lens, hkv, g, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    dt = getattr(torch, dtype)
    q = (torch.randn(T, hkv * g, d, generator=gen) * 1.5).to(dt)
    k = torch.randn(T, hkv, d, generator=gen).to(dt)
    v = torch.randn(T, hkv, d, generator=gen).to(dt)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def contiguous_factory(stale: bool):
    def make(hkv, d, dtype, max_len, num_seqs):
        cache = ContiguousKVCache(num_seqs, max_len, hkv, d, dtype=dtype)
        if stale:  # unused slots and positions hold garbage, as after earlier sequences
            cache.k.uniform_(-GARBAGE, GARBAGE)
            cache.v.uniform_(-GARBAGE, GARBAGE)
        return cache

    return make


def paged_factory(block_size: int, fragment: bool):
    """A paged pool whose pages are handed out out of order and hold stale data: two filler
    sequences are written interleaved, then one is freed, leaving holes among used pages."""

    def make(hkv, d, dtype, max_len, num_seqs):
        per_seq = -(-max_len // block_size)
        filler = 3 if fragment else 0
        cache = PagedKVCache(num_seqs * per_seq + 2 * filler, block_size, hkv, d, dtype=dtype,
                             max_seqs=num_seqs + 2, max_blocks_per_seq=max(per_seq, filler))
        gen = torch.Generator().manual_seed(block_size)
        for _ in range(filler):
            for slot in (num_seqs, num_seqs + 1):
                x = ((torch.rand(block_size, hkv, d, generator=gen) * 2 - 1) * GARBAGE).to(dtype)
                cached_attention(x, x, x, cache, [slot], torch.tensor([0, block_size]))
        if filler:
            cache.free(num_seqs)
        return cache

    return make


@st.composite
def attention_case(draw, max_len=300, max_seqs=3):
    return dict(
        hkv=draw(st.sampled_from([1, 2])),
        g=draw(st.sampled_from([1, 2, 4])),
        d=draw(st.sampled_from([32, 64, 128])),
        lens=draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_seqs)),
        window=draw(st.one_of(st.none(), st.none(), st.integers(1, 160))),
        scale=draw(st.one_of(st.none(), st.floats(0.03, 0.4))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(case=attention_case(), data=st.data())
def test_contract_full_chunked_decode(dtype, case, data):
    """Full prefill (contiguous cache, permuted slots, stale data), chunked prefill with random
    chunks in random batches (paged, random block size, fragmented pool) and a prefill followed
    by decode steps: every row equals the train path's."""
    lens = case["lens"]
    q, k, v, cu = make_qkv(lens, case["hkv"], case["g"], case["d"], dtype, case["seed"])
    rng = random.Random(case["seed"])
    kw = dict(scale=case["scale"], window=case["window"])
    slots = data.draw(st.permutations(range(len(lens) + 2)))[: len(lens)]
    block = data.draw(st.sampled_from([1, 3, 16, 64, 100]))
    n_dec = [data.draw(st.integers(0, min(4, n))) for n in lens]
    runs = [
        ("full prefill, contiguous", rlk_rollout(contiguous_factory(stale=True), slots=slots, **kw),
         full_prefill_schedule(lens)),
        (f"random chunks, paged block {block}", rlk_rollout(paged_factory(block, fragment=True), **kw),
         random_schedule(lens, rng, max_chunk=data.draw(st.sampled_from([2, 17, 64, 200])))),
        ("prefill then decode, paged block 16", rlk_rollout(paged_factory(16, fragment=False), **kw),
         decode_schedule(lens, [n - r for n, r in zip(lens, n_dec)])),
    ]
    rep = check_prefill_decode_invariance(rlk_train(**kw), runs, q, k, v, cu)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=100)
@given(case=attention_case(max_seqs=5), data=st.data())
def test_contract_continuous_batching(dtype, case, data):
    """Decode-heavy continuous batching: many small steps (chunks of 1..8) over up to five
    sequences, each step a random subset in random order, contiguous or paged."""
    lens = case["lens"]
    q, k, v, cu = make_qkv(lens, case["hkv"], case["g"], case["d"], dtype, case["seed"])
    rng = random.Random(case["seed"] ^ 0x5EED)
    kw = dict(scale=case["scale"], window=case["window"])
    paged = data.draw(st.booleans())
    factory = paged_factory(data.draw(st.sampled_from([2, 7, 32])), fragment=True) if paged else contiguous_factory(True)
    sched = random_schedule(lens, rng, max_chunk=8, max_steps=data.draw(st.integers(3, 16)))
    # a prompt chunk first for some sequences, then the random steps continue the rest
    runs = [("continuous batching", rlk_rollout(factory, **kw), sched)]
    rep = check_prefill_decode_invariance(rlk_train(**kw), runs, q, k, v, cu)
    assert rep.ok, str(rep)


def split(n, sizes):
    """Chunks of ``sizes`` (as far as they fit) and the remainder: they sum to ``n``."""
    out = []
    for c in sizes:
        if 0 < c <= n - sum(out):
            out.append(c)
    rest = n - sum(out)
    return out + ([rest] if rest else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lens,window,block",
    [([2100, 37], None, 64), ([1500], 700, 48), ([1100, 1030], 1025, 16)],
    ids=["two-splits", "window-700", "window-1025"],
)
def test_contract_across_kv_splits(dtype, lens, window, block):
    """Sequences longer than one KV split (1024 keys): the split merge happens on every path."""
    q, k, v, cu = make_qkv(lens, 1, 2, 32, dtype, seed=sum(lens))
    kw = dict(window=window)
    chunks = [split(n, [n // 3, 1, 1023, 64, 5]) for n in lens]
    runs = [
        ("full prefill", rlk_rollout(**kw), full_prefill_schedule(lens)),
        ("chunked, paged", rlk_rollout(paged_factory(block, fragment=True), **kw), chunked_schedule(chunks)),
        ("decode last 3", rlk_rollout(paged_factory(block, fragment=False), **kw), decode_schedule(lens, [n - 3 for n in lens])),
    ]
    rep = check_prefill_decode_invariance(rlk_train(**kw), runs, q, k, v, cu)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_sdpa_prefill_vs_decode_is_caught(dtype):
    """PyTorch SDPA: causal prefill rows differ from chunked/decode rows of the same tokens; the
    same checker that passes rl-kernel attention must report it."""
    lens = [300, 777, 129]
    q, k, v, cu = make_qkv(lens, 2, 2, 64, dtype, seed=11)
    sched = decode_schedule(lens, [n - 8 for n in lens])
    chunks = chunked_schedule([split(n, [64, 100]) for n in lens])
    bad = check_prefill_decode_invariance(sdpa_train(), [("sdpa decode", sdpa_rollout(), sched),
                                                         ("sdpa chunked", sdpa_rollout(), chunks)], q, k, v, cu)
    assert not bad.ok, "SDPA prefill-vs-decode was not caught"
    assert any("sdpa decode" in f for f in bad.failures), bad.failures
    good = check_prefill_decode_invariance(rlk_train(), [("rlk decode", rlk_rollout(), sched),
                                                         ("rlk chunked", rlk_rollout(), chunks)], q, k, v, cu)
    assert good.ok, str(good)
    assert good.cases == 6


def test_checker_reports_the_failing_positions():
    """A deliberately wrong rollout (one row perturbed by one ulp) is reported with its position."""
    lens = [40, 70]
    q, k, v, cu = make_qkv(lens, 1, 1, 32, "float32", seed=2)
    inner = rlk_rollout()

    def off_by_one_ulp(q_, k_, v_, cu_, sched):
        out = inner(q_, k_, v_, cu_, sched)
        out[40 + 65] = torch.nextafter(out[40 + 65], torch.full_like(out[40 + 65], float("inf")))
        return out

    rep = check_prefill_decode_invariance(rlk_train(), [("perturbed", off_by_one_ulp, full_prefill_schedule(lens))],
                                          q, k, v, cu)
    assert not rep.ok and len(rep.failures) == 1
    assert "sequence 1, positions [65]" in rep.failures[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_zero_values_do_not_depend_on_masked_slots(dtype):
    """All values -0.0: the visible terms of P·V are -0.0, the masked ones 0·(whatever sits in the
    slot: a future token, or stale cache data of either sign). The output must still be the same
    bits on every path (the backend canonicalises a zero sum to +0.0)."""
    lens = [150, 70]
    q, k, v, cu = make_qkv(lens, 1, 2, 32, dtype, seed=21)
    v = torch.full_like(v, -0.0)
    runs = [
        ("full prefill, stale contiguous", rlk_rollout(contiguous_factory(stale=True)), full_prefill_schedule(lens)),
        ("decode, stale paged", rlk_rollout(paged_factory(16, fragment=True)), decode_schedule(lens, [n - 5 for n in lens])),
        ("chunks", rlk_rollout(contiguous_factory(stale=True)), chunked_schedule([[1, 63, 2, 84], [7, 63]])),
    ]
    rep = check_prefill_decode_invariance(rlk_train(), runs, q, k, v, cu)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_do_not_depend_on_the_thread_count(dtype):
    """Trainer and rollout engine may run with different intra-op thread counts: the train path
    under 1 and 4 threads and the rollout path under 2 threads give the same bits."""
    from tests.helpers.threads import threads

    lens = [700, 65, 1]
    q, k, v, cu = make_qkv(lens, 2, 2, 64, dtype, seed=31)
    with threads(1):
        one = rlk_train(window=300)(q, k, v, cu)
    with threads(4):
        four = rlk_train(window=300)(q, k, v, cu)
    assert same_bits(one, four)
    with threads(2):
        rep = check_prefill_decode_invariance(
            lambda *a: one, [("decode", rlk_rollout(paged_factory(16, fragment=True), window=300),
                              decode_schedule(lens, [max(n - 2, 0) for n in lens]))], q, k, v, cu)
    assert rep.ok, str(rep)
