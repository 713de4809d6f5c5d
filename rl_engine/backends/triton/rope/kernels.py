"""Triton kernel of ``rope.apply_rope`` (imported on first call).

``rlk_rope``: one program per (token, block of heads); loads the token's fp32 table row
``(c, s)`` (``rope_cos_sin``, defined bit for bit from float64 ``+ - *``, the same table on every
device) and rotates ``x1 = x[..., :R/2]``, ``x2 = x[..., R/2:R]`` in fp32 with one rounding::

    forward    out1 = x1·c − x2·s      out2 = x2·c + x1·s
    backward   dx1  = g1·c + g2·s      dx2  = g2·c − g1·s      (TRANSPOSE)

and copies features ``R..D``. The block shape depends only on the head count and ``R``, the
token count is not a specialisation key, and every element runs the same instructions: a
token's output depends only on its row and its position (**row invariant**).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.backends.triton import device_guard

__all__ = ["rotate", "KERNEL_NAMES"]

KERNEL_NAMES = ("rlk_rope",)


@triton.jit(do_not_specialize=["T"])
def rlk_rope(x_ptr, c_ptr, s_ptr, out_ptr, T, NH, D, HALF,
             TRANSPOSE: tl.constexpr, BLOCK_NH: tl.constexpr, BLOCK_HALF: tl.constexpr,
             HAS_REST: tl.constexpr, BLOCK_REST: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_NH + tl.arange(0, BLOCK_NH)
    i = tl.arange(0, BLOCK_HALF)
    mi = i < HALF
    c = tl.load(c_ptr + tok * HALF + i, mask=mi, other=0.0)[None, :]
    s = tl.load(s_ptr + tok * HALF + i, mask=mi, other=0.0)[None, :]
    row = (tok * NH + heads) * D  # [BLOCK_NH] int64
    mask = (heads[:, None] < NH) & mi[None, :]
    p1 = row[:, None] + i[None, :]
    x1 = tl.load(x_ptr + p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:
        o1 = x1 * c + x2 * s
        o2 = x2 * c - x1 * s
    else:
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
    tl.store(out_ptr + p1, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + p1 + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)
    if HAS_REST:
        j = 2 * HALF + tl.arange(0, BLOCK_REST)
        mr = (heads[:, None] < NH) & (j[None, :] < D)
        pr = row[:, None] + j[None, :]
        tl.store(out_ptr + pr, tl.load(x_ptr + pr, mask=mr, other=0.0), mask=mr)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, transpose: bool) -> torch.Tensor:
    """Rotate ``x [T, NH, D]`` by the fp32 table ``cos, sin [T, rotary_dim/2]``."""
    T, NH, D = x.shape
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    half = rotary_dim // 2
    block_half = max(2, triton.next_power_of_2(half))
    block_nh = max(1, min(triton.next_power_of_2(NH), 2048 // block_half))
    rest = D - rotary_dim
    block_rest = max(2, triton.next_power_of_2(rest)) if rest else 2
    warps = 4 if block_nh * block_half >= 1024 else 1
    with device_guard(x):
        rlk_rope[(T, triton.cdiv(NH, block_nh))](
            x, cos, sin, out, T, NH, D, half, TRANSPOSE=transpose, BLOCK_NH=block_nh, BLOCK_HALF=block_half,
            HAS_REST=rest > 0, BLOCK_REST=block_rest, num_warps=warps,
        )
    return out
