"""CUDA graphs on the rollout side: a captured Qwen3 decode step replays the eager step's bits.

The step runs over engine-owned paged caches (``hidden_paged``) with a plan made once with a fixed
page-table width and updated in place before each replay (``plan_paged_attention(..., out=)``),
as an engine's attention-metadata builder does. Eager steps use freshly planned, unpadded plans.
Negative control: replaying without updating the plan gives different bits."""

from __future__ import annotations

import pytest
import torch

from rl_engine.engine import ops_for
from rl_engine.models.qwen3 import Qwen3ForCausalLM, preset
from rl_engine.runtime.plan import Plan
from rl_engine.utils.bits import same_bits
from tests.helpers.paged_steps import PagedEngine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_captured_decode_step_replays_eager_bits(dtype):
    model = Qwen3ForCausalLM.random(preset("tiny"), seed=0, dtype=dtype, device="cuda")
    ops = ops_for(Plan.parse("R/R"), "rollout")
    lens = [5, 17, 33, 2]
    B = len(lens)
    eng = PagedEngine(model, num_seqs=B, max_len=96, device="cuda")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.spec.vocab_size, (sum(lens),), generator=g).cuda()
    plan, pos = eng.plan(lens)
    model.hidden_paged(prompt, pos, eng.k, eng.v, plan, ops)
    eng.advance(lens)

    ids = torch.zeros(B, dtype=torch.int64, device="cuda")
    positions = torch.zeros(B, dtype=torch.int64, device="cuda")
    static, pos = eng.plan([1] * B, pages=96 // eng.bs)
    positions.copy_(pos)

    def step():
        return model.logits(model.hidden_paged(ids, positions, eng.k, eng.v, static, ops), ops)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture (rewrites the same slots with the same values)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for t in range(4):
        tokens = torch.randint(0, model.spec.vocab_size, (B,), generator=g).cuda()
        eager_plan, pos = eng.plan([1] * B)
        eager = model.logits(model.hidden_paged(tokens, pos, eng.k, eng.v, eager_plan, ops), ops)
        ids.copy_(tokens)
        eng.plan([1] * B, out=static)
        positions.copy_(pos)
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(out, eager), f"decode step {t}"
        eng.advance([1] * B)
    # negative control (last, it writes the new keys at the previous step's rows): a replay whose
    # plan and positions were not updated
    tokens = torch.randint(0, model.spec.vocab_size, (B,), generator=g).cuda()
    eager_plan, pos = eng.plan([1] * B)
    eager = model.logits(model.hidden_paged(tokens, pos, eng.k, eng.v, eager_plan, ops), ops)
    ids.copy_(tokens)
    graph.replay()
    torch.cuda.synchronize()
    assert not same_bits(out, eager)
