"""attention.cached_attention (rollout path) and the KV caches: accuracy vs float64, cache
bookkeeping (lengths, free, block tables, reuse of freed slots and pages), atomic overflow
errors, dispatch, no autograd, and bad input; one plan per step over per-layer caches
(plan_cached_attention / cached_attention_step)."""

from __future__ import annotations

import pytest
import torch

from rl_engine import contracts
from rl_engine.ops.attention import (
    ContiguousKVCache,
    PagedKVCache,
    cached_attention,
    cached_attention_step,
    plan_cached_attention,
    varlen_attention,
)
from rl_engine.reference.attention import varlen_attention_f64
from rl_engine.runtime import provenance, use_policy
from rl_engine.utils.bits import same_bits
from tests.helpers.strategies import DTYPES

OP = "attention.cached_attention"


def qkv(n, hkv=2, g=2, d=32, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, hkv * g, d, generator=gen).to(dtype),
        torch.randn(n, hkv, d, generator=gen).to(dtype),
        torch.randn(n, hkv, d, generator=gen).to(dtype),
    )


def cu(*lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_accuracy_chunked_prefill_and_decode(dtype, paged):
    dt = getattr(torch, dtype)
    q, k, v = qkv(150, dtype=dt, seed=1)
    cache = (PagedKVCache(20, 16, 2, 32, dtype=dt, max_seqs=2) if paged else ContiguousKVCache(2, 150, 2, 32, dtype=dt))
    outs = []
    for a, b in ((0, 70), (70, 71), (71, 149), (149, 150)):
        outs.append(cached_attention(q[a:b], k[a:b], v[a:b], cache, [1], cu(b - a)))
    out = torch.cat(outs)
    ref = varlen_attention_f64(q, k, v, cu(150))
    tol = contracts.tolerance(OP, dt)
    assert out.dtype == dt and tol.check(out, ref), tol.max_violation(out, ref)
    assert cache.seq_len(1) == 150 and cache.seq_len(0) == 0


def test_cache_bookkeeping_contiguous():
    c = ContiguousKVCache(3, 10, 1, 32)
    q, k, v = qkv(10, hkv=1, g=1)
    cached_attention(q[:4], k[:4], v[:4], c, [2, 0], cu(3, 1))
    assert [c.seq_len(i) for i in range(3)] == [1, 0, 3]
    assert torch.equal(c.k[2, :3], k[:3]) and torch.equal(c.v[0, 0], v[3])
    c.free(2)
    assert c.seq_len(2) == 0
    with pytest.raises(ValueError, match="^seq_id: expected a slot in"):
        c.seq_len(3)


def test_paged_cache_allocates_and_returns_blocks():
    c = PagedKVCache(6, 4, 1, 32, max_seqs=3, max_blocks_per_seq=3)
    q, k, v = qkv(12, hkv=1, g=1)
    cached_attention(q[:9], k[:9], v[:9], c, [0, 1], cu(5, 4))  # 2 blocks + 1 block
    assert c.block_table(0) == [0, 1] and c.block_table(1) == [2] and c.num_free_blocks == 3
    cached_attention(q[9:10], k[9:10], v[9:10], c, [1], cu(1))  # position 4: a new block
    assert c.block_table(1) == [2, 3]
    assert torch.equal(c.k[3, 0], k[9])
    c.free(0)
    assert c.num_free_blocks == 4 and c.block_table(0) == [] and c.seq_len(0) == 0


def test_freed_slot_and_pages_are_reused_without_leaking_stale_data():
    """A sequence placed in a freed slot on top of another sequence's pages gets the same bits as
    in a fresh cache."""
    q, k, v = qkv(100, seed=3)
    junk = qkv(100, seed=4)
    fresh = cached_attention(q, k, v, PagedKVCache(10, 16, 2, 32, max_seqs=2), [0], cu(100))
    c = PagedKVCache(10, 16, 2, 32, max_seqs=2)
    cached_attention(*(t * 1000 for t in junk), c, [1], cu(100))
    c.free(1)
    reused = cached_attention(q, k, v, c, [1], cu(100))
    assert same_bits(reused, fresh)
    assert c.block_table(1) == [7, 8, 9, 0, 1, 2, 3]  # never-used pages first, then the stale ones


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_overflow_raises_and_leaves_the_cache_unchanged(paged):
    c = PagedKVCache(3, 4, 1, 32, max_seqs=2, max_blocks_per_seq=2) if paged else ContiguousKVCache(2, 8, 1, 32)
    q, k, v = qkv(12, hkv=1, g=1)
    cached_attention(q[:6], k[:6], v[:6], c, [0], cu(6))
    before = (c.k.clone(), c.seq_len(0), c.seq_len(1))
    with pytest.raises(ValueError, match="^cache: slot 0 holds 6 tokens; appending 3"):
        cached_attention(q[6:10], k[6:10], v[6:10], c, [1, 0], cu(1, 3))
    assert torch.equal(c.k, before[0]) and (c.seq_len(0), c.seq_len(1)) == before[1:]
    if paged:
        with pytest.raises(ValueError, match="^cache: out of blocks"):
            cached_attention(q[:6], k[:6], v[:6], c, [1], cu(6))
        assert c.num_free_blocks == 1


def test_zero_token_entries_and_tensor_seq_ids():
    c = ContiguousKVCache(4, 20, 2, 32)
    q, k, v = qkv(5)
    out = cached_attention(q, k, v, c, torch.tensor([3, 1], dtype=torch.int32), torch.tensor([0, 0, 5], dtype=torch.int32))
    assert out.shape == q.shape and c.seq_len(3) == 0 and c.seq_len(1) == 5
    empty = cached_attention(q[:0], k[:0], v[:0], c, [], [0])
    assert empty.shape == (0, 4, 32)


def test_rollout_output_has_no_autograd():
    c = ContiguousKVCache(1, 8, 2, 32)
    q, k, v = (t.requires_grad_() for t in qkv(4))
    out = cached_attention(q, k, v, c, [0], cu(4))
    assert not out.requires_grad


def test_dispatch_provenance_and_diagnostic_reference():
    q, k, v = qkv(40, seed=5)
    c1, c2 = ContiguousKVCache(1, 40, 2, 32), ContiguousKVCache(1, 40, 2, 32)
    with provenance.record() as recs:
        ours = cached_attention(q, k, v, c1, [0], cu(40))
    assert recs[-1].op == OP and recs[-1].impl_id == "cpu.blocked_online_softmax"
    from rl_engine.runtime import registry

    with use_policy("diagnostic"):  # the reference takes the same arguments and fills the cache too
        impl = registry.reference_for(OP)
        k_rows, v_rows = c2.rows()
        plan = c2._plan([0], [40])
        pos = torch.arange(40)
        ref = impl(q, k, v, k_rows, v_rows, plan.slot_mapping, plan.page_rows, plan.page_size,
                   torch.zeros(40, dtype=torch.int64), pos, 32**-0.5, None)
    assert torch.equal(c2.k[0], k)
    assert contracts.tolerance(OP, torch.float32).check(ours, ref.double())
    assert same_bits(ours, varlen_attention(q, k, v, cu(40)))


def test_bad_input_messages_name_the_argument():
    c = ContiguousKVCache(2, 16, 2, 32)
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match="^k_new: expected \\[T, 2, 32\\]"):
        cached_attention(q, torch.randn(4, 1, 32), torch.randn(4, 1, 32), c, [0], cu(4))
    with pytest.raises(ValueError, match="^k_new: expected head_dim 32"):
        cached_attention(q, torch.randn(4, 2, 16), torch.randn(4, 2, 16), c, [0], cu(4))
    with pytest.raises(ValueError, match="^v_new: expected shape"):
        cached_attention(q, k, v[:3], c, [0], cu(4))
    with pytest.raises(ValueError, match="^cache: expected dtype torch.bfloat16"):
        cached_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), c, [0], cu(4))
    with pytest.raises(TypeError, match="^cache: expected a ContiguousKVCache or PagedKVCache"):
        cached_attention(q, k, v, object(), [0], cu(4))
    with pytest.raises(ValueError, match="^seq_ids: expected distinct slots"):
        cached_attention(q, k, v, c, [1, 1], cu(2, 2))
    with pytest.raises(ValueError, match="^seq_ids: expected slots in \\[0, 2\\)"):
        cached_attention(q, k, v, c, [2], cu(4))
    with pytest.raises(TypeError, match="^seq_ids: expected ints"):
        cached_attention(q, k, v, c, [0.0], cu(4))
    with pytest.raises(ValueError, match="^cu_seqlens_q: expected 2 entries"):
        cached_attention(q, k, v, c, [0], cu(2, 2))
    with pytest.raises(ValueError, match="^cu_seqlens_q: expected non-decreasing"):
        cached_attention(q, k, v, c, [0, 1], torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="^cu_seqlens_q: expected the last offset"):
        cached_attention(q, k, v, c, [0], torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="^k_new: contains NaN"):
        cached_attention(q, torch.full_like(k, float("nan")), v, c, [0], cu(4))
    with pytest.raises(ValueError, match="device"):
        cached_attention(q, k, v, ContiguousKVCache(2, 16, 2, 32, device="meta"), [0], cu(4))
    with pytest.raises(ValueError, match="^q: expected dtype"):
        cached_attention(q.double(), k, v, c, [0], cu(4))
    assert c.seq_len(0) == 0  # nothing was appended by the rejected calls
    with pytest.raises(ValueError, match="^max_len: expected a positive int"):
        ContiguousKVCache(1, 0, 1, 32)
    with pytest.raises(ValueError, match="^dtype: expected one of"):
        PagedKVCache(4, 4, 1, 32, dtype=torch.float16)
    with pytest.raises(TypeError, match="^block_size: expected an int"):
        PagedKVCache(4, 4.0, 1, 32)


# --------------------------------------------------------------------------- one plan per step


def _layer_caches(paged, n=3, dt=torch.float32):
    if paged:
        return [PagedKVCache(30, 16, 2, 32, dtype=dt, max_seqs=3) for _ in range(n)]
    return [ContiguousKVCache(3, 120, 2, 32, dtype=dt) for _ in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_planned_steps_equal_one_call_per_layer(dtype, paged):
    """Three layers' caches through prefill, a freed and reused slot, and decode steps: one
    ``plan_cached_attention`` per step with ``cached_attention_step`` per layer gives the bits
    of one ``cached_attention`` per layer, and leaves every cache in the same state (lengths,
    block tables, storage)."""
    dt = getattr(torch, dtype)
    planned, called = _layer_caches(paged, dt=dt), _layer_caches(paged, dt=dt)
    steps = [([0, 2], (40, 7)), ([2], (1,)), ([0, 2], (1, 1)), ("free", 0), ([1, 0, 2], (5, 30, 1)), ([0, 1, 2], (1, 1, 1))]
    for n, step in enumerate(steps):
        if step[0] == "free":
            for c in planned + called:
                c.free(step[1])
            continue
        ids, lens = step
        plan = plan_cached_attention(planned, ids, cu(*lens))
        assert plan.decode_only == all(x == 1 for x in lens) and plan.num_tokens == sum(lens)
        for layer in range(3):
            q, k, v = qkv(sum(lens), dtype=dt, seed=10 * n + layer)
            got = cached_attention_step(q, k, v, planned[layer], plan)
            want = cached_attention(q, k, v, called[layer], ids, cu(*lens))
            assert same_bits(got, want), (n, layer)
    for a, b in zip(planned, called):
        assert [a.seq_len(i) for i in range(3)] == [b.seq_len(i) for i in range(3)]
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and a._state == b._state
        if paged:
            assert [a.block_table(i) for i in range(3)] == [b.block_table(i) for i in range(3)]


def test_plan_refuses_caches_that_moved_apart_and_a_second_run():
    """The plan needs every layer's cache in the same state; a cache runs a plan once. Negative
    controls: a cache with one more append, one of another geometry, a step run twice on one
    cache and a plan of one step used on the next all raise, naming the argument."""
    caches = _layer_caches(False)
    q, k, v = qkv(4)
    cached_attention(q, k, v, caches[1], [0], cu(4))  # layer 1 alone moves on
    with pytest.raises(ValueError, match="^caches: cache 1 does not hold the same sequences"):
        plan_cached_attention(caches, [0], cu(4))
    with pytest.raises(ValueError, match="^caches: cache 1 does not hold"):
        plan_cached_attention([ContiguousKVCache(3, 120, 2, 32), ContiguousKVCache(3, 121, 2, 32)], [0], cu(4))
    caches = _layer_caches(True)
    plan = plan_cached_attention(caches, [0, 1], cu(3, 1))
    cached_attention_step(q, k, v, caches[0], plan)
    with pytest.raises(ValueError, match="^cache: it does not carry the state the plan was made for"):
        cached_attention_step(q, k, v, caches[0], plan)
    for c in caches[1:]:
        cached_attention_step(q, k, v, c, plan)
    with pytest.raises(ValueError, match="^cache: it does not carry"):
        cached_attention_step(q, k, v, caches[2], plan)  # the step is done: plan the next one
    nxt = plan_cached_attention(caches, [0, 1], cu(1, 1))
    assert nxt.q_pos.tolist() == [3, 1] and nxt.decode_only


@pytest.mark.parametrize("call, match", [
    (lambda c, q, k, v, p: plan_cached_attention([], [0], cu(4)), "^caches: expected a non-empty"),
    (lambda c, q, k, v, p: plan_cached_attention([c, "x"], [0], cu(4)), "^caches: expected ContiguousKVCache"),
    (lambda c, q, k, v, p: plan_cached_attention([c], [0, 0], cu(2, 2)), "^seq_ids: expected distinct"),
    (lambda c, q, k, v, p: plan_cached_attention([c], [0], cu(2, 2)), "^cu_seqlens_q: expected 2 entries"),
    (lambda c, q, k, v, p: plan_cached_attention([c], [0], cu(500)), "^cache: slot 0 holds 0 tokens"),
    (lambda c, q, k, v, p: cached_attention_step(q, k, v, c, "plan"), "^plan: expected a CachedAttentionPlan"),
    (lambda c, q, k, v, p: cached_attention_step(q[:3], k[:3], v[:3], c, p), r"^q: expected 4 rows \(plan.num_tokens\)"),
    (lambda c, q, k, v, p: cached_attention_step(q, k, v, "cache", p), "^cache: expected a ContiguousKVCache"),
    (lambda c, q, k, v, p: cached_attention_step(q.double(), k, v, c, p), "^q: expected dtype"),
])
def test_plan_and_step_bad_input_names_the_argument(call, match):
    c = ContiguousKVCache(3, 120, 2, 32)
    q, k, v = qkv(4)
    plan = plan_cached_attention([c], [0], cu(4))
    with pytest.raises((TypeError, ValueError), match=match):
        call(c, q, k, v, plan)
    assert c.seq_len(0) == 0  # nothing was committed
