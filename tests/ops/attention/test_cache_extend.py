"""``KVCache.extend``: write-only appends (no attention) that ``cached_attention`` then reads."""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops.attention import ContiguousKVCache, PagedKVCache, cached_attention, varlen_attention
from rl_engine.utils.bits import same_bits


def _caches(dt):
    return [ContiguousKVCache(2, 16, 2, 8, dtype=dt), PagedKVCache(8, 4, 2, 8, dtype=dt, max_seqs=2)]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_extend_then_decode_equals_varlen(dt):
    g = torch.Generator().manual_seed(0)
    n = 11
    q = torch.randn(n, 4, 8, generator=g).to(dt)
    k = torch.randn(n, 2, 8, generator=g).to(dt)
    v = torch.randn(n, 2, 8, generator=g).to(dt)
    full = varlen_attention(q, k, v, torch.tensor([0, n]))
    for cache in _caches(dt):
        cache.extend(1, k[:4].contiguous(), v[:4].contiguous())
        cache.extend(1, k[4 : n - 1].contiguous(), v[4 : n - 1].contiguous())
        assert cache.seq_len(1) == n - 1 and cache.seq_len(0) == 0
        out = cached_attention(q[n - 1 :], k[n - 1 :], v[n - 1 :], cache, [1], torch.tensor([0, 1]))
        assert same_bits(out[0], full[n - 1]).equal, type(cache).__name__


def test_extend_rejects_bad_input_and_leaves_cache_unchanged():
    cache = ContiguousKVCache(1, 4, 2, 8)
    k = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="k: expected \\[n, 2, 8\\]"):
        cache.extend(0, torch.zeros(3, 1, 8), torch.zeros(3, 1, 8))
    with pytest.raises(ValueError, match="v: expected shape"):
        cache.extend(0, k, torch.zeros(2, 2, 8))
    with pytest.raises(ValueError, match="k: expected dtype|k: expected one of|k:"):
        cache.extend(0, k.bfloat16(), k.bfloat16())
    with pytest.raises(ValueError, match="seq_id"):
        cache.extend(3, k, k)
    cache.extend(0, k, k)
    with pytest.raises(ValueError, match="cache: slot 0 holds 3 tokens"):
        cache.extend(0, k, k)
    assert cache.seq_len(0) == 3
