"""Micro-batch (split / permutation / re-padding) invariance checker for reduced losses, on raw bits.

A trainer splits a batch of sequences into micro-batches, runs forward + ``backward()`` on each
and accumulates gradients; it logs the full-batch loss from the parts. For a loss operator
``fn(*row_args) -> out`` (the caller binds everything that must be global, e.g. the full batch's
denominator), :func:`check_microbatch_invariance` runs the full batch once and then every
*split* — a list of micro-batches, each a list of row indices, together covering the batch in
any order — and requires, bit for bit:

* ``compare_of(combine(parts))`` equals ``compare_of(full)`` for every named tensor (the loss,
  metrics, ...; here a NaN matches a NaN of the same bit pattern: an undefined metric, e.g. a
  mean over no active tokens, must be undefined on both sides);
* ``rows_of(part)`` equals the same rows of ``rows_of(full)`` (per-sequence terms), if given;
* the gradient of ``loss_of(part)`` w.r.t. each row argument in ``grad_args`` equals the same
  rows of the full batch's gradient.

``layout`` also changes each micro-batch's token layout (``mask_arg`` names the mask argument):
``"trim"`` drops trailing columns inactive in the whole micro-batch, ``"extend"`` appends three
inactive columns, ``"right_align"`` shifts every row so its last active token sits in the last
column (left padding), ``"interleave"`` inserts an inactive column after every column (masked
holes). Gradients are mapped back before comparing. The same checker runs the
negative controls (a non-invariant reduction must fail it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from rl_engine.utils.bits import same_bits, int_view
from rl_engine.validation.common.report import CheckReport

__all__ = ["MicrobatchReport", "check_microbatch_invariance", "relayout", "same_bits_allow_nan", "LAYOUTS"]

LAYOUTS = (None, "trim", "extend", "right_align", "interleave")


class MicrobatchReport(CheckReport):
    passed_as = "micro-batch invariant"
    unit = "splits"


def same_bits_allow_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Raw-bit equal, where a NaN matches a NaN of the identical bit pattern (undefined metrics)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(int_view(a), int_view(b)))


def relayout(args: list[torch.Tensor], mask_arg: int, layout: str | None):
    """Apply ``layout`` to ``[b, L]`` token args; returns (new args, fn mapping a grad back)."""
    if layout is None:
        return args, lambda g: g
    mask = args[mask_arg].bool()
    L = mask.shape[-1]
    is_token = [a.dim() == 2 and a.shape == mask.shape for a in args]
    if layout == "trim":
        active_cols = mask.any(0).nonzero()
        keep = int(active_cols.max()) + 1 if active_cols.numel() else 1
        new = [a[:, :keep].contiguous() if t else a for a, t in zip(args, is_token)]
        return new, lambda g: F.pad(g, (0, L - keep))
    if layout == "extend":
        new = [F.pad(a, (0, 3)) if t else a for a, t in zip(args, is_token)]
        return new, lambda g: g[:, :L]
    if layout == "right_align":
        pos = torch.arange(L, device=mask.device)
        last = torch.where(mask, pos, torch.full_like(pos, -1)).amax(-1)
        shift = torch.where(last >= 0, L - 1 - last, torch.zeros_like(last))
        src = (pos[None, :] - shift[:, None]) % L  # new[r, j] = old[r, j - shift_r]
        back = (pos[None, :] + shift[:, None]) % L
        new = [torch.gather(a, 1, src).contiguous() if t else a for a, t in zip(args, is_token)]
        return new, lambda g: torch.gather(g, 1, back)
    if layout == "interleave":
        def spread(a: torch.Tensor) -> torch.Tensor:
            out = a.new_zeros((a.shape[0], 2 * L))
            out[:, 0::2] = a
            return out

        new = [spread(a) if t else a for a, t in zip(args, is_token)]
        return new, lambda g: g[:, 0::2]
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def _grads(out_loss: torch.Tensor, args: list[torch.Tensor], grad_args: Sequence[int]) -> list[torch.Tensor]:
    inputs = [args[i] for i in grad_args]
    gs = torch.autograd.grad(out_loss, inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(gs, inputs)]


def check_microbatch_invariance(
    fn: Callable[..., Any],
    row_args: Sequence[torch.Tensor],
    splits: Sequence[Sequence[Sequence[int]]],
    *,
    combine: Callable[[list[Any]], Any],
    compare_of: Callable[[Any], Mapping[str, torch.Tensor]],
    loss_of: Callable[[Any], torch.Tensor] | None = None,
    rows_of: Callable[[Any], torch.Tensor] | None = None,
    grad_args: Sequence[int] = (0,),
    layout: str | None = None,
    mask_arg: int | None = None,
) -> MicrobatchReport:
    """Check bitwise equality of full-batch vs micro-batched results (see module docstring)."""
    if layout is not None and mask_arg is None:
        raise ValueError("mask_arg: required when layout is set")
    B = row_args[0].shape[0]

    def run(args: list[torch.Tensor]):
        args = [a.detach().clone().requires_grad_(i in grad_args) for i, a in enumerate(args)]
        out = fn(*args)
        g = _grads(loss_of(out), args, grad_args) if loss_of is not None and grad_args else []
        return out, g

    full_out, full_g = run(list(row_args))
    full_cmp = {k: v.detach() for k, v in compare_of(full_out).items()}
    full_rows = rows_of(full_out).detach() if rows_of is not None else None
    report = MicrobatchReport()
    for split in splits:
        report.trials += 1
        seen = sorted(i for mb in split for i in mb)
        if seen != list(range(B)):
            raise ValueError(f"splits: each split must cover rows 0..{B - 1} exactly once, got {seen}")
        parts = []
        for mb in split:
            idx = torch.as_tensor(list(mb), dtype=torch.long)
            args = [a[idx] for a in row_args]
            args, back = relayout(args, mask_arg, layout) if layout is not None else (args, lambda g: g)
            out, g = run(args)
            parts.append(out)
            where = f"split {[len(m) for m in split]}, micro-batch rows {list(mb)[:8]}"
            if full_rows is not None:
                d = same_bits(rows_of(out).detach(), full_rows[idx])
                if not d.equal:
                    report.failures.append(f"{where}: per-sequence rows differ: {d}")
            for k, (gi, fg) in enumerate(zip(g, full_g)):
                gi = back(gi) if gi.dim() == 2 and gi.shape[0] == len(mb) else gi
                d = same_bits(gi, fg[idx])
                if not d.equal:
                    report.failures.append(f"{where}: gradient of row arg {grad_args[k]} differs: {d}")
        comb = {k: v.detach() for k, v in compare_of(combine(parts)).items()}
        for name, want in full_cmp.items():
            d = same_bits(comb[name], want)
            if not d.equal and not same_bits_allow_nan(comb[name], want):
                report.failures.append(f"split {[list(m)[:6] for m in split][:4]}: combined {name!r} differs: {d}")
    return report
