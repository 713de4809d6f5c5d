"""Triton kernels of ``activation.silu_and_mul`` (imported on first call).

* ``rlk_silu_and_mul_fwd``  ``y = round((a / (1 + exp(-a))) · b)`` in fp32;
* ``rlk_silu_and_mul_bwd``  ``da = round((g·b) · (s · (1 + a (1 − s))))``, ``db = round(g · silu)``
  with ``s = 1 / (1 + exp(-a))``, ``silu = a / (1 + exp(-a))``.

Grid: (row, column block of ``BLOCK`` = 1024 features). Every element runs the same instruction
sequence whatever its row, column or block position (divisions are the correctly rounded
``div_rn``), so outputs are **row** and **chunk invariant** by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.backends.triton import device_guard

__all__ = ["forward", "backward", "KERNEL_NAMES"]

KERNEL_NAMES = ("rlk_silu_and_mul_fwd", "rlk_silu_and_mul_bwd")
BLOCK = 1024


@triton.jit(do_not_specialize=["M"])
def rlk_silu_and_mul_fwd(x_ptr, y_ptr, M, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    a = tl.load(x_ptr + row * (2 * D) + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * (2 * D) + D + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.div_rn(a, 1.0 + tl.exp(-a))
    tl.store(y_ptr + row * D + cols, (silu * b).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def rlk_silu_and_mul_bwd(g_ptr, x_ptr, dx_ptr, M, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    a = tl.load(x_ptr + row * (2 * D) + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * (2 * D) + D + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    den = 1.0 + tl.exp(-a)
    s = tl.div_rn(1.0, den)
    silu = tl.div_rn(a, den)
    dsilu = s * ((1.0 - s) * a + 1.0)
    da = (g * b) * dsilu
    db = silu * g
    tl.store(dx_ptr + row * (2 * D) + cols, da.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + row * (2 * D) + D + cols, db.to(dx_ptr.dtype.element_ty), mask=mask)


def forward(x2: torch.Tensor) -> torch.Tensor:
    M, D2 = x2.shape
    D = D2 // 2
    y = x2.new_empty((M, D))
    if M == 0 or D == 0:
        return y
    with device_guard(x2):
        rlk_silu_and_mul_fwd[(M, triton.cdiv(D, BLOCK))](x2, y, M, D, BLOCK=BLOCK, num_warps=4)
    return y


def backward(g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    M, D2 = x2.shape
    D = D2 // 2
    dx = torch.empty_like(x2)
    if M == 0 or D == 0:
        return dx
    with device_guard(x2):
        rlk_silu_and_mul_bwd[(M, triton.cdiv(D, BLOCK))](g2, x2, dx, M, D, BLOCK=BLOCK, num_warps=4)
    return dx
