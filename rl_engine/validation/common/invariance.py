"""Row (batch) invariance checker, forward and gradients, on raw bits.

Given a function ``fn(*row_args, *shared_args)`` whose row arguments and outputs share a leading
row dimension, :func:`check_row_invariance` computes the output on the full batch once, then on
each *trial* — a list of row indices (any subset, any order, repeats allowed) — and requires
that output row ``k`` of the trial is raw-bit equal to output row ``trial[k]`` of the full run.
With ``grads=True`` it also backpropagates a fixed per-row upstream gradient (row ``i`` of the
trial gets the upstream rows of ``trial[i]``) and compares the input gradients row by row.

The same checker runs the negative controls (a non-invariant implementation must fail it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rl_engine.utils.bits import BitComparison, same_bits
from rl_engine.validation.common.report import CheckReport

__all__ = ["RowInvarianceReport", "check_row_invariance"]


class RowInvarianceReport(CheckReport):
    passed_as = "row invariant"
    unit = "trials"


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _run(fn, row_args, shared, upstream, grads):
    args = [a.detach().clone().requires_grad_(grads and a.is_floating_point()) for a in row_args]
    outs = _as_tuple(fn(*args, *shared))
    g = None
    if grads:
        diff = [(o, u) for o, u in zip(outs, upstream) if o.requires_grad]
        torch.autograd.backward([o for o, _ in diff], [u for _, u in diff])
        g = tuple(a.grad if a.grad is not None else torch.zeros_like(a) for a in args if a.is_floating_point())
    return tuple(o.detach() for o in outs), g


def check_row_invariance(
    fn: Callable[..., torch.Tensor | Sequence[torch.Tensor]],
    row_args: Sequence[torch.Tensor],
    trials: Sequence[Sequence[int]],
    shared_args: Sequence[object] = (),
    *,
    grads: bool = False,
    seed: int = 0,
) -> RowInvarianceReport:
    """Check that every output row (and input-gradient row) depends only on its input row.

    Args:
        fn: the operator under test.
        row_args: tensors with the row dimension first (``[R, ...]``), all with the same ``R``.
        trials: index lists into ``[0, R)``; each is one re-batched call.
        shared_args: arguments passed unchanged to every call (weights, eps, ...).
        grads: also compare gradients of the floating row arguments.
        seed: seed of the fixed upstream gradients.
    """
    R = row_args[0].shape[0]
    for i, a in enumerate(row_args):
        if a.shape[0] != R:
            raise ValueError(f"row_args[{i}]: expected {R} rows, got shape {tuple(a.shape)}")
    full_out = _as_tuple(fn(*[a.detach() for a in row_args], *shared_args))
    gen = torch.Generator().manual_seed(seed)
    upstream = tuple(torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.dtype) for o in full_out)
    full_out, full_g = _run(fn, row_args, shared_args, upstream, grads)
    report = RowInvarianceReport()
    for t in trials:
        idx = torch.as_tensor(list(t), dtype=torch.long)
        if idx.numel() == 0:
            continue
        report.trials += 1
        sub_out, sub_g = _run(fn, [a[idx] for a in row_args], shared_args, tuple(u[idx] for u in upstream), grads)
        for k, (so, fo) in enumerate(zip(sub_out, full_out)):
            d: BitComparison = same_bits(so, fo[idx])
            if not d.equal:
                report.failures.append(f"output {k}, trial rows {list(t)[:8]}{'...' if len(t) > 8 else ''}: {d}")
                break
        if grads and sub_g is not None:
            for k, (sg, fg) in enumerate(zip(sub_g, full_g)):
                d = same_bits(sg, fg[idx])
                if not d.equal:
                    report.failures.append(f"grad of row arg {k}, trial rows {list(t)[:8]}: {d}")
                    break
    return report
