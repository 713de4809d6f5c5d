"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with gradients whose bits do not depend on the world size.

FSDP2 all-gathers parameters (a concatenation: exact) and reduce-scatters gradients with the
backend's floating-point sum (its order depends on the world size), divided by the world size.
:func:`shard_model` keeps FSDP2 and replaces only the reduction, on every FSDP unit:

* :class:`TreeReduceScatter` — FSDP2's custom reduce-scatter hook: an all-to-all of the
  gradient chunks, then the canonical tree (:mod:`rl_engine.distributed.algorithms.tree`) over
  the ranks' chunks in rank order (same bits on every rank);
* a plain sum (``set_force_sum_reduction_for_comms(True)``, ``set_gradient_divide_factor(1.0)``):
  scale the loss by a constant of the **global** batch instead.

:class:`ShardedGradTree` then sums the steps of one optimizer step in the same tree: with
``W`` ranks and ``G`` micro-batches, step ``j`` of rank ``r`` runs micro-batch ``j·W + r``, the
reduce-scatter of step ``j`` reduces the node ``[j·W, (j+1)·W)`` of the tree over the ``G``
micro-batches, and the ``G / W`` steps are combined by the tree's upper levels (``G / W`` a
power of two). The sharded gradient is then the canonical tree sum of the ``G`` per-micro-batch
gradients — the bits of one process running the ``G`` micro-batches with
:class:`~rl_engine.distributed.data_parallel.TreeGradReducer` — at ``W`` = 1, 2, 4.

The model's arithmetic is whatever it runs: with rl_engine installed
(:func:`rl_engine.integrations.hf.install`) every op is row-invariant, so a sequence's
log-probs do not depend on the rank or the micro-batch it lands in.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from rl_engine.distributed.algorithms.tree import TreeAccumulator, check_blocks, tree_sum
from rl_engine.distributed.transports import Group

__all__ = ["TreeReduceScatter", "shard_model", "ShardedGradTree"]


def _reduce_scatter_base():
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


class TreeReduceScatter(_reduce_scatter_base()):
    """A reduce-scatter (FSDP2 ``ReduceScatter`` comm) in the canonical tree order over ranks.

    ``input_tensor`` ``[W · n]`` holds this rank's contribution to every rank's chunk;
    ``output_tensor`` ``[n]`` receives ``tree_sum(chunk of rank 0, ..., chunk of rank W-1)``.
    Sum only (FSDP must not ask for an average: see :func:`shard_model`).
    """

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        if op != dist.ReduceOp.SUM and getattr(op, "op", op) != dist.ReduceOp.SUM:
            raise ValueError(f"op: the tree reduce-scatter sums; got {op} (call shard_model, which asks FSDP for sums)")
        g = Group(group)
        chunks = g.all_to_all(input_tensor.view(g.size, -1))
        output_tensor.copy_(tree_sum(list(chunks.unbind(0))))
        return None


def shard_model(model: torch.nn.Module, *, layers: Iterable[torch.nn.Module] | None = None, mesh=None,
                **fully_shard_kwargs) -> torch.nn.Module:
    """``fully_shard`` every module of ``layers`` (default: ``model.model.layers``, the HF
    decoder layers) and then ``model``, each with :class:`TreeReduceScatter` and plain sums.

    Args:
        mesh: a 1-D ``DeviceMesh`` (default: FSDP2's, over the world).
        fully_shard_kwargs: passed to ``fully_shard`` (``reshard_after_forward``, ``mp_policy``, …).

    Returns ``model`` (now an ``FSDPModule``).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if layers is None:
        layers = model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(TreeReduceScatter())
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)
    return model


class ShardedGradTree:
    """The steps of one optimizer step of an FSDP2 model, summed in the canonical tree.

    Args:
        model: the model from :func:`shard_model`.
        num_microbatches: ``G``; ``G / W`` must be a power of two (``W`` = the world size).
        group: the FSDP :class:`~rl_engine.distributed.transports.Group` (default: the world).

    Use::

        tree = ShardedGradTree(model, num_microbatches=G)
        for j in tree.microbatches():        # this rank's global micro-batch indices, in step order
            loss_of(batch[j]).backward()     # FSDP reduce-scatters this step (tree over ranks)
            tree.accumulate()                # takes every sharded .grad, sets it to None
        tree.finish()                        # sharded .grad: the tree over all G micro-batches
    """

    def __init__(self, model: torch.nn.Module, *, num_microbatches: int, group: Group | None = None):
        self.group = group if group is not None else Group()
        W = self.group.size
        check_blocks(num_microbatches, W, name="world size", interleaved=True)
        self.num_microbatches = num_microbatches
        self.steps = num_microbatches // W
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._tree = TreeAccumulator(self.steps)

    def microbatches(self) -> range:
        """Global micro-batch indices of this rank, one per step: ``j·W + rank``."""
        W, r = self.group.size, self.group.rank
        return range(r, self.num_microbatches, W)

    def _local(self, p: torch.nn.Parameter) -> torch.Tensor:
        g = p.grad
        if g is None:
            local = p.to_local() if hasattr(p, "to_local") else p
            return torch.zeros(local.numel(), dtype=local.dtype, device=local.device)
        g = g.to_local() if hasattr(g, "to_local") else g
        return g.reshape(-1)

    def accumulate(self) -> None:
        """Add this step's sharded gradients (after ``backward``) as the next leaf; clear them."""
        self._tree.add(torch.cat([self._local(p) for p in self.params]))
        for p in self.params:
            p.grad = None

    def finish(self) -> None:
        """Write the tree sum into every sharded ``.grad`` (a DTensor like the parameter)."""
        total = self._tree.result()
        off = 0
        for p in self.params:
            local = p.to_local() if hasattr(p, "to_local") else p
            n = local.numel()
            g = total[off:off + n].view(local.shape).clone()
            off += n
            if hasattr(p, "to_local"):
                from torch.distributed.tensor import DTensor

                g = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            p.grad = g
        self._tree = TreeAccumulator(self.steps)
