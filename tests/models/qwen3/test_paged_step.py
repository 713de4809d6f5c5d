"""The model's rollout step over engine-owned paged caches (``hidden_paged``): the same bits as the
step over rl_engine's own caches (``hidden_cached``) for prefill and decode, with a padded page
table too; the native path refuses it; a shifted position changes the bits (negative control)."""

from __future__ import annotations

import pytest
import torch

from rl_engine.engine import ops_for
from rl_engine.models.qwen3 import Qwen3ForCausalLM, preset
from rl_engine.runtime.plan import Plan, PlanError
from rl_engine.utils.bits import same_bits
from tests.helpers.paged_steps import PagedEngine


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM.random(preset("tiny"), seed=0)


def _cached_logits(model, ops, prompts, decode_tokens):
    caches = model.new_kv_caches(ops, len(prompts), 32)
    ids = torch.cat(prompts)
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    cu = torch.tensor([0, *torch.tensor([len(p) for p in prompts]).cumsum(0).tolist()])
    seq = torch.arange(len(prompts))
    pre = model.logits(model.hidden_cached(ids, pos, caches, seq, cu, ops), ops)
    dpos = torch.tensor([len(p) for p in prompts])
    dec = model.logits(model.hidden_cached(decode_tokens, dpos, caches, seq, torch.arange(len(prompts) + 1), ops), ops)
    return pre, dec


def test_paged_step_equals_cached_step(model):
    ops = ops_for(Plan.parse("R/R"), "rollout")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 2048, (n,), generator=g) for n in (5, 9)]
    decode_tokens = torch.randint(0, 2048, (2,), generator=g)
    want_pre, want_dec = _cached_logits(model, ops, prompts, decode_tokens)

    eng = PagedEngine(model, num_seqs=2, max_len=32)
    plan, pos = eng.plan([5, 9])
    pre = model.logits(model.hidden_paged(torch.cat(prompts), pos, eng.k, eng.v, plan, ops), ops)
    eng.advance([5, 9])
    plan, pos = eng.plan([1, 1], pages=8)  # padded page table: the width a captured step is planned with
    dec = model.logits(model.hidden_paged(decode_tokens, pos, eng.k, eng.v, plan, ops), ops)
    assert same_bits(pre, want_pre) and same_bits(dec, want_dec)
    # negative control: the decode tokens one position later
    wrong = model.logits(model.hidden_paged(decode_tokens, pos + 1, eng.k, eng.v, plan, ops), ops)
    assert not same_bits(wrong, want_dec)


def test_native_path_has_no_paged_step(model):
    ops = ops_for(Plan.parse("P/P"), "rollout")
    eng = PagedEngine(model, num_seqs=1, max_len=8)
    plan, pos = eng.plan([3])
    with pytest.raises(PlanError, match="^attention: the native"):
        model.hidden_paged(torch.tensor([1, 2, 3]), pos, eng.k, eng.v, plan, ops)
    with pytest.raises(ValueError, match="^k_caches: expected 2"):
        model.hidden_paged(torch.tensor([1, 2, 3]), pos, eng.k[:1], eng.v, plan, ops_for(Plan.parse("R/R"), "rollout"))
