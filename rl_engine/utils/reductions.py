"""Order-fixed reductions (portable PyTorch: any device).

:func:`fixed_order_sum` sums each row in one fixed order; the token-level RL losses build three
blocks on it, each a pure function of *what* is summed, never of *where* it sits:

* :func:`row_sum_active` — per-sequence sum over the active tokens of a ``[B, L]`` tensor. The
  active tokens of each row are first compacted to the front (keeping their order), then summed
  with :func:`fixed_order_sum`. The result depends only on the
  ordered list of a row's active-token values: not on ``B``, the other rows, the padded length
  ``L``, left vs right padding or holes in the mask.
* :func:`canonical_sum` — sum of a vector (one value per sequence; or each row of a matrix) in an
  order fixed by the values themselves: sort ascending, then :func:`fixed_order_sum`. The result depends only on the
  *multiset* of values, so permuting the batch or splitting it into micro-batches and
  concatenating the per-sequence values back gives the same bits.
* :func:`segment_canonical_sum` — the same per segment (e.g. per GRPO group): a segment's sum
  depends only on the multiset of its members' values.

Every result is normalised with ``+ 0.0`` so that an all-zero sum is ``+0.0`` whatever the signs
of the zeros that were added (``-0.0 + +0.0`` is ``+0.0``; padding adds ``+0.0``).

Only exact operations are used besides the IEEE additions of the fixed-order sum: ``where``,
integer ``cumsum``, ``scatter`` onto distinct indices (each target written once), ``sort``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "SUM_LANES",
    "fixed_order_sum",
    "row_sum_active", "row_count_active", "row_min_active", "row_max_active", "canonical_sum", "segment_canonical_sum"]


#: Lane width of :func:`fixed_order_sum`.
SUM_LANES = 64


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


def _compact(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Move each row's active entries to the front (in order); inactive slots become ``+0.0``."""
    vals = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if values.shape[-1] == 0:
        return vals
    m = mask.to(torch.int64)
    n = m.sum(-1, keepdim=True)
    pos_active = m.cumsum(-1) - 1
    pos_inactive = n + (1 - m).cumsum(-1) - 1
    target = torch.where(mask, pos_active, pos_inactive)  # a permutation of [0, L) per row
    return torch.empty_like(vals).scatter_(-1, target, vals)


def row_sum_active(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[..., B, L]`` values (fp32) and a ``[B, L]`` bool mask → ``[..., B]`` sums over active
    tokens, fixed order (leading dimensions stack several quantities into one call)."""
    return fixed_order_sum(_compact(values, mask.expand(values.shape))) + 0.0


def row_count_active(mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` bool → ``[B]`` float32 number of active tokens (exact below 2**24)."""
    return mask.sum(-1).to(torch.float32)


def row_min_active(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row minimum over active tokens (``+inf`` for a row without active tokens)."""
    if values.shape[-1] == 0:
        return values.new_full(values.shape[:-1], float("inf"))
    return torch.where(mask, values, torch.full((), float("inf"), dtype=values.dtype, device=values.device)).amin(-1)


def row_max_active(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row maximum over active tokens (``-inf`` for a row without active tokens)."""
    if values.shape[-1] == 0:
        return values.new_full(values.shape[:-1], float("-inf"))
    return torch.where(mask, values, torch.full((), float("-inf"), dtype=values.dtype, device=values.device)).amax(-1)


def canonical_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension of ``v`` in ascending-value order, each row on its own (a
    function of the multiset of the row's values). ``[..., N]`` → ``[...]``.

    Differentiable: the gradient of every element is the upstream gradient, exactly.
    """
    if v.dim() < 1:
        raise ValueError(f"v: expected at least 1 dimension, got shape {tuple(v.shape)}")
    if v.shape[-1] == 0:
        return v.sum(-1)  # +0.0, still connected to the autograd graph
    return fixed_order_sum(torch.sort(v, dim=-1).values) + 0.0


def segment_canonical_sum(values: torch.Tensor, segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-segment sums of the 1-D ``values``, each in ascending-value order.

    Returns ``(sums [G], counts [G] int64, inverse [N])``: segments are the distinct values of
    ``segment_ids`` in ascending order and ``inverse[i]`` is the segment of element ``i``. Not
    differentiable (advantages are computed without gradients).
    """
    n = values.shape[0]
    if n == 0:
        z = values.new_zeros((0,))
        return z, torch.zeros(0, dtype=torch.int64, device=values.device), torch.zeros(0, dtype=torch.int64, device=values.device)
    by_value = torch.sort(values, stable=True).indices
    perm = by_value[torch.sort(segment_ids[by_value], stable=True).indices]  # segment-major, values ascending
    uniq, inverse, counts = torch.unique(segment_ids, sorted=True, return_inverse=True, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    seg_of_sorted = inverse[perm]
    rank = torch.arange(n, device=values.device) - starts[seg_of_sorted]
    width = int(counts.max())
    grid = values.new_zeros((uniq.shape[0], width))
    grid[seg_of_sorted, rank] = values[perm]  # distinct (segment, rank) targets: each written once
    return fixed_order_sum(grid) + 0.0, counts, inverse
