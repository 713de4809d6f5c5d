"""Mixture-of-experts index tables: the canonical token→expert permutation.

A router assigns each token ``t`` of ``T`` tokens ``K`` experts, ``ids[t, j]`` for the rank
``j = 0 … K-1`` (rank 0 is the expert with the largest router logit). The ``T·K`` (token, rank)
pairs are the **slots**; slot ``s = t·K + j`` carries token ``t`` to expert ``ids[t, j]``.

:func:`expert_permutation` orders the slots **by expert, then by slot index** (so by token
position, then rank): a stable sort of ``ids.flatten()``. Both the rl-kernel entry points
(``rl_engine.ops.moe``) and every backend use this one definition, so the order in which an
expert's weight gradient adds its tokens is the same on every path.

Only exact integer operations are used (``sort`` with ``stable=True``, ``scatter_add`` counts,
``cumsum``): the tables depend on ``ids`` alone, not on the thread count or the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExpertPermutation", "expert_permutation"]


@dataclass(frozen=True)
class ExpertPermutation:
    """Slots grouped by expert.

    Attributes:
        order: ``[T·K]`` int64, slot indices sorted by expert then slot index; the slots of
            expert ``e`` are ``order[offsets[e]:offsets[e+1]]``.
        tokens: ``[T·K]`` int64, ``order // K`` (the token of each sorted slot).
        counts: ``[E]`` int64, slots per expert.
        offsets: ``[E+1]`` int64, exclusive prefix sum of ``counts``.
    """

    order: torch.Tensor
    tokens: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor

    def groups(self) -> list[tuple[int, int, int]]:
        """``(expert, start, end)`` of every expert that received slots, ascending by expert
        (reads ``offsets`` on the host: one device sync off the CPU)."""
        o = self.offsets.tolist()
        return [(e, o[e], o[e + 1]) for e in range(len(o) - 1) if o[e + 1] > o[e]]


def expert_permutation(ids: torch.Tensor, num_experts: int) -> ExpertPermutation:
    """The canonical permutation of the slots of ``ids`` (see module docstring).

    Args:
        ids: ``[T, K]`` int64 expert ids in ``[0, num_experts)``.
        num_experts: ``E``.

    Returns:
        An :class:`ExpertPermutation`.
    """
    T, K = ids.shape
    flat = ids.reshape(-1)
    # A stable sort gives the same order whatever the key's width, and a radix sort makes one
    # pass per key byte: the narrowest integer type that holds every id (one byte for E <= 256).
    key = flat.to(torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 32768 else torch.int32)
    order = torch.sort(key, stable=True).indices
    # scatter_add, not bincount: bincount sizes its result from the largest id (a host read on a
    # GPU); integer adds are exact in any order.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return ExpertPermutation(order, torch.div(order, K, rounding_mode="floor") if K else order, counts, offsets)
