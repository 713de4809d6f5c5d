"""Raw-bit comparison: the only equality rl-kernel uses for invariance and parity.

Two tensors are *raw-bit equal* when they have the same dtype and shape and identical bit
patterns: ``+0.0`` and ``-0.0`` differ, and any NaN is a failure (even two identical NaN bit
patterns), because a NaN log-prob is never a valid result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["int_view", "BitComparison", "same_bits"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a same-sized integer tensor (contiguous copy if needed)."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if not t.is_floating_point():
        return t
    return t.contiguous().view(_INT[t.element_size()])


@dataclass(frozen=True)
class BitComparison:
    """Result of a raw-bit comparison."""

    equal: bool
    numel: int
    mismatched: int
    nan_count: int
    first_index: tuple[int, ...] | None
    first_values: tuple[float, float] | None
    max_abs_diff: float
    reason: str = ""

    def __bool__(self) -> bool:  # truthy when the bits are the same: `assert same_bits(a, b)`
        return self.equal

    def __str__(self) -> str:
        if self.equal:
            return f"raw-bit equal ({self.numel} elements)"
        if self.reason:
            return self.reason
        return (
            f"{self.mismatched}/{self.numel} elements differ in raw bits (NaN: {self.nan_count}); "
            f"first at {self.first_index}: {self.first_values[0]!r} vs {self.first_values[1]!r}; "
            f"max |Δ| = {self.max_abs_diff:.3e}"
        )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> BitComparison:
    """Compare ``a`` and ``b`` on raw bits (see module docstring); the result is truthy exactly when
    they are raw-bit equal and carries the first mismatch otherwise."""
    if a.dtype != b.dtype:
        return BitComparison(False, a.numel(), a.numel(), 0, None, None, float("inf"), f"dtype differs: {a.dtype} vs {b.dtype}")
    if a.shape != b.shape:
        return BitComparison(False, a.numel(), a.numel(), 0, None, None, float("inf"), f"shape differs: {tuple(a.shape)} vs {tuple(b.shape)}")
    a, b = a.detach(), b.detach()
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    # the count is taken where the tensors live (one scalar comes back); only a mismatch's details
    # are worked out on the host
    ne = int_view(a) != int_view(b)
    nan = torch.zeros_like(ne)
    if a.is_floating_point():
        nan = torch.isnan(a) | torch.isnan(b)
        ne = ne | nan
    mism = int(ne.sum())
    if mism == 0:
        return BitComparison(True, a.numel(), 0, 0, None, None, 0.0)
    a, b, ne, nan = a.cpu(), b.cpu(), ne.cpu(), nan.cpu()
    idx = tuple(int(i) for i in torch.nonzero(ne)[0])
    if a.is_floating_point():
        d = (a.double() - b.double()).abs()
        d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
        max_abs = float(d.max())
    else:
        max_abs = float((a.long() - b.long()).abs().max())
    return BitComparison(False, a.numel(), mism, int(nan.sum()), idx, (a[idx].item(), b[idx].item()), max_abs)

