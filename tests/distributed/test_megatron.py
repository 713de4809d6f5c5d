"""Megatron-core 0.16.1 ``GPTModel`` of Qwen3 on rl_engine's layers (gloo, CPU), TP 1, 2, 4.

The model is loaded from a HF checkpoint directory at every TP size. Its log-probs are raw-bit
equal across TP sizes, to rl_engine's single-process train side and to the rollout side of
``rlk check`` (the reference executor's sampled tokens and reported log-probs); its gradients
(converted back to HF names) are the single-process gradients; converting the parameters back
to HF gives the checkpoint's bits. Negative control: the native row-parallel all-reduce (the
arithmetic of Megatron's own ``RowParallelLinear``) at TP = 2 changes the log-probs.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from rl_engine.utils.bits import same_bits
from tests.distributed import workers as W


@lru_cache(maxsize=None)
def _reference():
    from rl_engine.engine import ops_for
    from rl_engine.models.qwen3 import PRESETS, Qwen3ForCausalLM
    from rl_engine.runtime.plan import Plan

    spec = PRESETS["tiny-tp"]
    model = Qwen3ForCausalLM.random(spec, seed=0).requires_grad_(True)
    ids, pos, cu, tgt, rollout = W.megatron_batch()
    ops = ops_for(Plan.parse("R/R"), "train")
    lp, _ = ops.lm_head_logprobs(model.hidden_train(ids, pos, cu, ops), model.lm_head_weight, tgt)
    (lp * torch.linspace(-1.0, 1.0, lp.shape[0])).sum().backward()
    grads = Qwen3ForCausalLM(spec, {k: v.grad for k, v in model.params.items()}).to_hf_state_dict()
    return lp.detach(), grads, rollout, Qwen3ForCausalLM.random(spec, seed=0).to_hf_state_dict()


@pytest.fixture(scope="module")
def megatron(gloo_world):
    return [r["megatron"] for r in gloo_world]


RUNS = [r for r in W.MEGATRON_RUNS if r[1] != "native"]


@pytest.mark.parametrize("tp, scheme", RUNS)
def test_logprobs_equal_single_process_and_rollout(megatron, tp, scheme):
    lp, _, rollout, _ = _reference()
    for rank in megatron:
        got = rank[(tp, scheme)]["logprobs"]
        assert same_bits(got, lp)
        idx = sorted(rollout)
        assert same_bits(got[idx], torch.stack([rollout[i] for i in idx]))


@pytest.mark.parametrize("tp, scheme", RUNS)
def test_gradients_equal_single_process(megatron, tp, scheme):
    _, grads, _, _ = _reference()
    got = megatron[0][(tp, scheme)]["grads"]
    assert sorted(got) == sorted(grads)
    assert [k for k in grads if not same_bits(got[k], grads[k])] == []


@pytest.mark.parametrize("tp, scheme", RUNS)
def test_hf_checkpoint_round_trip(megatron, tp, scheme):
    sd = _reference()[3]
    back = megatron[0][(tp, scheme)]["roundtrip"]
    assert sorted(back) == sorted(sd) and all(same_bits(back[k], sd[k]) for k in sd)


def test_negative_control_native_row_parallel_all_reduce_differs(megatron):
    lp = _reference()[0]
    assert not same_bits(megatron[0][(2, "native")]["logprobs"], lp)
