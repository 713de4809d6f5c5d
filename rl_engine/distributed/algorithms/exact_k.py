"""Reductions whose bits do not depend on how the reduced dimension is split across ranks.

**Sharded-K exact GEMM** (:func:`sharded_k_matmul`). Rank ``r`` holds the ``K`` columns
``K_r`` of ``x [M, K]`` and ``w [N, K]`` (any split; the shards in rank order make up ``K``).
The result is raw-bit equal to :func:`~rl_engine.backends.cpu.common.exact_matmul` of the
unsharded operands — the bits of ``gemm.linear`` on the CPU — for every number of ranks:

1. the power-of-two row scales ``e_x[m]``, ``e_w[n]`` are exponents of row maxima; the maximum
   over shards of the shard exponents is the exponent of the whole row (one int64 all-reduce
   MAX of ``M + N`` values);
2. with the slice width ``β`` of the **whole** ``K`` (:func:`~rl_engine.backends.cpu.common.exact_beta`),
   each rank computes the integer slice-product sums over its shard
   (:func:`~rl_engine.backends.cpu.common.exact_partial_sums`): integer-valued float64
   ``[M, N]`` tensors (one for 16-bit operands, two for float32);
3. an all-reduce SUM of those in float64: every partial sum is an integer below ``2^53``, so the
   sum is exact whatever order or tree the transport uses;
4. :func:`~rl_engine.backends.cpu.common.exact_finish` rounds once, as ``exact_matmul`` does.

Communication per call: ``8 · P · M · N`` bytes all-reduced (``P`` = 1 or 2 parts), versus
``2 · M · N`` or ``4 · M · N`` for a native all-reduce of the rounded partial products. The
float64 GEMMs run on any device, so on a GPU the bits are the CPU's.

**Canonical tree all-reduce** (:func:`tree_all_reduce`): the sum over ranks of floating-point
tensors in the order of :mod:`~rl_engine.distributed.algorithms.tree` over the rank index,
bandwidth-optimal (all-to-all of ``1/p`` chunks, a local tree, all-gather), the same bits on
every rank; with blocks that are subtrees it continues a tree the ranks started locally.
"""

from __future__ import annotations

import torch

from rl_engine.backends.cpu.common import exact_beta, exact_finish, exact_partial_sums, row_exponents
from rl_engine.distributed.algorithms.tree import tree_sum
from rl_engine.distributed.transports import Group

__all__ = ["sharded_k_matmul", "tree_all_reduce", "ROW_BUDGET_BYTES"]

_ZERO_ROW = -(1 << 20)  # exponent reported by an all-zero row piece (below every real exponent)
_MAX_FINITE_E = 129  # a finite float32/bfloat16/float16 row has e <= 129
#: Bytes of float64 partial sums a call holds at once; more rows are processed in row blocks.
ROW_BUDGET_BYTES = 64 << 20


def _global_exponents(x: torch.Tensor, w: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    M = x.shape[0]
    local = torch.cat([row_exponents(x, zero=_ZERO_ROW).reshape(-1), row_exponents(w, zero=_ZERO_ROW).reshape(-1)])
    e = group.all_reduce_max(local)
    e = torch.where(e == _ZERO_ROW, 0, e)
    if bool((e > _MAX_FINITE_E).any()):
        name = "x" if bool((e[:M] > _MAX_FINITE_E).any()) else "w"
        raise ValueError(f"{name}: non-finite values (inf or NaN) on some rank; the sharded exact GEMM takes finite operands")
    return e[:M].unsqueeze(1), e[M:].unsqueeze(1)


def sharded_k_matmul(x: torch.Tensor, w: torch.Tensor, group: Group, *, k_total: int,
                     out_dtype: torch.dtype | None = None, scatter: bool = False) -> torch.Tensor:
    """``x @ w.T`` over a ``K`` split across the ranks of ``group``, with the unsharded bits.

    Args:
        x: ``[M, K_r]`` this rank's K shard (float32, bfloat16 or float16, finite).
        w: ``[N, K_r]`` the same K shard of the other operand (a transposed view is fine).
        group: the ranks holding the shards.
        k_total: ``Σ_r K_r``, the reduction length of the whole product.
        out_dtype: result dtype (default ``x.dtype``).
        scatter: return only this rank's block of ``N / size`` output columns (a reduce-scatter
            of the partial sums instead of an all-reduce: half the volume). ``N`` must be
            divisible by the group size.

    Returns:
        ``[M, N]`` (or ``[M, N / size]`` with ``scatter``): raw-bit equal to
        ``exact_matmul(cat_r x_r, cat_r w_r)`` (its columns ``rank · N/size ..`` with ``scatter``).

    Raises:
        ValueError: non-finite operands, mismatched shapes, ``N`` not divisible with ``scatter``.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x, w: expected [M, K_r] and [N, K_r], got {tuple(x.shape)} and {tuple(w.shape)}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    M, N = x.shape[0], w.shape[0]
    if scatter and N % group.size:
        raise ValueError(f"scatter: N = {N} output columns are not divisible by the group size {group.size}")
    beta = exact_beta(k_total, x.dtype, w.dtype)
    ex, ew = _global_exponents(x, w, group)
    n_parts = 1 if x.element_size() == 2 and w.element_size() == 2 else 2
    rows = max(1, ROW_BUDGET_BYTES // max(1, 8 * n_parts * N))
    n_out = N // group.size if scatter else N
    out = torch.empty((M, n_out), dtype=out_dtype, device=x.device)
    ew_out = ew[group.rank * n_out:(group.rank + 1) * n_out] if scatter else ew
    for r0 in range(0, max(M, 1), rows):
        r1 = min(M, r0 + rows)
        parts = torch.stack(exact_partial_sums(x[r0:r1], w, ex[r0:r1], ew, beta))  # [P, m, N]
        if scatter:
            total = group.reduce_scatter_exact_sum(parts.permute(2, 0, 1).contiguous()).permute(1, 2, 0)
        else:
            total = group.all_reduce_exact_sum(parts)
        out[r0:r1] = exact_finish(list(total.unbind(0)), ex[r0:r1], ew_out, beta, out_dtype)
    return out


def tree_all_reduce(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of ``t`` over the ranks in the canonical tree order of the rank index (same bits on
    every rank, a new tensor of ``t``'s shape and dtype).

    All-to-all of ``1/p`` chunks, the tree over the ``p`` received chunks, all-gather of the
    reduced chunks: ``2 (p-1)/p · n`` elements sent per rank, a ring all-reduce's volume.
    """
    p = group.size
    flat = t.reshape(-1)
    n = flat.numel()
    chunk = -(-n // p) if n else 0
    if chunk * p != n:
        flat = torch.nn.functional.pad(flat, (0, chunk * p - n))
    recv = group.all_to_all(flat.view(p, chunk))
    mine = tree_sum(list(recv.unbind(0)))
    return group.all_gather(mine)[:n].view(t.shape)
