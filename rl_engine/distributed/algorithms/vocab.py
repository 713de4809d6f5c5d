"""Vocabulary sharding aligned to the canonical log-sum-exp blocks, and the shard merge.

The canonical log-sum-exp (:mod:`rl_engine.backends.cpu.logprob.lse`) reduces the vocabulary
in blocks of ``B = VOCAB_BLOCK = 1024`` columns at absolute offsets (step 1, per block and row:
``m_b, s_b, t_b``), then merges the blocks **sequentially in block order** (step 2). Step 1 of a
block depends only on that block, so when every rank holds whole blocks
(:func:`vocab_partition`), each rank computes step 1 of its blocks, the ``[R, n_blocks]``
statistics are all-gathered (``3 · R · n_blocks`` floats: ~0.6 KB per token for V = 151,936),
and every rank runs step 2 over all blocks in order — the sequence of floating-point
operations of the single-process log-sum-exp, so ``lse`` and the entropy are raw-bit equal to
TP = 1 at every TP size (:func:`merge_shard_stats`).
"""

from __future__ import annotations

import torch

from rl_engine.backends.cpu.logprob.lse import VOCAB_BLOCK, LseAccumulator, LseResult, block_stats
from rl_engine.distributed.transports import Group

__all__ = ["VOCAB_BLOCK", "vocab_partition", "shard_block_stats", "merge_shard_stats"]


def vocab_partition(vocab_size: int, parts: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of ``parts`` contiguous vocabulary shards made of whole 1024-column blocks.

    With ``nb = ceil(V / B)`` blocks, shard ``r`` takes blocks ``floor(r·nb/parts) ..
    floor((r+1)·nb/parts)`` (balanced; the last block may be short).

    Raises:
        ValueError: fewer blocks than parts (a shard would be empty), or non-positive arguments.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size: expected a positive int, got {vocab_size!r}")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts: expected a positive int, got {parts!r}")
    nb = -(-vocab_size // VOCAB_BLOCK)
    if nb < parts:
        raise ValueError(f"vocab_size: {vocab_size} columns are {nb} block(s) of {VOCAB_BLOCK}, fewer than the "
                         f"{parts} vocabulary shards (every shard holds whole blocks of the canonical log-sum-exp)")
    bounds = [(r * nb) // parts for r in range(parts + 1)]
    return [(bounds[r] * VOCAB_BLOCK, min(bounds[r + 1] * VOCAB_BLOCK, vocab_size)) for r in range(parts)]


def shard_block_stats(z: torch.Tensor, *, entropy: bool) -> torch.Tensor:
    """Step 1 of every block of this shard: ``z`` ``[R, L]`` fp32 scaled logits of columns
    starting at a block boundary → ``[2 or 3, R, ceil(L / B)]`` (``m_b``, ``s_b``, ``t_b``)."""
    m, s, t = block_stats(z, entropy=entropy)
    return torch.stack([m, s, t] if entropy else [m, s])


def merge_shard_stats(stats: torch.Tensor, group: Group, blocks: list[int], vocab_size: int, *,
                      entropy: bool) -> LseResult:
    """Gather every shard's block statistics and merge them in block order (step 2 and 3).

    Args:
        stats: this rank's :func:`shard_block_stats` ``[2 or 3, R, blocks[rank]]``.
        blocks: number of blocks of every rank's shard, in rank order.

    Returns:
        :class:`~rl_engine.backends.cpu.logprob.lse.LseResult` (``lse``, ``entropy``) ``[R]``,
        the same on every rank and raw-bit equal to the single-process log-sum-exp.
    """
    full = group.all_gather_sizes(stats, blocks, dim=2)
    R = stats.shape[1]
    acc = LseAccumulator(R, entropy=entropy, vocab_size=vocab_size)
    acc.m, acc.s = acc.m.to(stats.device), acc.s.to(stats.device)
    if acc.t is not None:
        acc.t = acc.t.to(stats.device)
    acc.merge_block_stats(full[0], full[1], full[2] if entropy else None)
    acc.advance(vocab_size)
    return acc.finish()
