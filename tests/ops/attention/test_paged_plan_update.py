"""Planning a paged step for CUDA graphs: host metadata, a padded page table, in-place updates.

A captured step reads its plan's tensors at fixed addresses, so an engine plans once with a
fixed page-table width (``pages=``) and then updates that plan in place each step
(``plan_paged_attention(..., out=plan)``). These tests show, on the CPU, that a padded plan and an
updated plan give the bits of the eagerly planned step, that an update that does not fit raises
before writing anything, and (negative control) that a stale plan — one not updated — differs.
The capture itself runs on the GPU (tests/engine/test_decode_capture.py)."""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops.attention import paged_attention_step, plan_paged_attention
from rl_engine.utils.bits import same_bits

BS, HKV, G, D = 4, 2, 2, 16
NUM_BLOCKS = 32


def _meta(lens, tables):
    """Decode-step metadata (one new token per sequence) for sequences of ``lens`` tokens (the new
    one included) whose blocks are ``tables``."""
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for n, t in zip(lens, tables)], dtype=torch.int64)
    cu = torch.arange(len(lens) + 1, dtype=torch.int64)
    return slots, bt, cu, torch.tensor(lens, dtype=torch.int64)


def _step(plan, seed):
    g = torch.Generator().manual_seed(seed)
    B = plan.num_seqs
    kc = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g)
    vc = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g)
    q, k, v = torch.randn(B, HKV * G, D, generator=g), torch.randn(B, HKV, D, generator=g), torch.randn(B, HKV, D, generator=g)
    return paged_attention_step(q, k, v, kc, vc, plan)


def test_padded_and_updated_plans_give_the_eager_bits():
    first = _meta([5, 9], [[3, 7], [1, 4, 8]])
    second = _meta([6, 13], [[3, 7], [1, 4, 8, 11]])
    captured = plan_paged_attention(*first[:2], BS, *first[2:], num_blocks=NUM_BLOCKS, pages=6)
    assert captured.page_rows.shape[1] == 6
    eager1 = plan_paged_attention(*first[:2], BS, *first[2:], num_blocks=NUM_BLOCKS)
    assert same_bits(_step(captured, 0), _step(eager1, 0))
    ptrs = [t.data_ptr() for t in (captured.slot_mapping, captured.page_rows, captured.q_seq, captured.q_pos)]
    updated = plan_paged_attention(*second[:2], BS, *second[2:], num_blocks=NUM_BLOCKS, out=captured)
    assert updated is captured
    assert ptrs == [t.data_ptr() for t in (captured.slot_mapping, captured.page_rows, captured.q_seq, captured.q_pos)]
    eager2 = plan_paged_attention(*second[:2], BS, *second[2:], num_blocks=NUM_BLOCKS)
    assert same_bits(_step(captured, 1), _step(eager2, 1))
    # negative control: the first step's plan run on the second step's data differs
    assert not same_bits(_step(eager1, 1), _step(eager2, 1))


def test_update_that_does_not_fit_raises_and_writes_nothing():
    first = _meta([5, 9], [[3, 7], [1, 4, 8]])
    plan = plan_paged_attention(*first[:2], BS, *first[2:], num_blocks=NUM_BLOCKS, pages=3)
    before = [t.clone() for t in (plan.slot_mapping, plan.page_rows, plan.q_seq, plan.q_pos)]
    wide = _meta([5, 17], [[3, 7], [1, 4, 8, 11, 12]])
    with pytest.raises(ValueError, match=r"^out: its page table has 3 columns, this step needs 5"):
        plan_paged_attention(*wide[:2], BS, *wide[2:], num_blocks=NUM_BLOCKS, out=plan)
    three = _meta([5, 9, 2], [[3, 7], [1, 4, 8], [2]])
    with pytest.raises(ValueError, match=r"^out: planned for num_tokens=2, this step has num_tokens=3"):
        plan_paged_attention(*three[:2], BS, *three[2:], num_blocks=NUM_BLOCKS, out=plan)
    after = (plan.slot_mapping, plan.page_rows, plan.q_seq, plan.q_pos)
    assert all(same_bits(a, b) for a, b in zip(before, after))
    with pytest.raises(ValueError, match=r"^pages: expected an int >= 3"):
        plan_paged_attention(*first[:2], BS, *first[2:], num_blocks=NUM_BLOCKS, pages=2)
    with pytest.raises(TypeError, match=r"^out: expected a PagedAttentionPlan"):
        plan_paged_attention(*first[:2], BS, *first[2:], num_blocks=NUM_BLOCKS, out="plan")
