"""Triton kernels of ``norm.rms_norm`` / ``norm.fused_add_rms_norm`` (imported on first call).

Every launched name starts with ``rlk_``:

* ``rlk_rms_norm_fwd``   one program per row: (optional ``r' = round(x + residual)``), the sum of
  squares in fp32 over fixed ``BLOCK``-wide chunks from column 0 upwards (a ``[BLOCK]`` lane
  accumulator folded once by ``tl.sum``), ``r = 1 / sqrt(sum / H + eps)`` (both correctly
  rounded), ``n = round(h · r)``, ``y = round(w · n)``;
* ``rlk_rms_norm_bwd``   a fixed tile of rows per program: per row ``dx = r (g − n̂ · Σ(g n̂) / H)``
  (+ the upstream residual gradient), with the same chunked fixed-order reductions; the tile's
  weight-gradient partial ``Σ_rows dy · n`` (rows in increasing order) goes to its own row of a
  ``[tiles, H]`` fp32 buffer (no atomics);
* ``rlk_rms_norm_dw``    ``dweight = Σ_tiles partial`` in tile order, rounded once.

``BLOCK`` and the warp count are functions of ``H`` only, and the row count is never a
specialisation key (``do_not_specialize``), so a row's bits do not depend on how many rows
the call has: row invariant by construction.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rl_engine.backends.triton import device_guard

__all__ = ["forward", "backward", "KERNEL_NAMES", "block_of"]

KERNEL_NAMES = ("rlk_rms_norm_fwd", "rlk_rms_norm_bwd", "rlk_rms_norm_dw")

#: Rows up to this width are handled as one register block in backward.
_SINGLE_MAX = 8192
#: Chunk width for wider rows.
_CHUNK = 4096


def block_of(H: int) -> tuple[int, int, bool]:
    """``(BLOCK, num_warps, single)`` for a row of ``H`` features (a function of ``H`` only)."""
    if H <= _SINGLE_MAX:
        block = max(16, triton.next_power_of_2(H))
        single = True
    else:
        block, single = _CHUNK, False
    return block, max(1, min(16, block // 512)), single


@triton.jit(do_not_specialize=["M"])
def rlk_rms_norm_fwd(x_ptr, res_ptr, w_ptr, y_ptr, newres_ptr, M, H, H_f, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * H
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, H, BLOCK):
        idx = c0 + cols
        mask = idx < H
        h = tl.load(x_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
            s = (h + r).to(newres_ptr.dtype.element_ty)
            tl.store(newres_ptr + base + idx, s, mask=mask)
            h = s.to(tl.float32)
        acc += h * h
    var = tl.div_rn(tl.sum(acc, axis=0), H_f)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    for c0 in range(0, H, BLOCK):
        idx = c0 + cols
        mask = idx < H
        h = tl.load(x_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
            h = (h + r).to(newres_ptr.dtype.element_ty).to(tl.float32)
        n = (h * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + base + idx, (w * n).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "ROWS"])
def rlk_rms_norm_bwd(g_ptr, x_ptr, w_ptr, extra_ptr, dx_ptr, part_ptr, M, H, H_f, eps, ROWS,
                     HAS_EXTRA: tl.constexpr, SINGLE: tl.constexpr, BLOCK: tl.constexpr):
    tile = tl.program_id(0)
    first = tile.to(tl.int64) * ROWS
    last = tl.minimum(first + ROWS, M)
    cols = tl.arange(0, BLOCK)
    part_base = tile.to(tl.int64) * H
    if SINGLE:
        mask = cols < H
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for row in range(first, last):
            base = row * H
            h = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            gf = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            var = tl.div_rn(tl.sum(h * h, axis=0), H_f)
            rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
            nhat = h * rstd
            g = gf * w
            dot = tl.div_rn(tl.sum(g * nhat, axis=0), H_f)
            dx = rstd * (g - nhat * dot)
            if HAS_EXTRA:
                dx = dx + tl.load(extra_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += gf * nhat.to(dx_ptr.dtype.element_ty).to(tl.float32)
        tl.store(part_ptr + part_base + cols, dw, mask=mask)
    else:
        for row in range(first, last):
            base = row * H
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for c0 in range(0, H, BLOCK):
                idx = c0 + cols
                h = tl.load(x_ptr + base + idx, mask=idx < H, other=0.0).to(tl.float32)
                acc += h * h
            var = tl.div_rn(tl.sum(acc, axis=0), H_f)
            rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for c0 in range(0, H, BLOCK):
                idx = c0 + cols
                mask = idx < H
                h = tl.load(x_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
                gf = tl.load(g_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
                acc += (gf * w) * (h * rstd)
            dot = tl.div_rn(tl.sum(acc, axis=0), H_f)
            for c0 in range(0, H, BLOCK):
                idx = c0 + cols
                mask = idx < H
                h = tl.load(x_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
                gf = tl.load(g_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
                nhat = h * rstd
                dx = rstd * (gf * w - nhat * dot)
                if HAS_EXTRA:
                    dx = dx + tl.load(extra_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + base + idx, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                contrib = gf * nhat.to(dx_ptr.dtype.element_ty).to(tl.float32)
                # this tile's own partial row: the same thread reads back what it stored
                if row == first:
                    tl.store(part_ptr + part_base + idx, contrib, mask=mask)
                else:
                    prev = tl.load(part_ptr + part_base + idx, mask=mask, other=0.0)
                    tl.store(part_ptr + part_base + idx, prev + contrib, mask=mask)


@triton.jit(do_not_specialize=["TILES"])
def rlk_rms_norm_dw(part_ptr, dw_ptr, TILES, H, BLOCK_N: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < H
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ptrs = part_ptr + offs
    for _ in range(0, TILES):  # tile order
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += H
    tl.store(dw_ptr + offs, acc.to(dw_ptr.dtype.element_ty), mask=mask)


def _aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with a 16-byte aligned base (a copy if it is a view at an odd offset).

    Triton specialises pointer arguments on 16-byte alignment, and the specialisation may change
    the register layout and hence ``tl.sum``'s association order; with every base aligned, the
    compiled kernel (and a row's bits) depends only on ``H`` and the dtype."""
    if t is not None and t.data_ptr() % 16:
        return t.clone()
    return t


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter (TRITON_INTERPRET=1)
    return 2 * _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def forward(x2: torch.Tensor, weight: torch.Tensor, eps: float, residual2: torch.Tensor | None = None):
    """``y`` (and ``new_residual`` when ``residual2`` is given) for ``x2 [M, H]``."""
    M, H = x2.shape
    x2, weight, residual2 = _aligned(x2), _aligned(weight), _aligned(residual2)
    y = torch.empty_like(x2)
    new_res = torch.empty_like(x2) if residual2 is not None else None
    if M == 0:
        return y, new_res
    block, warps, _ = block_of(H)
    with device_guard(x2):
        rlk_rms_norm_fwd[(M,)](
            x2, residual2 if residual2 is not None else x2, weight, y, new_res if new_res is not None else y,
            M, H, float(H), float(eps), HAS_RES=residual2 is not None, BLOCK=block, num_warps=warps,
        )
    return y, new_res


def backward(grad2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, eps: float,
             extra2: torch.Tensor | None = None, *, rows_per_program: int | None = None):
    """``(dx, dweight)`` for ``grad2, x2 [M, H]`` (``extra2``: upstream grad added to ``dx``)."""
    M, H = x2.shape
    grad2, x2, weight, extra2 = _aligned(grad2), _aligned(x2), _aligned(weight), _aligned(extra2)
    dx = torch.empty_like(x2)
    if M == 0:
        return dx, torch.zeros_like(weight)
    block, warps, single = block_of(H)
    rows = rows_per_program or max(1, triton.cdiv(M, _programs(x2.device)))
    tiles = triton.cdiv(M, rows)
    part = torch.empty((tiles, H), dtype=torch.float32, device=x2.device)
    dw = torch.empty_like(weight)
    with device_guard(x2):
        rlk_rms_norm_bwd[(tiles,)](
            grad2, x2, weight, extra2 if extra2 is not None else grad2, dx, part, M, H, float(H), float(eps), rows,
            HAS_EXTRA=extra2 is not None, SINGLE=single, BLOCK=block, num_warps=warps,
        )
        rlk_rms_norm_dw[(triton.cdiv(H, 256),)](part, dw, tiles, H, BLOCK_N=256, num_warps=2)
    return dx, dw
