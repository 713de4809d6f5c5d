"""Triton kernels and host launchers of the mixture-of-experts operators (imported on first call).

Kernels (every launched name starts with ``rlk_``):

* ``rlk_moe_route_fwd`` / ``rlk_moe_route_bwd`` — one program per token row: fp32 softmax of the
  logits, the ``K`` largest logits by repeated ``argmax`` (ties to the lower expert id), the
  renormalisation in rank order; the backward of the same formulas;
* ``rlk_moe_grouped_gemm`` — ``C[c(s)] = round((scale(s) ·) fp32(A[a(s)] · W[e(s)]ᵀ))`` over the
  slots sorted by expert (:func:`~rl_engine.utils.routing.expert_permutation`): each program
  takes ``BLOCK_M`` slots of **one** expert and ``BLOCK_N`` output features and runs the K loop
  from 0 upwards in fp32 (``tl.dot``; IEEE fp32 products for fp32 operands). No split-K and no
  atomics: a slot's row is a function of its own row and its expert's weight, whatever the
  expert's load;
* ``rlk_moe_wgrad`` — ``dW[e] = Σ_{slots of e} round(scale · L[l(s)])ᵀ R[r(s)]`` (or ``L[l(s)]ᵀ R[r(s)]``),
  one program per (expert, output tile), the slots in canonical order (deterministic run to run);
* ``rlk_moe_combine`` — per token ``acc = w_0 y_0; acc = acc + w_j y_j`` in rank order (or the
  plain rank-order sum), one rounding;
* ``rlk_moe_slot_dot`` — per slot ``Σ_h g[t, h] · y[s, h]`` (the routing weights' gradient).

Each GEMM role takes its tile configuration from the tile table (``tiles.py``), unless the
caller forces one (``cfg``). The elementwise kernels are compiled with ``enable_fp_fusion=False``: products and sums are
separate IEEE operations, as the contracts state. The expert tiles are mapped to programs by
tables built on the device (``torch.searchsorted`` over the cumulative tile counts): no host
synchronisation, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rl_engine.backends.triton import device_guard
from rl_engine.backends.triton.activation import kernels as act_kernels
from rl_engine.backends.triton.moe.tiles import GemmConfig, select

__all__ = ["KERNEL_NAMES", "DEVICE_FUNCTIONS", "GemmConfig", "route_forward", "route_backward", "gate_up_forward", "gate_up_forward_saving", "gate_up_backward",
           "down_combine_forward", "down_combine_backward"]

KERNEL_NAMES = ("rlk_moe_route_fwd", "rlk_moe_route_bwd", "rlk_moe_grouped_gemm", "rlk_moe_wgrad", "rlk_moe_combine",
                "rlk_moe_slot_dot")
#: ``@triton.jit`` device functions (inlined into the kernels above, never launched on their own).
DEVICE_FUNCTIONS = ("rlk_moe_softmax",)
_NO_FMA = {"enable_fp_fusion": False}


# --------------------------------------------------------------------------------------------- router


@triton.jit
def rlk_moe_softmax(z_ptr, row, E, BLOCK_E: tl.constexpr):
    cols = tl.arange(0, BLOCK_E)
    m = cols < E
    z = tl.load(z_ptr + row * E + cols, mask=m, other=-float("inf")).to(tl.float32)
    u = tl.where(m, tl.exp(z - tl.max(z, axis=0)), 0.0)
    return z, tl.div_rn(u, tl.sum(u, axis=0)), cols


@triton.jit(do_not_specialize=["T"])
def rlk_moe_route_fwd(z_ptr, w_ptr, ids_ptr, T, E, K: tl.constexpr, RENORM: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z, p, cols = rlk_moe_softmax(z_ptr, row, E, BLOCK_E)
    ranks = tl.arange(0, BLOCK_K)
    picked = tl.zeros((BLOCK_K,), dtype=tl.float32)
    s = 0.0
    for j in tl.static_range(K):
        idx = tl.argmax(z, axis=0, tie_break_left=True)
        pj = tl.sum(tl.where(cols == idx, p, 0.0), axis=0)
        tl.store(ids_ptr + row * K + j, idx.to(tl.int64))
        picked = tl.where(ranks == j, pj, picked)
        s = s + pj
        z = tl.where(cols == idx, -float("inf"), z)
    if RENORM:
        picked = tl.div_rn(picked, s)
    tl.store(w_ptr + row * K + ranks, picked, mask=ranks < K)


@triton.jit(do_not_specialize=["T"])
def rlk_moe_route_bwd(z_ptr, ids_ptr, g_ptr, dz_ptr, T, E, K: tl.constexpr, RENORM: tl.constexpr,
                      BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z, p, cols = rlk_moe_softmax(z_ptr, row, E, BLOCK_E)
    s = 0.0
    for j in tl.static_range(K):
        idx = tl.load(ids_ptr + row * K + j)
        s = s + tl.sum(tl.where(cols == idx, p, 0.0), axis=0)
    c = 0.0
    if RENORM:
        for j in tl.static_range(K):
            idx = tl.load(ids_ptr + row * K + j)
            pj = tl.sum(tl.where(cols == idx, p, 0.0), axis=0)
            c = c + tl.load(g_ptr + row * K + j) * tl.div_rn(pj, s)
    dp = tl.zeros((BLOCK_E,), dtype=tl.float32)
    inner = 0.0
    for j in tl.static_range(K):
        idx = tl.load(ids_ptr + row * K + j)
        pj = tl.sum(tl.where(cols == idx, p, 0.0), axis=0)
        gj = tl.load(g_ptr + row * K + j)
        if RENORM:
            dpj = tl.div_rn(gj - c, s)
        else:
            dpj = gj
        inner = inner + pj * dpj
        dp = tl.where(cols == idx, dpj, dp)
    dz = p * (dp - inner)
    tl.store(dz_ptr + row * E + cols, dz.to(dz_ptr.dtype.element_ty), mask=cols < E)


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def route_forward(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, K] fp32, ids [T, K] int64)`` of ``logits [T, E]``."""
    T, E = logits.shape
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T:
        with device_guard(logits):
            rlk_moe_route_fwd[(T,)](logits, w, ids, T, E, K=top_k, RENORM=renormalize, BLOCK_E=_pow2(E),
                                    BLOCK_K=_pow2(top_k), num_warps=4, **_NO_FMA)
    return w, ids


def route_backward(grad: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """``dlogits [T, E]`` in ``logits.dtype`` from the weights' gradient ``grad [T, K]`` (fp32)."""
    T, E = logits.shape
    dz = torch.empty_like(logits)
    if T:
        with device_guard(logits):
            rlk_moe_route_bwd[(T,)](logits, ids, grad, dz, T, E, K=ids.shape[1], RENORM=renormalize,
                                    BLOCK_E=_pow2(E), num_warps=4, **_NO_FMA)
    return dz


# --------------------------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class _Perm:
    """The canonical slot order of one call (:func:`~rl_engine.utils.routing.expert_permutation`)."""

    order: torch.Tensor  # [S] slot ids sorted by expert, then slot id
    tokens: torch.Tensor  # [S] the token of each sorted slot
    offsets: torch.Tensor  # [E+1] the first sorted position of each expert
    counts: torch.Tensor  # [E] slots per expert
    slots_per_expert: float  # S / E, known on the host: what the tile table is keyed by


@dataclass(frozen=True)
class _Tiles:
    """The map from programs to (expert, block of ``block_m`` of its slots), built on the device."""

    tile_cum: torch.Tensor  # [E+1] cumulative tile counts
    tile_expert: torch.Tensor  # [max_tiles] the expert of each program
    max_tiles: int


def _perm(ids: torch.Tensor, num_experts: int) -> _Perm:
    from rl_engine.utils.routing import expert_permutation

    p = expert_permutation(ids, num_experts)
    return _Perm(p.order, p.tokens, p.offsets, p.counts, ids.numel() / max(num_experts, 1))


def _tiles(perm: _Perm, block_m: int) -> _Tiles:
    E = perm.counts.shape[0]
    dev = perm.counts.device
    tiles = torch.div(perm.counts + (block_m - 1), block_m, rounding_mode="floor")
    tile_cum = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    tile_cum[1:] = torch.cumsum(tiles, 0)
    max_tiles = triton.cdiv(perm.order.numel(), block_m) + E  # each expert adds at most one partial tile
    pid = torch.arange(max_tiles, dtype=torch.int64, device=dev)
    tile_expert = torch.searchsorted(tile_cum[1:], pid, right=True).clamp_max_(E - 1)
    return _Tiles(tile_cum, tile_expert, max_tiles)


def _config(role: str, dtype: torch.dtype, perm: _Perm, device: torch.device, cfg: GemmConfig | None) -> GemmConfig:
    """``cfg`` when the caller forces one, else the tile table's entry for ``role`` (``tiles.py``)."""
    return cfg if cfg is not None else select(role, dtype, perm.slots_per_expert, device)


# --------------------------------------------------------------------------------------------- GEMMs


@triton.jit
def rlk_moe_grouped_gemm(a_ptr, a_rows_ptr, scale_ptr, w_ptr, c_ptr, c_rows_ptr, tile_expert_ptr, tile_cum_ptr,
                         offsets_ptr, E, N, KD,
                         stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
                         SCALE_OUT: tl.constexpr, IEEE: tl.constexpr, MASKED_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    if pid < tl.load(tile_cum_ptr + E):
        e = tl.load(tile_expert_ptr + pid)
        row0 = tl.load(offsets_ptr + e) + (pid - tl.load(tile_cum_ptr + e)) * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < tl.load(offsets_ptr + e + 1)
        a_rows = tl.load(a_rows_ptr + rows, mask=rmask, other=0)  # masked rows read row 0, never stored
        c_rows = tl.load(c_rows_ptr + rows, mask=rmask, other=0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        ld_n = tl.where(nmask, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
        for k0 in range(0, KD, BLOCK_K):
            kmask = (k0 + offs_k) < KD
            a = tl.load(a_base + (k0 + offs_k)[None, :] * stride_ak, mask=kmask[None, :], other=0.0)
            if MASKED_N:  # columns past N masked, not clamped: the contiguous offsets stay provably contiguous
                b = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk,
                            mask=kmask[:, None] & nmask[None, :], other=0.0)
            else:  # columns past N read column 0 (never stored)
                b = tl.load(w_base + ld_n[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk,
                            mask=kmask[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if SCALE_OUT:  # the routing weight scales the fp32 result: one product, then the rounding
            acc = acc * tl.load(scale_ptr + c_rows, mask=rmask, other=0.0)[:, None]
        c = c_ptr + c_rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def _grouped(a: torch.Tensor, a_rows: torch.Tensor, w: torch.Tensor, n: int, kd: int, out: torch.Tensor,
             perm: _Perm, cfg: GemmConfig, *, transposed: bool = False,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[order[s]] = (scale[order[s]] ·) a[a_rows[s]] · B[e(s)]`` over the sorted slots ``s``.

    ``B[e]`` is ``W[e]ᵀ`` (``w [E, n, kd]``, the forward) or, with ``transposed``, ``W[e]``
    itself (``w [E, kd, n]``: the input gradients). A transposed product reads ``W[e]`` with
    its rows as the reduction dimension; ``cfg.w_transposed`` makes a contiguous ``[E, n, kd]``
    copy first so that both orientations load the same tile layout (the tile table says which
    is faster). Either way the kernel multiplies the same values in the same order: the same
    bits. ``scale`` multiplies the fp32 result before its rounding to ``out.dtype``."""
    if a_rows.numel() == 0:
        return out
    if transposed and cfg.w_transposed:
        w, transposed = w.transpose(1, 2).contiguous(), False
    strides = (w.stride(0), w.stride(2), w.stride(1)) if transposed else (w.stride(0), w.stride(1), w.stride(2))
    tiles = _tiles(perm, cfg.block_m)
    ieee = torch.float32 in (a.dtype, w.dtype)
    grid = (tiles.max_tiles, triton.cdiv(n, cfg.block_n))
    with device_guard(a):
        rlk_moe_grouped_gemm[grid](
            a, a_rows, scale if scale is not None else a, w, out, perm.order, tiles.tile_expert, tiles.tile_cum,
            perm.offsets, perm.counts.shape[0], n, kd, a.stride(0), a.stride(1), *strides, out.stride(0),
            out.stride(1), SCALE_OUT=scale is not None, IEEE=ieee, MASKED_N=cfg.masked_loads, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


@triton.jit
def rlk_moe_wgrad(l_ptr, l_rows_ptr, scale_ptr, scale_rows_ptr, r_ptr, r_rows_ptr, dw_ptr, offsets_ptr, N1, N2,
                  stride_lm, stride_ln, stride_rm, stride_rk, stride_we, stride_wn, stride_wk,
                  HAS_SCALE: tl.constexpr, SORTED: tl.constexpr, IEEE: tl.constexpr, MASKED_N: tl.constexpr,
                  BLOCK_N1: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_S: tl.constexpr):
    e = tl.program_id(1).to(tl.int64)
    tiles_n2 = tl.cdiv(N2, BLOCK_N2)
    n1 = (tl.program_id(0) // tiles_n2) * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    n2 = (tl.program_id(0) % tiles_n2) * BLOCK_N2 + tl.arange(0, BLOCK_N2)
    m1 = n1 < N1
    m2 = n2 < N2
    ld1 = tl.where(m1, n1, 0)
    ld2 = tl.where(m2, n2, 0)
    s0 = tl.load(offsets_ptr + e)
    s1 = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_N1, BLOCK_N2), dtype=tl.float32)
    for base in range(s0, s1, BLOCK_S):  # the expert's slots in canonical order
        slots = base + tl.arange(0, BLOCK_S)
        sm = slots < s1
        if SORTED:  # the operands were gathered into the sorted slot order: row = sorted position
            lr = slots.to(tl.int64)
            rr = lr
        else:
            lr = tl.load(l_rows_ptr + slots, mask=sm, other=0).to(tl.int64)
            rr = tl.load(r_rows_ptr + slots, mask=sm, other=0).to(tl.int64)
        if MASKED_N:  # features past N1 / N2 masked, not clamped (see rlk_moe_grouped_gemm)
            lt = tl.load(l_ptr + lr[None, :] * stride_lm + n1[:, None] * stride_ln, mask=sm[None, :] & m1[:, None],
                         other=0.0)
            rt = tl.load(r_ptr + rr[:, None] * stride_rm + n2[None, :] * stride_rk, mask=sm[:, None] & m2[None, :],
                         other=0.0)
        else:
            lt = tl.load(l_ptr + lr[None, :] * stride_lm + ld1[:, None] * stride_ln, mask=sm[None, :], other=0.0)
            rt = tl.load(r_ptr + rr[:, None] * stride_rm + ld2[None, :] * stride_rk, mask=sm[:, None], other=0.0)
        if HAS_SCALE:  # round(w · g) in the operands' dtype: one fp32 product, one rounding
            if SORTED:
                sc = tl.load(scale_ptr + slots, mask=sm, other=0.0)
            else:
                sc = tl.load(scale_ptr + tl.load(scale_rows_ptr + slots, mask=sm, other=0), mask=sm, other=0.0)
            lt = (lt.to(tl.float32) * sc[None, :]).to(l_ptr.dtype.element_ty)
        if IEEE:
            acc = tl.dot(lt, rt, acc, input_precision="ieee")
        else:
            acc = tl.dot(lt, rt, acc)
    out = dw_ptr + e * stride_we + n1[:, None] * stride_wn + n2[None, :] * stride_wk
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=m1[:, None] & m2[None, :])


def _wgrad(left: torch.Tensor, l_rows: torch.Tensor, right: torch.Tensor, r_rows: torch.Tensor, dw: torch.Tensor,
           perm: _Perm, cfg: GemmConfig, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``dw[e] = Σ_{slots s of e} round(scale[order[s]] · left[l_rows[s]])ᵀ right[r_rows[s]]`` (``dw [E, N1, N2]``;
    without ``scale``, ``left[l_rows[s]]`` as is). ``cfg.sorted_operands`` gathers both operands (and the
    scale) into the sorted slot order first, so the kernel's loads follow the slot index instead of an
    index table; the same values meet in the same order: the same bits."""
    E, N1, N2 = dw.shape
    ieee = torch.float32 in (left.dtype, right.dtype)
    sorted_ = cfg.sorted_operands
    if sorted_:
        left, right = left.index_select(0, l_rows), right.index_select(0, r_rows)
        scale = scale.index_select(0, perm.order) if scale is not None else None
        l_rows = r_rows = perm.order  # unread
    grid = (triton.cdiv(N1, cfg.block_m) * triton.cdiv(N2, cfg.block_n), E)
    with device_guard(dw):
        rlk_moe_wgrad[grid](left, l_rows, scale if scale is not None else left, perm.order, right, r_rows, dw,
                            perm.offsets, N1, N2, left.stride(0), left.stride(1), right.stride(0), right.stride(1),
                            dw.stride(0), dw.stride(1), dw.stride(2), HAS_SCALE=scale is not None, SORTED=sorted_,
                            IEEE=ieee, MASKED_N=cfg.masked_loads, BLOCK_N1=cfg.block_m, BLOCK_N2=cfg.block_n,
                            BLOCK_S=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dw


# --------------------------------------------------------------------------------------------- per token


@triton.jit(do_not_specialize=["T"])
def rlk_moe_combine(y_ptr, w_ptr, out_ptr, T, H, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    acc = tl.load(y_ptr + (t * K) * H + cols, mask=m, other=0.0)
    if HAS_W:
        acc = tl.load(w_ptr + t * K) * acc
    for j in tl.static_range(1, K):
        y = tl.load(y_ptr + (t * K + j) * H + cols, mask=m, other=0.0)
        if HAS_W:
            y = tl.load(w_ptr + t * K + j) * y
        acc = acc + y
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def _combine(y: torch.Tensor, weights: torch.Tensor | None, T: int, K: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = round(Σ_j (w[t, j] ·) y[t·K + j])`` in rank order; ``y [T·K, H]`` fp32."""
    H = y.shape[1]
    out = torch.empty((T, H), dtype=out_dtype, device=y.device)
    if T and H:
        with device_guard(y):
            rlk_moe_combine[(T, triton.cdiv(H, 1024))](y, weights if weights is not None else y, out, T, H, K=K,
                                                      HAS_W=weights is not None, BLOCK_H=1024, num_warps=4, **_NO_FMA)
    return out


@triton.jit(do_not_specialize=["S"])
def rlk_moe_slot_dot(g_ptr, y_ptr, out_ptr, S, H, K, BLOCK_H: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    t = s // K
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = cols < H
        g = tl.load(g_ptr + t * H + cols, mask=m, other=0.0).to(tl.float32)
        acc = acc + g * tl.load(y_ptr + s * H + cols, mask=m, other=0.0)
    tl.store(out_ptr + s, tl.sum(acc, axis=0))


# --------------------------------------------------------------------------------------------- operators


def _gate_up_h(x, w_gate_up, perm, cfg):
    h = torch.empty((perm.order.numel(), w_gate_up.shape[1]), dtype=x.dtype, device=x.device)
    return _grouped(x, perm.tokens, w_gate_up, w_gate_up.shape[1], x.shape[1], h, perm, cfg)


def gate_up_forward(x: torch.Tensor, w_gate_up: torch.Tensor, ids: torch.Tensor,
                    cfg: GemmConfig | None = None) -> torch.Tensor:
    """``act [T, K, I]``: the slots' gate/up GEMM rounded to ``x.dtype``, then ``silu_and_mul``.
    ``cfg`` forces one tile configuration for every GEMM (default: the tile table, ``tiles.py``)."""
    return gate_up_forward_saving(x, w_gate_up, ids, cfg)[0]


def gate_up_forward_saving(x: torch.Tensor, w_gate_up: torch.Tensor, ids: torch.Tensor,
                           cfg: GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act [T, K, I], h [T·K, 2I])``: :func:`gate_up_forward` and the GEMM result it activates
    (slot order, ``x.dtype``), which :func:`gate_up_backward` takes instead of recomputing it."""
    T, K = ids.shape
    perm = _perm(ids, w_gate_up.shape[0])
    h = _gate_up_h(x, w_gate_up, perm, _config("gate_up", x.dtype, perm, x.device, cfg))
    return act_kernels.forward(h).view(T, K, w_gate_up.shape[1] // 2), h


def gate_up_backward(grad: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, ids: torch.Tensor,
                     cfg: GemmConfig | None = None, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dW_gate_up)``: ``dx[t] = round(Σ_j dh[t, j] W[e])`` in rank order, ``dW[e] = Σ dhᵀ x``.
    ``h``: the forward's GEMM result (:func:`gate_up_forward_saving`); recomputed when absent (the
    same kernel on the same operands: the same bits)."""
    T, K = ids.shape
    E, N2, H = w_gate_up.shape
    perm = _perm(ids, E)
    if h is None:
        h = _gate_up_h(x, w_gate_up, perm, _config("gate_up", x.dtype, perm, x.device, cfg))
    dh = act_kernels.backward(grad.reshape(T * K, N2 // 2).contiguous(), h)
    dx_slots = torch.empty((T * K, H), dtype=torch.float32, device=x.device)
    _grouped(dh, perm.order, w_gate_up, H, N2, dx_slots, perm, _config("dx", x.dtype, perm, x.device, cfg),
             transposed=True)
    # the weight-gradient kernel stores every tile of every expert (zeros where an expert got no slot)
    dw = torch.empty_like(w_gate_up) if T * K else torch.zeros_like(w_gate_up)
    if T * K:
        _wgrad(dh, perm.order, x, perm.tokens, dw, perm, _config("dw_gate_up", x.dtype, perm, x.device, cfg))
    return _combine(dx_slots, None, T, K, x.dtype), dw


def _slot_outputs(act, w_down, perm, cfg):
    T, K, I = act.shape
    y = torch.empty((T * K, w_down.shape[1]), dtype=torch.float32, device=act.device)
    return _grouped(act.reshape(T * K, I), perm.order, w_down, w_down.shape[1], I, y, perm, cfg)


def down_combine_forward(act: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         cfg: GemmConfig | None = None) -> torch.Tensor:
    """``out[t] = round(Σ_j w[t, j] · fp32(act[t, j] W_down[e]ᵀ))`` in rank order."""
    T, K, _ = act.shape
    perm = _perm(ids, w_down.shape[0])
    y = _slot_outputs(act, w_down, perm, _config("down", act.dtype, perm, act.device, cfg))
    return _combine(y, weights, T, K, act.dtype)


def down_combine_backward(grad: torch.Tensor, act: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                          ids: torch.Tensor, cfg: GemmConfig | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dact, dW_down, dweights)`` (contract ``moe.expert_down_combine``, version 2):
    ``dact[s] = round(w_s · fp32(g[t] W_down[e]))``, ``dW_down[e] = Σ_s round(w_s · g[t])ᵀ act[s]``,
    ``dweights[s] = Σ_h g[t, h] y[s, h]``."""
    T, K, I = act.shape
    E, H, _ = w_down.shape
    perm = _perm(ids, E)
    g = grad.to(act.dtype)
    y = _slot_outputs(act, w_down, perm, _config("down", act.dtype, perm, act.device, cfg))
    dweights = torch.empty((T, K), dtype=torch.float32, device=act.device)
    if T * K:
        with device_guard(act):
            rlk_moe_slot_dot[(T * K,)](g, y, dweights, T * K, H, K, BLOCK_H=1024, num_warps=4, **_NO_FMA)
    w_flat = weights.reshape(-1).contiguous()
    dact = torch.empty((T * K, I), dtype=act.dtype, device=act.device)
    _grouped(g, perm.tokens, w_down, I, H, dact, perm, _config("dact", act.dtype, perm, act.device, cfg),
             transposed=True, scale=w_flat)
    dw = torch.empty_like(w_down) if T * K else torch.zeros_like(w_down)
    if T * K:
        _wgrad(g, perm.tokens, act.reshape(T * K, I), perm.order, dw, perm,
               _config("dw_down", act.dtype, perm, act.device, cfg), scale=w_flat)
    return dact.view(T, K, I), dw, dweights
