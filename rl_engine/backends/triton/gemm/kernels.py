"""Triton kernels and host launchers of ``gemm.linear``.

Importing this module imports triton (nothing is compiled until a launcher runs); the
registration module imports it lazily, on the first call.

Kernels (every launched name starts with ``rlk_``):

* ``rlk_linear_fwd``      ``y = x Wᵀ + b``: pointer loads, any strides;
* ``rlk_linear_fwd_tma``  the same arithmetic with TMA tensor-descriptor loads (Hopper+, 16-byte
  aligned strides) and TMA or pointer stores of the output (``rlk_store_tile``);
* ``rlk_linear_dx``       ``dx = dy W`` (the forward tile kernel on ``W`` read as ``[K, N]``);
* ``rlk_linear_dw``       ``dW = dyᵀ x``: the same tile kernel, reduction over the M rows in
  increasing order (no split-K, no atomics: deterministic run to run);
* ``rlk_linear_dbias``    ``db = Σ_rows dy`` in fp32, rows consumed in a fixed order.

All tile kernels share :func:`rlk_abt_tile` (``C = A Bᵀ`` with arbitrary strides), so forward, dx
and dW perform the same per-element arithmetic (see ``configs.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rl_engine.backends.triton import arch_of, device_guard
from rl_engine.backends.triton.gemm.configs import (TileConfig, select_forward, select_weight_grad, tail_config,
                                                    tail_split)

__all__ = ["forward", "grad_input", "grad_weight", "grad_bias", "KERNEL_NAMES", "DEVICE_FUNCTIONS", "tma_supported"]

#: Names of the kernels this module launches (the profiler test checks the prefix).
KERNEL_NAMES = ("rlk_linear_fwd", "rlk_linear_fwd_tma", "rlk_linear_fwd_tma_persistent", "rlk_linear_dx",
                "rlk_linear_dw", "rlk_linear_dbias")
#: ``@triton.jit`` device functions (inlined into the kernels above, never launched on their own).
DEVICE_FUNCTIONS = ("rlk_tile_coords", "rlk_tile_of", "rlk_abt_tile", "rlk_store_tile")

_I32_LIMIT = 2**31 - 1


@triton.jit
def rlk_tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id → (tile row, tile column), grouped along M for L2 reuse (order only)."""
    return rlk_tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def rlk_tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def rlk_abt_tile(a_ptr, b_ptr, c_ptr, bias_ptr, acc_ptr, M, N, K,
              stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_accm,
              HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
              IEEE: tl.constexpr, INDEX_64: tl.constexpr, ACC_IN: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """``C[m, n] = Σ_k A[m, k] B[n, k] (+ bias[n])``, fp32 accumulation from k = 0 upwards.

    ``ACC_IN``: the fp32 accumulator starts from ``acc[m, n]`` (unit column stride) instead of
    +0 — the continuation of a product whose earlier K chunks were stored unrounded there
    (``grad_input(..., acc=, partial=)``)."""
    pid_m, pid_n = rlk_tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    # Rows/columns past the edge load row/column 0 instead (always valid memory) and are never
    # stored: an output element reads only its own row of A and its own row of B. When the tile
    # divides M (N) there is no such row (column): the offsets stay a plain arange, whose
    # contiguity the compiler can see. (A ``tl.where`` hides it: in dx and dW the operand whose
    # contiguous dimension is M or N then falls back to scalar 2-byte loads without cp.async —
    # the fused LM head's dx/dW products run ~20x slower on the H200.) Loads only: the arithmetic
    # of every stored element is unchanged.
    if EVEN_M:
        ld_m = offs_m
    else:
        ld_m = tl.where(offs_m < M, offs_m, 0)
    if EVEN_N:
        ld_n = offs_n
    else:
        ld_n = tl.where(offs_n < N, offs_n, 0)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + ld_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + ld_n[None, :] * stride_bn
    if ACC_IN:
        acc = tl.load(acc_ptr + offs_m[:, None] * stride_accm + offs_n[None, :],
                      mask=(offs_m[:, None] < M) & (offs_n[None, :] < N), other=0.0)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M", "N"])
def rlk_linear_fwd(a_ptr, b_ptr, c_ptr, bias_ptr, acc_ptr, M, N, K,
                   stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_accm,
                   HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                   IEEE: tl.constexpr, INDEX_64: tl.constexpr, ACC_IN: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    rlk_abt_tile(a_ptr, b_ptr, c_ptr, bias_ptr, acc_ptr, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, stride_cm,
              stride_cn, stride_accm, HAS_BIAS, EVEN_K, EVEN_M, EVEN_N, IEEE, INDEX_64, ACC_IN, BLOCK_M, BLOCK_N,
              BLOCK_K, GROUP_M)


@triton.jit(do_not_specialize=["M"])
def rlk_linear_dx(a_ptr, b_ptr, c_ptr, bias_ptr, acc_ptr, M, N, K,
                  stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_accm,
                  HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                  IEEE: tl.constexpr, INDEX_64: tl.constexpr, ACC_IN: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    rlk_abt_tile(a_ptr, b_ptr, c_ptr, bias_ptr, acc_ptr, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, stride_cm,
              stride_cn, stride_accm, HAS_BIAS, EVEN_K, EVEN_M, EVEN_N, IEEE, INDEX_64, ACC_IN, BLOCK_M, BLOCK_N,
              BLOCK_K, GROUP_M)


@triton.jit(do_not_specialize=["K"])
def rlk_linear_dw(a_ptr, b_ptr, c_ptr, bias_ptr, acc_ptr, M, N, K,
                  stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_accm,
                  HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                  IEEE: tl.constexpr, INDEX_64: tl.constexpr, ACC_IN: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    rlk_abt_tile(a_ptr, b_ptr, c_ptr, bias_ptr, acc_ptr, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, stride_cm,
              stride_cn, stride_accm, HAS_BIAS, EVEN_K, EVEN_M, EVEN_N, IEEE, INDEX_64, ACC_IN, BLOCK_M, BLOCK_N,
              BLOCK_K, GROUP_M)


@triton.jit
def rlk_store_tile(c, off_m, off_n, tile, M, N, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   STORE_PTR: tl.constexpr):
    """Store a rounded output tile at ``(off_m, off_n)``: by TMA through the descriptor ``c``, or,
    with ``STORE_PTR``, through the pointer ``c`` (row stride ``stride_cm``, unit column stride),
    masked at rows ``M`` and columns ``N`` — for outputs whose row stride TMA cannot address (not
    a multiple of 16 bytes: a ragged N). The values stored are the same either way."""
    if STORE_PTR:
        offs_m = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        tl.store(c + offs_m[:, None] * stride_cm + offs_n[None, :], tile.to(c.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
    else:
        c.store([off_m, off_n], tile.to(c.dtype))


@triton.jit(do_not_specialize=["M", "N"])
def rlk_linear_fwd_tma(a_desc, b_desc, c_desc, bias_ptr, M, N, K, stride_cm,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STORE_PTR: tl.constexpr):
    """Same arithmetic as ``rlk_linear_fwd`` (K from 0 upwards, fp32 acc, bias in fp32, one
    rounding); tiles move by TMA, which zero-fills out-of-range rows, columns and the K tail.
    ``STORE_PTR``: ``c_desc`` is the output pointer (``rlk_store_tile``)."""
    pid_m, pid_n = rlk_tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, kk * BLOCK_K])
        b = b_desc.load([off_n, kk * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    if HAS_BIAS:
        offs_n = off_n + tl.arange(0, BLOCK_N)
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    rlk_store_tile(c_desc, off_m, off_n, acc, M, N, stride_cm, BLOCK_M, BLOCK_N, STORE_PTR)


@triton.jit(do_not_specialize=["M", "N", "NUM_PROGRAMS", "TILE0", "TILE1"])
def rlk_linear_fwd_tma_persistent(a_desc, b_desc, c_desc, bias_ptr, M, N, K, stride_cm, NUM_PROGRAMS, TILE0, TILE1,
                                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                                  FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                                  EPILOGUE_SUBTILE: tl.constexpr, SUB: tl.constexpr, STORE_PTR: tl.constexpr):
    """Persistent form of ``rlk_linear_fwd_tma``: NUM_PROGRAMS programs walk the output tiles;
    each tile is computed exactly as there (same K loop, same epilogue), only the schedule and
    the software pipeline across tiles differ. ``EPILOGUE_SUBTILE``: the rounded tile is stored
    as two column halves (``c_desc``'s block is ``[BLOCK_M, BLOCK_N/2]``): same values.

    The walk is over the schedule's tiles of ``BLOCK_M × SUB·BLOCK_N`` (numbered in
    ``rlk_tile_of``'s grouped order) ``TILE0 .. TILE1 - 1``, each computed as ``SUB`` column
    pieces of ``BLOCK_N``: ``SUB = 1`` is the whole launch (``TILE0 = 0``, ``TILE1`` every tile)
    or its full waves; ``SUB = 2`` the last wave's tiles as half-width tiles
    (``configs.tail_split``). A piece past column N is zero-filled on load and not stored.
    ``STORE_PTR``: ``c_desc`` is the output pointer (``rlk_store_tile``; no epilogue subtiles)."""
    num_tiles = (TILE1 - TILE0) * SUB
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        if SUB == 1:
            pid_m, pid_n = rlk_tile_of(TILE0 + tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            off_n = pid_n * BLOCK_N
        else:
            pid_m, pid_n = rlk_tile_of(TILE0 + tile // SUB, M, N, BLOCK_M, BLOCK_N * SUB, GROUP_M)
            off_n = (pid_n * SUB + tile % SUB) * BLOCK_N
        off_m = pid_m * BLOCK_M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            a = a_desc.load([off_m, kk * BLOCK_K])
            b = b_desc.load([off_n, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        if HAS_BIAS:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        if EPILOGUE_SUBTILE and not STORE_PTR:
            c0, c1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            c_desc.store([off_m, off_n], c0.to(c_desc.dtype))
            c_desc.store([off_m, off_n + BLOCK_N // 2], c1.to(c_desc.dtype))
        else:
            rlk_store_tile(c_desc, off_m, off_n, acc, M, N, stride_cm, BLOCK_M, BLOCK_N, STORE_PTR)


@triton.jit(do_not_specialize=["M"])
def rlk_linear_dbias(g_ptr, out_ptr, M, N, stride_gm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[n] = Σ_m g[m, n]``: fp32, BLOCK_M rows at a time from row 0 upwards, each block
    folded by the same fixed tree (``tl.sum``), then one rounding."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, M, BLOCK_M):
        rows = (start + offs_m).to(tl.int64)
        mask = (rows[:, None] < M) & (offs_n[None, :] < N)
        g = tl.load(g_ptr + rows[:, None] * stride_gm + offs_n[None, :], mask=mask, other=0.0)
        acc += tl.sum(g.to(tl.float32), axis=0)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=offs_n < N)


# ----------------------------------------------------------------------------------------------
# Host launchers


def _needs_i64(*tensors: torch.Tensor) -> bool:
    return any(t.numel() > _I32_LIMIT for t in tensors)


def _launch_abt(kernel, a, b, c, bias, M, N, K, sa, sb, sc, cfg: TileConfig, acc: torch.Tensor | None = None) -> None:
    """``c[:M, :N] = A Bᵀ (+bias)`` with ``A[m, k] = a[m*sa0 + k*sa1]``, ``B[n, k] = b[n*sb0 + k*sb1]``
    (``acc``: an fp32 ``[M, N]`` accumulator, unit column stride, to start from instead of +0)."""
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    kernel[grid](
        a, b, c, bias if bias is not None else c, acc if acc is not None else c, M, N, K,
        sa[0], sa[1], sb[0], sb[1], sc[0], sc[1], acc.stride(0) if acc is not None else 0,
        HAS_BIAS=bias is not None, EVEN_K=K % cfg.block_k == 0, EVEN_M=M % cfg.block_m == 0,
        EVEN_N=N % cfg.block_n == 0, IEEE=a.dtype == torch.float32,
        INDEX_64=_needs_i64(a, b, c, *(() if acc is None else (acc,))), ACC_IN=acc is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


@functools.lru_cache(maxsize=None)
def _tma_device(index: int) -> bool:
    return not torch.version.hip and torch.cuda.get_device_capability(index)[0] >= 9


def tma_supported(*tensors: torch.Tensor) -> bool:
    """TMA needs a Hopper+ CUDA device, a 16-byte aligned base, unit last stride and 16-byte
    aligned row strides."""
    if tensors[0].device.type != "cuda":
        return False
    index = tensors[0].device.index
    if not _tma_device(index if index is not None else torch.cuda.current_device()):
        return False
    return all(_tma_addressable(t) for t in tensors)


def _tma_addressable(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and not t.data_ptr() % 16 and not (t.stride(0) * t.element_size()) % 16


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def _output_arg(y: torch.Tensor, cfg: TileConfig, block_n: int, store_tma: bool):
    """The kernels' output argument and the configuration they run: a descriptor of ``y``'s
    ``[block_m, block_n]`` tiles, or (``store_tma=False``) ``y`` itself for pointer stores, with
    warp specialisation and epilogue subtiles off (both shape the TMA-store epilogue; the
    pointer store writes the tile from registers)."""
    if store_tma:
        return TensorDescriptor.from_tensor(y, [cfg.block_m, block_n]), cfg
    if cfg.warp_specialize or cfg.epilogue_subtile:
        cfg = dataclasses.replace(cfg, warp_specialize=False, epilogue_subtile=False)
    return y, cfg


def _launch_persistent(x, w, y, bias, cfg: TileConfig, programs: int, tile0: int, tile1: int, sub: int,
                       store_tma: bool = True) -> None:
    """One launch of ``rlk_linear_fwd_tma_persistent`` over the schedule's tiles ``tile0 ..
    tile1 - 1`` (tiles of ``block_m × sub·block_n``, each as ``sub`` pieces of ``cfg``'s tile)."""
    M, K = x.shape
    N = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    c, cfg = _output_arg(y, cfg, cfg.block_n // 2 if cfg.epilogue_subtile else cfg.block_n, store_tma)
    rlk_linear_fwd_tma_persistent[(programs,)](
        a_desc, b_desc, c, bias if bias is not None else y, M, N, K, y.stride(0), programs, tile0, tile1,
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, FLATTEN=not cfg.warp_specialize, WARP_SPECIALIZE=cfg.warp_specialize,
        EPILOGUE_SUBTILE=cfg.epilogue_subtile, SUB=sub, STORE_PTR=not store_tma, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _launch_tma(x, w, y, bias, cfg: TileConfig, programs: int | None = None, tail: bool = True,
                store_tma: bool = True) -> None:
    """TMA loads of ``x`` and ``w``; the output by TMA or (``store_tma=False``) by pointer stores.
    ``programs``: the persistent grid's size (default: the device's SM count); ``tail``: run a
    last wave that is at most half full as half-width tiles (``configs.tail_split``)."""
    M, K = x.shape
    N = w.shape[0]
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    if cfg.persistent:
        programs = programs or _sm_count(x.device)
        split = tail_split(tiles, programs) if tail else None
        if split is None:
            _launch_persistent(x, w, y, bias, cfg, min(tiles, programs), 0, tiles, 1, store_tma)
        else:
            _launch_persistent(x, w, y, bias, cfg, programs, 0, split, 1, store_tma)
            _launch_persistent(x, w, y, bias, tail_config(cfg), 2 * (tiles - split), split, tiles, 2, store_tma)
        return
    a_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    c, cfg = _output_arg(y, cfg, cfg.block_n, store_tma)
    rlk_linear_fwd_tma[(tiles,)](
        a_desc, b_desc, c, bias if bias is not None else y, M, N, K, y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, STORE_PTR=not store_tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _empty_or_bias(M: int, N: int, like: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    y = like.new_zeros((M, N), dtype=dtype or like.dtype)
    if bias is not None:
        y += bias
    return y


def forward(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, config: TileConfig | None = None,
            *, allow_tma: bool = True, programs: int | None = None, tail: bool = True,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = x Wᵀ + b`` for ``x [M, K]``, ``w [N, K]`` (``config``: force one configuration).

    Persistent configurations: ``programs`` sizes the grid (default: the device's SM count;
    tests set it to exercise ``configs.tail_split`` on small shapes); ``tail=False`` keeps a
    partly filled last wave in the one launch. Every choice gives the same bits.

    TMA configurations load ``x`` and ``w`` by TMA where both allow it (Hopper+, 16-byte
    aligned base and row stride) and store ``y`` by TMA where it allows it too; an output TMA
    cannot address (a ragged N: ``N·2`` bytes not a multiple of 16) is written by pointer stores
    from the same kernel. Otherwise the pointer-load kernel runs the configuration's tile.

    ``out_dtype=torch.float32`` with 16-bit ``x`` (the fp32-output variant): the fp32
    accumulator (bias added) is stored unrounded, by the pointer-load kernel with the
    configuration M selects (the TMA epilogue tiles are sized for 16-bit outputs)."""
    M, K = x.shape
    N = w.shape[0]
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs: expected a positive int (the persistent grid's size) or None, got {programs!r}")
    out_dtype = out_dtype or x.dtype
    if M == 0 or N == 0 or K == 0:
        return _empty_or_bias(M, N, x, bias, out_dtype)
    cfg = config or select_forward(x.dtype, M, N, arch_of(x.device))
    y = x.new_empty((M, N), dtype=out_dtype)
    with device_guard(x):
        if cfg.tma and allow_tma and x.dtype != torch.float32 and out_dtype == x.dtype and tma_supported(x, w):
            _launch_tma(x, w, y, bias, cfg, programs, tail, store_tma=_tma_addressable(y))
        else:
            _launch_abt(rlk_linear_fwd, x, w, y, bias, M, N, K, x.stride(), w.stride(), y.stride(), cfg)
    return y


def grad_input(g: torch.Tensor, w: torch.Tensor, config: TileConfig | None = None, *,
               acc: torch.Tensor | None = None, out: torch.Tensor | None = None, partial: bool = False) -> torch.Tensor:
    """``dx = dy W`` for ``dy [M, N]``, ``w [N, K]``: A = dy, B[k, n] = W[n, k].

    **Chained over N** (the fused LM head's backward: one vocabulary chunk of ``dy`` and ``W``
    at a time): ``partial=True`` stores the unrounded fp32 accumulator into ``out`` (fp32
    ``[M, K]``, contiguous) instead of the result; ``acc`` (that buffer) makes the next call
    start from it instead of +0; the last chunk is called with ``acc`` and without ``partial``.
    The tiles consume N from the chunk's first column in ``BLOCK_K`` steps (16 products per
    tensor-core instruction, in order), so when every chunk but the last has a multiple of
    ``BLOCK_K`` columns the chained calls perform exactly the operations of one call over the
    concatenated N (the fp32 store and reload are exact): raw-bit equal (GPU test
    ``test_grad_input_chained_over_n_is_one_product``). A partial chunk of another width is
    refused: its zero-padded tail would add ``+0`` products that the one-call product does not
    have, and ``-0 + +0`` is ``+0``."""
    M, N = g.shape
    K = w.shape[1]
    cfg = config or select_forward(g.dtype, M, K, arch_of(g.device))
    if cfg.tma:  # the dx orientation reads W transposed: pointer loads, same tile shape
        cfg = dataclasses.replace(cfg, tma=False, persistent=False, warp_specialize=False)
    for name, t in (("acc", acc), ("out", out)):
        if t is not None and (tuple(t.shape) != (M, K) or not t.is_contiguous() or t.device != g.device):
            raise ValueError(f"{name}: expected a contiguous [{M}, {K}] tensor on {g.device}, got "
                             f"{tuple(t.shape)} (contiguous={t.is_contiguous()}) on {t.device}")
    if acc is not None and acc.dtype != torch.float32:
        raise ValueError(f"acc: expected float32 (the unrounded accumulator), got {acc.dtype}")
    if partial:
        if out is None or out.dtype != torch.float32:
            raise ValueError("partial=True: expected out= an fp32 [M, K] accumulator buffer")
        if N % cfg.block_k:
            raise ValueError(f"partial chunk: expected a multiple of BLOCK_K = {cfg.block_k} columns of dy, got {N}")
    elif out is not None and out.dtype != g.dtype:
        raise ValueError(f"out: expected {g.dtype} (the result; partial=False), got {out.dtype}")
    dx = out if out is not None else g.new_empty((M, K))
    if M == 0 or K == 0:
        return dx
    if N == 0:
        return dx.copy_(acc) if acc is not None else dx.zero_()
    with device_guard(g):
        _launch_abt(rlk_linear_dx, g, w, dx, None, M, K, N, g.stride(), (w.stride(1), w.stride(0)), dx.stride(), cfg,
                    acc=acc)
    return dx


def grad_weight(g: torch.Tensor, x: torch.Tensor, config: TileConfig | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``dW = dyᵀ x`` for ``dy [M, N]``, ``x [M, K]``: A[n, m] = dy[m, n], B[k, m] = x[m, k].

    ``out``: a contiguous ``[N, K]`` tensor of ``dy``'s dtype to write ``dW`` into (the fused LM
    head's backward passes its rows of the whole ``[V, H]`` gradient, so that no ``[chunk, H]``
    block is held beside it); the kernel and its bits are the same either way."""
    M, N = g.shape
    K = x.shape[1]
    if out is not None and (tuple(out.shape) != (N, K) or not out.is_contiguous() or out.device != g.device
                            or out.dtype != g.dtype):
        raise ValueError(f"out: expected a contiguous [{N}, {K}] {g.dtype} tensor on {g.device}, got "
                         f"{tuple(out.shape)} {out.dtype} (contiguous={out.is_contiguous()}) on {out.device}")
    if M == 0 or N == 0 or K == 0:
        return out.zero_() if out is not None else g.new_zeros((N, K))
    cfg = config or select_weight_grad(g.dtype, arch_of(g.device))
    dw = out if out is not None else g.new_empty((N, K))
    with device_guard(g):
        _launch_abt(rlk_linear_dw, g, x, dw, None, N, K, M, (g.stride(1), g.stride(0)), (x.stride(1), x.stride(0)),
                    dw.stride(), cfg)
    return dw


def grad_bias(g: torch.Tensor) -> torch.Tensor:
    """``db = Σ_rows dy`` (fp32 accumulation in a fixed order, one rounding)."""
    M, N = g.shape
    db = g.new_empty((N,))
    if N == 0:
        return db
    if M == 0:
        return db.zero_()
    block_n = 128
    with device_guard(g):
        rlk_linear_dbias[(triton.cdiv(N, block_n),)](g, db, M, N, g.stride(0), BLOCK_M=64, BLOCK_N=block_n, num_warps=4)
    return db
