"""Invariant CPU ``embedding``: a gather forward and a fixed-order scatter-sum backward.

Forward: ``out = weight.index_select(0, ids.flatten())`` reshaped — every output row is a bit
copy of one weight row.

Backward, with ``ids`` and ``dy`` flattened to ``[N]`` and ``[N, H]``:

1. ``order = sort(ids, stable=True)``: tokens grouped by id, each group in increasing token
   index (``torch.sort(stable=True)`` is deterministic);
2. within each group of ``n`` tokens (rank ``j = 0..n-1`` in token order) a fixed pairwise
   tree in fp32: at step ``s = 1, 2, 4, ...`` the partial sum at rank ``j ≡ 0 (mod 2s)`` adds
   the one at rank ``j + s`` if it exists — ``n = 3`` gives ``(g0 + g1) + g2``, ``n = 4``
   ``(g0 + g1) + (g2 + g3)``;
3. ``dweight[v]`` = the group's rank-0 sum rounded once to ``weight.dtype``; other rows +0.

Each step is an elementwise IEEE addition of distinct rows (no atomics, no index collisions),
so ``dweight[v]`` depends only on the gradients of the tokens with id ``v`` and their relative
order: the same bits run to run, whatever the other tokens are.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_embedding
from rl_engine.runtime.registry import Implementation, register

_DTYPES = (torch.float32, torch.bfloat16)


def fixed_order_scatter_sum(ids: torch.Tensor, src: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``out[v] = Σ_{t: ids[t] = v} src[t]`` in fp32, per id a pairwise tree in token order.

    Args:
        ids: ``[N]`` int64 in ``[0, num_rows)``.
        src: ``[N, H]`` fp32.
        num_rows: rows of the result.

    Returns:
        ``[num_rows, H]`` fp32; rows of ids that do not occur are +0.
    """
    N, H = src.shape
    out = src.new_zeros((num_rows, H))
    if N == 0:
        return out
    sid, order = torch.sort(ids, stable=True)
    acc = src.index_select(0, order)  # a copy: grouped by id, token order within a group
    pos = torch.arange(N, dtype=torch.int64)
    is_start = torch.ones(N, dtype=torch.bool)
    is_start[1:] = sid[1:] != sid[:-1]
    start = torch.cummax(torch.where(is_start, pos, torch.zeros_like(pos)), 0).values
    rank = pos - start
    counts = torch.bincount(torch.cumsum(is_start.to(torch.int64), 0) - 1)
    size = counts.repeat_interleave(counts)  # group size, per element
    step = 1
    max_count = int(counts.max())
    while step < max_count:
        sel = torch.nonzero(((rank % (2 * step)) == 0) & (rank + step < size)).squeeze(1)
        acc[sel] = acc[sel] + acc[sel + step]
        step *= 2
    heads = torch.nonzero(is_start).squeeze(1)
    out[sid[heads]] = acc[heads]
    return out


@torch.library.custom_op("rlk::embedding_cpu", mutates_args=(), device_types="cpu")
def embedding_cpu(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1).to(torch.int64)
    return weight.index_select(0, flat).reshape(*ids.shape, weight.shape[1])


@torch.library.custom_op("rlk::embedding_cpu_backward", mutates_args=(), device_types="cpu")
def embedding_cpu_backward(grad: torch.Tensor, ids: torch.Tensor, num_weights: int) -> torch.Tensor:
    H = grad.shape[-1]
    dw = fixed_order_scatter_sum(ids.reshape(-1).to(torch.int64), grad.reshape(-1, H).float(), num_weights)
    return dw.to(grad.dtype)


wire_embedding(embedding_cpu, embedding_cpu_backward)

register(
    Implementation(
        op="embedding.embedding",
        impl_id="cpu.gather",
        version="1",
        fn=embedding_cpu,
        families=("cpu",),
        dtypes=_DTYPES,
        guarantees=frozenset({"row", "chunk", "run_to_run", "threads", "isa"}),
        priority=10,
    )
)
