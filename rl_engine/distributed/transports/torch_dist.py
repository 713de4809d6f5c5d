"""Collectives over one ``torch.distributed`` process group, with exact semantics stated.

Every collective here is either **exact by construction** — a concatenation (all-gather,
all-to-all), a maximum, or a sum of integers (or of integer-valued float64 below ``2^53``) —
or it is the plain ``all_reduce`` of floating-point partial sums that the negative controls use
(:meth:`Group.all_reduce_native`: its result depends on the reduction order the backend picks,
which is what the controls show). The canonical floating-point reductions are built on top of
the exact ones, in :mod:`rl_engine.distributed.algorithms`.

The collectives run at every world size, 1 included (so a one-rank NCCL group runs the same
code path as a multi-rank one). :func:`comm_log` records, per call, the bytes **this rank
sends** under the bandwidth-optimal algorithm of each collective — ring all-gather
``(p-1)/p · out``, ring all-reduce ``2 (p-1)/p · n``, all-to-all ``(p-1)/p · n``,
reduce-scatter ``(p-1)/p · in`` — which is the quantity a link-bandwidth cost model needs
(docs/distributed.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Group", "CommRecord", "comm_log"]

# torch >= 2.13 names (the *_tensor forms are deprecated aliases of the same collectives)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommRecord:
    """One collective as seen by this rank: its name, dtype, world size and bytes sent."""

    op: str
    dtype: str
    world: int
    sent_bytes: int


_LOG: ContextVar[list[CommRecord] | None] = ContextVar("rl_engine_comm_log", default=None)


@contextmanager
def comm_log() -> Iterator[list[CommRecord]]:
    """Record every collective of :class:`Group` run inside the block (this rank's view)."""
    records: list[CommRecord] = []
    token = _LOG.set(records)
    try:
        yield records
    finally:
        _LOG.reset(token)


def _record(op: str, t: torch.Tensor, world: int, factor: float) -> None:
    log = _LOG.get()
    if log is not None:
        log.append(CommRecord(op, str(t.dtype).removeprefix("torch."), world, int(t.numel() * t.element_size() * factor)))


class Group:
    """One ``torch.distributed`` process group and the exact collectives over it.

    Args:
        group: a ``ProcessGroup`` (default: the world group). ``torch.distributed`` must be
            initialised.

    Attributes:
        rank, size: this process's rank in the group and the group size.
        backend: ``"gloo"`` or ``"nccl"`` (or another backend name).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("group: torch.distributed is not initialised (call torch.distributed.init_process_group "
                               "first, or use rl_engine.distributed.launch.spawn)")
        self.pg = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, size={self.size}, backend={self.backend!r})"

    def subgroups(self, partition: list[list[int]]) -> "Group | None":
        """Create a process group for every rank list of ``partition`` (ranks of this group; every
        rank of this group must call this with the same lists) and return the one holding this
        rank, or ``None`` if no list holds it."""
        mine = None
        seen: set[int] = set()
        for ranks in partition:
            if not ranks or seen & set(ranks) or not all(0 <= q < self.size for q in ranks):
                raise ValueError(f"partition: expected disjoint, non-empty lists of ranks in [0, {self.size}), got {partition}")
            seen |= set(ranks)
            glob = [dist.get_global_rank(self.pg, q) if self.pg is not None else q for q in ranks]
            pg = dist.new_group(glob)
            if self.rank in ranks:
                mine = Group(pg)
        return mine

    # --- exact collectives -------------------------------------------------------------------
    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate the ranks' equal-shape ``t`` along ``dim`` in rank order (exact)."""
        t = t.contiguous()
        t1 = t if t.dim() else t.reshape(1)
        flat = torch.empty((self.size * t1.shape[0], *t1.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather_single(flat, t1, group=self.pg)  # the concatenated form (gloo takes no stacked one)
        _record("all_gather", t, self.size, self.size - 1)
        if t.dim() == 0:
            return flat
        d = dim % t.dim()
        if d == 0:
            return flat
        return torch.cat(flat.view(self.size, *t.shape).unbind(0), dim=d)

    def all_gather_sizes(self, t: torch.Tensor, sizes: list[int], dim: int = 0) -> torch.Tensor:
        """Concatenate along ``dim`` pieces whose sizes differ by rank (``sizes[r]``: rank ``r``'s).

        Pads every piece to ``max(sizes)``, gathers, and drops the padding (exact)."""
        d = dim % t.dim()
        if t.shape[d] != sizes[self.rank]:
            raise ValueError(f"t: expected size {sizes[self.rank]} along dim {dim} on rank {self.rank}, got {t.shape[d]}")
        top = max(sizes)
        if len(set(sizes)) == 1:
            return self.all_gather(t, dim=d)
        pad = [0, 0] * (t.dim() - 1 - d) + [0, top - t.shape[d]]
        padded = torch.nn.functional.pad(t, pad) if top > t.shape[d] else t
        full = self.all_gather(padded, dim=d)
        return torch.cat([full.narrow(d, r * top, n) for r, n in enumerate(sizes)], dim=d)

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` ``[size, ...]``: returns ``out`` with ``out[s]`` = rank ``s``'s ``t[self.rank]`` (exact)."""
        if t.shape[0] != self.size:
            raise ValueError(f"t: expected a leading dimension of the group size {self.size}, got {tuple(t.shape)}")
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.pg)
        _record("all_to_all", t, self.size, (self.size - 1) / self.size)
        return out

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the ranks (exact; used on int64 exponents)."""
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.pg)
        _record("all_reduce", out, self.size, 2 * (self.size - 1) / self.size)
        return out

    def all_reduce_exact_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks of an integer tensor, or of an integer-valued float64 tensor whose
        every partial sum stays below ``2^53`` in magnitude: exact, so any order gives the same bits."""
        if t.is_floating_point() and t.dtype != torch.float64:
            raise TypeError(f"t: an exact sum needs integers or integer-valued float64, got {t.dtype}")
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.pg)
        _record("all_reduce", out, self.size, 2 * (self.size - 1) / self.size)
        return out

    def reduce_scatter_exact_sum(self, t: torch.Tensor) -> torch.Tensor:
        """:meth:`all_reduce_exact_sum` of ``t`` ``[size · n, ...]``, keeping only this rank's block
        ``[n, ...]`` (rows ``rank · n ..``)."""
        if t.is_floating_point() and t.dtype != torch.float64:
            raise TypeError(f"t: an exact sum needs integers or integer-valued float64, got {t.dtype}")
        if t.shape[0] % self.size:
            raise ValueError(f"t: leading dimension {t.shape[0]} is not divisible by the group size {self.size}")
        t = t.contiguous()
        out = torch.empty((t.shape[0] // self.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        _reduce_scatter_single(out, t, op=dist.ReduceOp.SUM, group=self.pg)
        _record("reduce_scatter", t, self.size, (self.size - 1) / self.size)
        return out

    def all_reduce_one_owner(self, t: torch.Tensor) -> torch.Tensor:
        """Combine tensors in which every element is nonzero on at most one rank: the owner's
        bits everywhere (``-0.0`` kept), all other ranks contributing bit pattern 0.

        The floating-point values are summed as their integer bit patterns (an integer sum of
        one pattern and zeros is that pattern, in any order); 16-bit values travel in pairs as
        int32 when the last dimension is even (no extra volume), else widened to int32.
        """
        if not t.is_floating_point():
            raise TypeError(f"t: expected a floating-point tensor, got {t.dtype}")
        t = t.contiguous()
        size = t.element_size()
        if size == 4:
            bits = t.view(torch.int32)
            return self.all_reduce_exact_sum(bits).view(t.dtype)
        if size == 8:
            return self.all_reduce_exact_sum(t.view(torch.int64)).view(t.dtype)
        if size == 2 and t.dim() and t.shape[-1] % 2 == 0:
            return self.all_reduce_exact_sum(t.view(torch.int32)).view(t.dtype)
        if size == 2:
            wide = t.view(torch.int16).to(torch.int32)
            return self.all_reduce_exact_sum(wide).to(torch.int16).view(t.dtype)
        raise TypeError(f"t: unsupported element size {size} for {t.dtype}")

    # --- the negative control ----------------------------------------------------------------
    def all_reduce_native(self, t: torch.Tensor) -> torch.Tensor:
        """The backend's floating-point all-reduce (SUM) in ``t``'s dtype: **not** order-fixed —
        its bits depend on the world size and the backend's algorithm (negative controls only)."""
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.pg)
        _record("all_reduce", out, self.size, 2 * (self.size - 1) / self.size)
        return out

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` of rank ``src`` on every rank (pickled; small control data only)."""
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.pg)
        return box[0]
