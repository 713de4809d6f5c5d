"""FSDP2 (``fully_shard``) on an HF Qwen3 with rl_engine installed: log-probs and gradients raw-bit
equal to one process at 1, 2 and 4 ranks (gloo, CPU).

The reference is the unsharded model in this process, the gradients of the 4 micro-batches
summed by :class:`~rl_engine.distributed.data_parallel.TreeGradReducer`. FSDP2 runs
:func:`~rl_engine.integrations.fsdp.shard_model` (tree reduce-scatter, plain sums) and
:class:`~rl_engine.integrations.fsdp.ShardedGradTree`. Negative control: FSDP2's own
reduce-scatter and gradient accumulation give different gradients at 1 and 2 ranks.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from rl_engine.utils.bits import same_bits
from tests.distributed import workers as W


@lru_cache(maxsize=None)
def _reference():
    from rl_engine.distributed.data_parallel import TreeGradReducer

    model = W.fsdp_model()
    names = [n for n, _ in model.named_parameters()]
    red = TreeGradReducer([p for _, p in model.named_parameters()], num_microbatches=W.FSDP_MICROBATCHES)
    lps = {}
    for j in red.microbatches():
        lps[j] = W.fsdp_step(model, j)
        red.accumulate()
    red.finish()
    return lps, {n: p.grad for n, p in zip(names, model.parameters())}


@pytest.fixture(scope="module")
def fsdp(gloo_world):
    return [r["fsdp"] for r in gloo_world]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp2_logprobs_equal_one_process(fsdp, world):
    ref, _ = _reference()
    got = {}
    for r in fsdp[:world]:
        got.update(r[("tree", world)]["logprobs"])
    assert sorted(got) == sorted(ref)
    for j in ref:
        assert same_bits(got[j], ref[j]), f"micro-batch {j}"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp2_gradients_equal_one_process(fsdp, world):
    _, ref = _reference()
    for r in fsdp[:world]:
        grads = r[("tree", world)]["grads"]
        assert sorted(grads) == sorted(ref)
        bad = [n for n in ref if not same_bits(grads[n], ref[n])]
        assert not bad, bad


def test_negative_control_native_fsdp2_reduction_depends_on_the_world_size(fsdp):
    one, two = fsdp[0][("native", 1)]["grads"], fsdp[0][("native", 2)]["grads"]
    assert any(not same_bits(one[n], two[n]) for n in one)
    # the log-probs do not depend on the reduction
    ref, _ = _reference()
    assert all(same_bits(fsdp[0][("native", 1)]["logprobs"][j], ref[j]) for j in ref)


def test_world_size_must_split_the_microbatches_into_a_power_of_two_steps():
    from rl_engine.integrations.fsdp import ShardedGradTree

    with pytest.raises(ValueError, match="world size"):
        ShardedGradTree(torch.nn.Linear(2, 2), num_microbatches=12, group=type("G", (), {"size": 4, "rank": 0})())
