"""Attention entry points on inputs the contract cannot honour: NaN/inf keys written to a cache,
two sequences sharing a block they write, finite inputs whose scores overflow, float offsets.
Each ends in an error naming the argument, and a rejected call leaves the cache as it was."""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops.attention import (
    ContiguousKVCache,
    PagedKVCache,
    cached_attention,
    paged_attention,
    varlen_attention,
)
from rl_engine.utils.checks import nan_policy


def _caches():
    return [ContiguousKVCache(2, 8, 2, 8), PagedKVCache(8, 4, 2, 8, max_seqs=2)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("which", ["k", "v"])
def test_extend_rejects_non_finite_keys_and_values(bad, which):
    for cache in _caches():
        cache.extend(0, torch.ones(2, 2, 8), torch.ones(2, 2, 8))
        before = cache.snapshot()
        k, v = torch.ones(3, 2, 8), torch.ones(3, 2, 8)
        (k if which == "k" else v)[1, 0, 3] = bad
        with pytest.raises(ValueError, match=f"^{which}: contains (NaN|inf)"):
            cache.extend(0, k, v)
        assert cache.snapshot() == before and cache.seq_len(0) == 2


def test_extend_propagate_policy_scans_nothing():
    cache = ContiguousKVCache(1, 4, 1, 2)
    with nan_policy("propagate"):
        cache.extend(0, torch.full((1, 1, 2), float("nan")), torch.zeros(1, 1, 2))
    assert cache.seq_len(0) == 1


def _paged_args(block_table, seq_lens, cu, slots, num_blocks=4, bs=2, T=None):
    T = cu[-1] if T is None else T
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, 2, 4, generator=g)
    k = torch.randn(T, 1, 4, generator=g)
    v = torch.randn(T, 1, 4, generator=g)
    kc = torch.zeros(num_blocks, bs, 1, 4)
    vc = torch.zeros(num_blocks, bs, 1, 4)
    return (q, k, v, kc, vc, torch.tensor(slots), torch.tensor(block_table), bs, torch.tensor(cu), torch.tensor(seq_lens))


def test_paged_attention_rejects_two_sequences_writing_one_block():
    # both sequences own block 1 and write their first token into it: rows would mix
    args = _paged_args([[1], [1]], [1, 1], [0, 1, 2], [2, 3])
    with pytest.raises(ValueError, match="^block_table: block 1 is written by this step"):
        paged_attention(*args)


def test_paged_attention_rejects_a_block_at_two_positions():
    # sequence 0 lists block 2 for positions 0-1 and 2-3
    args = _paged_args([[2, 2]], [4], [0, 4], [4, 5, 4, 5])
    with pytest.raises(ValueError, match="^block_table: block 2 holds block index 0 of sequence 0 and block index 1"):
        paged_attention(*args)
    # block 3 is sequence 0's first block and sequence 1's second block
    args = _paged_args([[3, 0], [1, 3]], [2, 4], [0, 1, 2], [7, 7])
    with pytest.raises(ValueError, match="^block_table: block 3 holds block index"):
        paged_attention(*args)


def test_paged_attention_accepts_a_shared_prefix_block_nobody_writes():
    """Prefix caching: two sequences read the same full block 0 (positions 0-1) and write their
    own third token; each output equals varlen attention over its own sequence."""
    g = torch.Generator().manual_seed(1)
    prefix_k, prefix_v = torch.randn(2, 1, 4, generator=g), torch.randn(2, 1, 4, generator=g)
    kc, vc = torch.zeros(4, 2, 1, 4), torch.zeros(4, 2, 1, 4)
    kc[0], vc[0] = prefix_k, prefix_v
    q, k, v = torch.randn(2, 2, 4, generator=g), torch.randn(2, 1, 4, generator=g), torch.randn(2, 1, 4, generator=g)
    out = paged_attention(q, k, v, kc, vc, torch.tensor([2, 6]), torch.tensor([[0, 1], [0, 3]]), 2,
                          torch.tensor([0, 1, 2]), torch.tensor([3, 3]))
    for i in range(2):
        kk = torch.cat([prefix_k, k[i : i + 1]])
        vv = torch.cat([prefix_v, v[i : i + 1]])
        qq = torch.cat([torch.zeros(2, 2, 4), q[i : i + 1]])
        ref = varlen_attention(qq, kk, vv, torch.tensor([0, 3]))
        assert torch.equal(out[i], ref[2])


def test_varlen_attention_overflow_from_finite_inputs_raises_instead_of_nan():
    q = torch.full((4, 2, 8), 1e20)
    k = torch.full((4, 2, 8), 1e20)
    v = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="^q: the attention output of 4 row"):
        varlen_attention(q, k, v, torch.tensor([0, 4], dtype=torch.int32))
    small = varlen_attention(q * 1e-20, k * 1e-20, v, torch.tensor([0, 4], dtype=torch.int32))
    assert bool(torch.isfinite(small).all())


@pytest.mark.parametrize("make", [lambda: ContiguousKVCache(1, 8, 2, 8), lambda: PagedKVCache(4, 4, 2, 8, max_seqs=1)])
def test_cached_attention_overflow_raises_and_leaves_the_cache_unchanged(make):
    cache = make()
    cache.extend(0, torch.ones(2, 2, 8), torch.ones(2, 2, 8))
    before = cache.snapshot()
    big = torch.full((1, 2, 8), 1e20)
    with pytest.raises(ValueError, match="^q: the attention output"):
        cached_attention(big, big.clone(), torch.ones(1, 2, 8), cache, [0], torch.tensor([0, 1]))
    assert cache.snapshot() == before and cache.seq_len(0) == 2


def test_list_cu_seqlens_must_hold_ints():
    cache = ContiguousKVCache(1, 8, 2, 8)
    x = torch.ones(2, 2, 8)
    with pytest.raises(TypeError, match="^cu_seqlens_q: expected an int32/int64 tensor or a list of ints"):
        cached_attention(x, x, x, cache, [0], [0, 2.0])
    assert cache.seq_len(0) == 0
    with pytest.raises(ValueError, match="^cu_seqlens: expected dtype in"):
        varlen_attention(x, x, x, torch.tensor([0.0, 2.0]))
