"""Data-parallel gradient reduction in one fixed tree: the same bits run to run and at every DP size.

The gradient of a global batch split into ``G`` micro-batches is **defined** as the canonical
tree sum (:mod:`~rl_engine.distributed.algorithms.tree`) of the ``G`` per-micro-batch gradients
in global micro-batch order:

.. math:: \\nabla = S(0, G), \\qquad S(lo, hi) = S(lo, m) + S(m, hi), \\ m = lo + \\lceil (hi-lo)/2 \\rceil

accumulated in ``accum_dtype`` (float32 by default) and cast once to each parameter's dtype.
With ``d`` data-parallel ranks, rank ``r`` runs the ``b = G / d`` consecutive micro-batches
``r·b .. (r+1)·b - 1``: it reduces them locally in the tree's order (a streaming
:class:`~rl_engine.distributed.algorithms.tree.TreeAccumulator`, ``O(log b)`` buffers), then the
``d`` block sums are combined by :func:`~rl_engine.distributed.algorithms.exact_k.tree_all_reduce`.
Because ``d`` is a power of two, every rank's block is a subtree and the cross-rank tree is the
top of the same tree — so the bits are those of one process running all ``G`` micro-batches,
for ``d`` = 1, 2, 4, 8 (:func:`~rl_engine.distributed.algorithms.tree.check_blocks`).

The per-micro-batch losses must be scaled by a constant of the **global** batch (e.g. its
token count), never by a per-rank count, so that the leaves are the same at every ``d``. A
parameter without a gradient in a micro-batch contributes ``+0``.

Communication: one bucket of all parameters in ``accum_dtype``, ``2 (d-1)/d`` of it sent per
rank (all-to-all + all-gather), the volume of a ring all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rl_engine.distributed.algorithms.exact_k import tree_all_reduce
from rl_engine.distributed.algorithms.tree import TreeAccumulator, check_blocks
from rl_engine.distributed.transports import Group

__all__ = ["TreeGradReducer"]


class TreeGradReducer:
    """Accumulate per-micro-batch gradients and reduce them over the data-parallel ranks.

    Args:
        params: the parameters whose ``.grad`` is reduced (the same list, in the same order, on
            every rank).
        num_microbatches: ``G``, micro-batches of the global batch; divisible by the group size.
        group: the data-parallel :class:`~rl_engine.distributed.transports.Group` (``None``: one
            process, no communication).
        accum_dtype: dtype of the tree's additions (default float32).

    Use::

        red = TreeGradReducer(model.parameters(), num_microbatches=G, group=dp)
        for j in red.microbatches():          # global micro-batch indices of this rank, in order
            loss_of(batch[j]).backward()
            red.accumulate()                  # takes every p.grad into the tree, sets it to None
        red.finish()                          # p.grad = the canonical sum, same bits on all ranks

    Raises:
        ValueError: ``num_microbatches`` not divisible by the group size, or a group size that is
            not a power of two (its blocks would not be subtrees of the canonical tree).
    """

    def __init__(self, params: Iterable[torch.Tensor], *, num_microbatches: int, group: Group | None = None,
                 accum_dtype: torch.dtype = torch.float32):
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("params: expected at least one parameter")
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches: expected a positive int, got {num_microbatches!r}")
        self.group = group
        d = group.size if group is not None else 1
        check_blocks(num_microbatches, d, name="data-parallel size")
        self.num_microbatches = num_microbatches
        self.local = num_microbatches // d
        self.accum_dtype = accum_dtype
        self._numel = [p.numel() for p in self.params]
        self._tree = TreeAccumulator(self.local)

    def microbatches(self) -> range:
        """The global indices of the micro-batches this rank runs, in the order to run them."""
        r = self.group.rank if self.group is not None else 0
        return range(r * self.local, (r + 1) * self.local)

    def _bucket(self) -> torch.Tensor:
        parts = []
        for p, n in zip(self.params, self._numel):
            g = p.grad
            if g is None:
                parts.append(torch.zeros(n, dtype=self.accum_dtype, device=p.device))
            else:
                parts.append(g.detach().reshape(-1).to(self.accum_dtype))
        return torch.cat(parts)

    def accumulate(self) -> None:
        """Add the current ``.grad`` of every parameter as the next micro-batch's leaf; clear them."""
        self._tree.add(self._bucket())
        for p in self.params:
            p.grad = None

    def finish(self) -> None:
        """Write the reduced gradient into every ``p.grad`` (in ``p``'s dtype) and reset."""
        if self._tree.count != self.local:
            raise ValueError(f"accumulate: this rank ran {self._tree.count} of its {self.local} micro-batches")
        total = self._tree.result()
        if self.group is not None:
            total = tree_all_reduce(total, self.group)
        off = 0
        for p, n in zip(self.params, self._numel):
            p.grad = total[off:off + n].view(p.shape).to(p.dtype).clone()
            off += n
        self._tree = TreeAccumulator(self.local)
