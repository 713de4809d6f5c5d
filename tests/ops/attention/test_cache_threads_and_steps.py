"""KV caches under threads and under failed multi-layer steps.

* Threads: appends from several threads to different slots of one cache are serialised by the
  cache's lock: no page is handed to two sequences and every sequence reads back its own keys.
* A multi-layer rollout step that fails at any layer leaves every layer's cache as it was
  before the step; the same step then runs and gives the bits of a step that never failed.
"""

from __future__ import annotations

import threading

import pytest
import torch

from rl_engine.models.qwen3 import Qwen3ForCausalLM, Qwen3Spec
from rl_engine.ops.attention import ContiguousKVCache, PagedKVCache, cached_attention, plan_cached_attention
from rl_engine.runtime.plan import Plan
from rl_engine.engine import ops_for

N_THREADS, STEPS, BLOCK = 6, 15, 2


def _keys(slot: int, step: int) -> torch.Tensor:
    return torch.full((1, 1, 4), float(slot * 1000 + step))


@pytest.mark.parametrize("api", ["extend", "cached_attention"])
def test_concurrent_appends_to_different_slots_of_a_paged_cache_stay_separate(api):
    cache = PagedKVCache(N_THREADS * STEPS // BLOCK + N_THREADS, BLOCK, 1, 4, max_seqs=N_THREADS)
    start = threading.Barrier(N_THREADS)
    errors: list[BaseException] = []

    def work(slot: int) -> None:
        try:
            start.wait()
            for step in range(STEPS):
                k = _keys(slot, step)
                if api == "extend":
                    cache.extend(slot, k, k.clone())
                else:
                    cached_attention(torch.ones(1, 1, 4), k, k.clone(), cache, [slot], torch.tensor([0, 1]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    tables = [cache.block_table(s) for s in range(N_THREADS)]
    owned = [b for t in tables for b in t]
    assert len(owned) == len(set(owned)), "a block is owned by two sequences"
    k_rows, _ = cache.rows()
    for slot, table in enumerate(tables):
        assert cache.seq_len(slot) == STEPS
        rows = torch.cat([torch.arange(b * BLOCK, b * BLOCK + BLOCK) for b in table])[:STEPS]
        got = k_rows[rows, 0, 0].tolist()
        assert got == [float(slot * 1000 + s) for s in range(STEPS)], f"slot {slot} holds other keys"


def test_a_step_planned_before_another_threads_append_is_refused():
    cache = ContiguousKVCache(2, 8, 1, 4)
    plan = plan_cached_attention([cache], [0], torch.tensor([0, 1]))
    t = threading.Thread(target=cache.extend, args=(1, torch.ones(1, 1, 4), torch.ones(1, 1, 4)))
    t.start()
    t.join()
    from rl_engine.ops.attention import cached_attention_step

    x = torch.ones(1, 1, 4)
    with pytest.raises(ValueError, match="^cache: it does not carry the state the plan was made for"):
        cached_attention_step(x, x, x, cache, plan)
    assert cache.seq_len(0) == 0


class _Injected(RuntimeError):
    pass


class _FailAt:
    """An ops provider whose attention raises right after layer ``layer`` ran (and appended)."""

    def __init__(self, ops, layer: int):
        self._ops, self._layer = ops, layer

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def cached_attention_layers(self, caches, seq_ids, cu_seqlens_q, *, scale=None):
        attend = self._ops.cached_attention_layers(caches, seq_ids, cu_seqlens_q, scale=scale)

        def wrapped(i, q, k, v):
            out = attend(i, q, k, v)
            if i == self._layer:
                raise _Injected(f"injected failure after layer {i}")
            return out

        return wrapped


SPEC = Qwen3Spec(name="t3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
@pytest.mark.parametrize("plan", ["R/R", "P/P"])
@pytest.mark.parametrize("layer", range(SPEC.num_hidden_layers))
def test_a_step_failing_at_any_layer_leaves_every_cache_unchanged(kv_cache, plan, layer):
    model = Qwen3ForCausalLM.random(SPEC, seed=3)
    ops = ops_for(Plan.parse(plan), "rollout", kv_cache=kv_cache)

    def step(caches, ids, slots, cu, provider):
        pos = torch.cat([torch.arange(cu[i], cu[i + 1]) - cu[i] + caches[0].seq_len(s) for i, s in enumerate(slots)])
        return model.hidden_cached(torch.tensor(ids), pos, caches, torch.tensor(slots), torch.tensor(cu, dtype=torch.int32),
                                   provider)

    caches = model.new_kv_caches(ops, 2, 16)
    step(caches, [1, 2, 3, 4, 5], [0, 1], [0, 3, 5], ops)  # a first step that succeeds
    before = [c.snapshot() for c in caches]
    with pytest.raises(_Injected):
        step(caches, [6, 7], [0, 1], [0, 1, 2], _FailAt(ops, layer))
    assert [c.snapshot() for c in caches] == before
    assert [c.seq_len(0) for c in caches] == [3] * SPEC.num_hidden_layers
    retried = step(caches, [6, 7], [0, 1], [0, 1, 2], ops)  # the caches still plan together

    clean = model.new_kv_caches(ops, 2, 16)
    step(clean, [1, 2, 3, 4, 5], [0, 1], [0, 3, 5], ops)
    assert torch.equal(retried, step(clean, [6, 7], [0, 1], [0, 1, 2], ops))
