"""The canonical reduction orders on one process: the tree, its decompositions, the vocabulary
partition and the block-order merge (each with a negative control)."""

from __future__ import annotations

import pytest
import torch

from rl_engine.backends.cpu.logprob.lse import LseAccumulator, block_stats, scale_logits
from rl_engine.distributed.algorithms.tree import TreeAccumulator, check_blocks, is_node, tree_sum
from rl_engine.distributed.algorithms.vocab import VOCAB_BLOCK, vocab_partition
from rl_engine.distributed.data_parallel import TreeGradReducer
from rl_engine.utils.bits import same_bits


def _leaves(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(33, generator=g) * 10 ** (i % 5) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12])
def test_streaming_accumulator_is_the_tree(n):
    leaves = _leaves(n)
    acc = TreeAccumulator(n)
    for t in leaves:
        acc.add(t)
    assert same_bits(acc.result(), tree_sum(leaves))


@pytest.mark.parametrize("n, parts", [(4, 2), (8, 4), (6, 2), (12, 4), (5, 1)])
def test_blocks_of_a_power_of_two_are_subtrees(n, parts):
    check_blocks(n, parts)
    leaves = _leaves(n, 1)
    b = n // parts
    blocks = [tree_sum(leaves[r * b:(r + 1) * b]) for r in range(parts)]
    assert same_bits(tree_sum(blocks), tree_sum(leaves))


def test_blocks_that_are_not_subtrees_are_refused_and_would_differ():
    with pytest.raises(ValueError, match="power of two"):
        check_blocks(6, 3)
    with pytest.raises(ValueError, match="must divide"):
        check_blocks(6, 4)
    assert not is_node(6, 2, 4)
    # negative control: reducing 3 blocks of 2 and then the block sums is another order
    leaves = _leaves(6, 2)
    three = tree_sum([tree_sum(leaves[i:i + 2]) for i in (0, 2, 4)])
    assert not same_bits(three, tree_sum(leaves))


def test_interleaved_groups_need_a_power_of_two_count():
    check_blocks(8, 2, interleaved=True)
    with pytest.raises(ValueError, match="interleaved"):
        check_blocks(12, 4, interleaved=True)


def test_sequential_accumulation_is_not_the_tree():
    leaves = _leaves(4, 3)
    seq = ((leaves[0] + leaves[1]) + leaves[2]) + leaves[3]
    assert not same_bits(seq, tree_sum(leaves))


def test_vocab_partition_holds_whole_blocks():
    V = 151936
    for p in (1, 2, 4, 8):
        parts = vocab_partition(V, p)
        assert parts[0][0] == 0 and parts[-1][1] == V
        assert all(a % VOCAB_BLOCK == 0 for a, _ in parts)
        assert all(parts[i][1] == parts[i + 1][0] for i in range(p - 1))
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_partition(2048, 4)
    with pytest.raises(ValueError, match="parts"):
        vocab_partition(4096, 0)


def test_block_order_merge_of_shard_stats_is_the_single_process_lse():
    g = torch.Generator().manual_seed(4)
    V = 4 * VOCAB_BLOCK + 100
    z = scale_logits(torch.randn(64, V, generator=g) * 4, 0.9)
    whole = LseAccumulator(64, entropy=True, vocab_size=V)
    whole.update(z, 0)
    ref = whole.finish()
    merged = LseAccumulator(64, entropy=True, vocab_size=V)
    for lo, hi in vocab_partition(V, 3):
        merged.merge_block_stats(*block_stats(z[:, lo:hi], entropy=True))
    merged.advance(V)
    res = merged.finish()
    assert same_bits(res.lse, ref.lse) and same_bits(res.entropy, ref.entropy)
    # negative control: finish each shard, then merge the shards' (max, sum) pairs
    shard = []
    for lo, hi in vocab_partition(V, 2):
        a = LseAccumulator(64, entropy=False, vocab_size=hi - lo)
        a.update(z[:, lo:hi], 0)
        shard.append((a.m, a.s))
    pair = LseAccumulator(64, entropy=False, vocab_size=V)
    pair.merge_block_stats(torch.stack([m for m, _ in shard], 1), torch.stack([s for _, s in shard], 1), None)
    pair.advance(V)
    assert not same_bits(pair.finish().lse, ref.lse)


def test_reducer_without_a_group_is_the_tree_over_microbatches():
    from rl_engine.ops.gemm import linear

    w = torch.randn(6, 5, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    xs = [torch.randn(3, 5, generator=torch.Generator().manual_seed(10 + j)) for j in range(6)]
    red = TreeGradReducer([w], num_microbatches=6)
    leaves = []
    for j in red.microbatches():
        linear(xs[j], w).pow(2).sum().backward()
        leaves.append(w.grad.clone())
        red.accumulate()
        assert w.grad is None
    red.finish()
    assert same_bits(w.grad, tree_sum(leaves))
    with pytest.raises(ValueError, match="data-parallel size"):
        TreeGradReducer([w], num_microbatches=6, group=type("G", (), {"size": 3, "rank": 0})())
    with pytest.raises(ValueError, match="num_microbatches"):
        TreeGradReducer([w], num_microbatches=0)


def test_vocab_parallel_logprobs_rejects_bad_kept_records():
    """Kept-set records are checked before any collective: both or neither, one per target, float32 / int."""
    from types import SimpleNamespace

    from rl_engine.distributed.tensor_parallel import vocab_parallel_logprobs

    one = SimpleNamespace(rank=0, size=1)  # validation only: no collective is reached
    h, w, t = torch.randn(3, 8), torch.randn(1024, 8), torch.tensor([1, 2, 3])
    kw = dict(start=0, vocab_size=1024, blocks=[1])
    thr, bnd = torch.zeros(3), torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="give both records or neither"):
        vocab_parallel_logprobs(h, w, t, one, kept_threshold=thr, **kw)
    with pytest.raises(ValueError, match=r"expected shape \(3,\)"):
        vocab_parallel_logprobs(h, w, t, one, kept_threshold=thr[:2], kept_boundary=bnd[:2], **kw)
    with pytest.raises(ValueError, match="float32 and int32/int64"):
        vocab_parallel_logprobs(h, w, t, one, kept_threshold=thr.double(), kept_boundary=bnd, **kw)
