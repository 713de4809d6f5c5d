"""Shared building blocks of the invariant CPU backend.

Shapes use ``M`` rows (tokens), ``K`` the reduced dimension and ``N`` output features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["TILE_M", "TILE_N", "SUM_LANES", "tiled_matmul", "fixed_order_sum"]

#: Rows per BLAS call. Every call sees exactly this many rows (the last tile is zero-padded).
TILE_M = 64
#: Output features per BLAS call, at absolute column offsets 0, TILE_N, 2·TILE_N, ...
TILE_N = 1024
#: Lane width of :func:`fixed_order_sum`.
SUM_LANES = 64


def tiled_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` computed tile by tile with one fixed BLAS call shape.

    Args:
        x: ``[M, K]`` contiguous.
        w: ``[N, K]`` contiguous.

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Every BLAS call multiplies a ``[TILE_M, K]`` row tile by a ``[K, TILE_N]`` column tile, so
    the algorithm the BLAS picks depends only on ``K`` and the dtype, never on ``M`` or ``N``;
    within a call, each output element's K-reduction is independent of its row and column
    position (measured, and guarded by tests). Hence element ``(i, j)`` depends only on
    ``x[i]`` and ``w[j]``: the result is **row invariant** and **column (chunk) invariant**.
    Cost: at most one padded tile per dimension; measured at 0.97–1.37× of ``F.linear`` for
    ``M ≥ 64`` (docs/benchmarks/cpu.md).
    """
    M, K = x.shape
    N = w.shape[0]
    out = x.new_empty((M, N))
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    m_full = (M // TILE_M) * TILE_M
    x_tail = None
    if m_full != M:
        x_tail = x.new_zeros((TILE_M, K))
        x_tail[: M - m_full] = x[m_full:]
    for j in range(0, N, TILE_N):
        wb = w[j : j + TILE_N]
        n = wb.shape[0]
        if n < TILE_N:
            wb = torch.cat([wb, wb.new_zeros((TILE_N - n, K))])
        wt = wb.t()
        for i in range(0, m_full, TILE_M):
            out[i : i + TILE_M, j : j + n] = (x[i : i + TILE_M] @ wt)[:, :n]
        if x_tail is not None:
            out[m_full:, j : j + n] = (x_tail @ wt)[: M - m_full, :n]
    return out


def fixed_order_sum(x: torch.Tensor, lanes: int = SUM_LANES) -> torch.Tensor:
    """Sum over the last dimension in one fixed order, independent of the other dimensions.

    With ``x`` of shape ``[..., L]`` and ``B = lanes``: element ``t`` is added into lane
    ``t mod B`` in increasing block order (``acc_l = ((x_l + x_{l+B}) + x_{l+2B}) + ...``, a
    short tail block padded with zeros), then the ``B`` lanes are folded pairwise
    (``acc[:B/2] + acc[B/2:]``, repeated) down to one value. Every step is an elementwise
    IEEE addition over whole rows, so row ``r``'s sum depends only on row ``r`` and ``L``.

    Returns ``[...]`` in ``x.dtype`` (callers pass fp32).
    """
    if lanes & (lanes - 1):
        raise ValueError(f"lanes: expected a power of two, got {lanes}")
    L = x.shape[-1]
    if L == 0:
        return x.new_zeros(x.shape[:-1])
    acc = x[..., :lanes]
    if acc.shape[-1] < lanes:
        acc = F.pad(acc, (0, lanes - acc.shape[-1]))
    else:
        acc = acc.clone()
    for j in range(lanes, L, lanes):
        blk = x[..., j : j + lanes]
        if blk.shape[-1] < lanes:
            blk = F.pad(blk, (0, lanes - blk.shape[-1]))
        acc.add_(blk)
    w = lanes
    while w > 1:
        w //= 2
        acc = acc[..., :w] + acc[..., w : 2 * w]
    return acc[..., 0]
