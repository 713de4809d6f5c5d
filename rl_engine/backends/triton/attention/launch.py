"""Host launchers of ``attention.varlen_attention`` / ``attention.cached_attention``: the forward of
every path (``attend``, behind ``varlen_forward`` for the train path and ``cached_forward`` for
the rollout path), the backward (``varlen_backward``) and the query-tile tables (``tile_table``,
its one-launch builders ``rollout_tiles`` and ``varlen_tiles``).

Importing this module imports triton and the portable kernels (nothing is compiled until a
launcher runs); the registration module (``__init__.py``) imports it on the first call. The
Hopper kernels' modules (Gluon) are imported by the first launch that runs them. The launchers
read the tile tables and selection rules of ``configs``, the variant rules of ``eligibility`` and
the switches of ``tuning.current_tuning()`` at the call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton

from rl_engine.backends.triton import arch_of, device_guard
from rl_engine.backends.triton.attention import configs, eligibility
from rl_engine.backends.triton.attention.configs import COMBINE_COLUMNS, KV_BLOCK, AttnConfig, Variant
from rl_engine.backends.triton.attention.portable_backward import rlk_attn_bwd_delta, rlk_attn_bwd_dkdv, rlk_attn_bwd_dq
from rl_engine.backends.triton.attention.portable_forward import rlk_attn_fwd, rlk_attn_fwd_split
from rl_engine.backends.triton.attention.split_kv_combine import rlk_attn_combine
from rl_engine.backends.triton.attention.tile_tables import rlk_attn_tiles, rlk_attn_varlen_tiles
from rl_engine.backends.triton.attention.tuning import current_tuning

__all__ = [
    "OneTokenTiles",
    "tile_table",
    "key_table",
    "varlen_rows",
    "cached_rows",
    "rollout_tiles",
    "varlen_tiles",
    "attend",
    "kv_descriptors",
    "varlen_forward",
    "cached_forward",
    "varlen_backward",
]

_NO_PAGES = 1 << 62


@dataclass(frozen=True)
class OneTokenTiles:
    """The tiles of a decode step with exactly one query token per sequence: tile ``i`` is token
    ``i`` of sequence ``i`` at position ``q_pos[i]`` (``[B]`` int64 on the device). The kernels form
    tile ``i``'s table row ``[i, i·G, i·G + G, i - q_pos[i]]`` themselves
    (``rlk_attn_rows(ONE=True)``; needs ``G <= BLOCK_M``): no tile table is built."""

    q_pos: torch.Tensor


# ----------------------------------------------------------------------------------------------
# Tile tables


def tile_table(counts: torch.Tensor, tok_start: torch.Tensor, pos_base: torch.Tensor, group: int, rows: int,
               num_tokens: int) -> torch.Tensor:
    """Query tiles as an int64 ``[NT_max, 4]`` table ``[seq, unit0, unit1, pos_base]`` (torch ops on
    the device, no host sync): the definition that ``varlen_tiles`` and ``rollout_tiles`` (one
    launch each) are tested against, and ``attend``'s default when no table is passed.

    Sequence ``i`` has ``counts[i]`` tokens from row ``tok_start[i]``; its units (token·G + g)
    are cut into tiles of ``rows`` from its first unit, so a sequence's tiles never depend on
    the other sequences. ``NT_max = ceil(T·G / rows) + B`` bounds the tile count; tiles past the
    real count have ``unit0 == unit1`` (their programs return at once)."""
    B = counts.shape[0]
    dev = counts.device
    nt_max = -(-num_tokens * group // rows) + B
    units = counts * group
    ntiles = torch.div(units + (rows - 1), rows, rounding_mode="floor")
    tile_end = torch.cumsum(ntiles, 0)
    t = torch.arange(nt_max, device=dev, dtype=torch.int64)
    seq = torch.searchsorted(tile_end, t, right=True).clamp_(max=max(B - 1, 0))
    j = t - (tile_end - ntiles)[seq]
    start = tok_start[seq] * group
    u0 = start + j * rows
    u1 = torch.minimum(u0 + rows, start + units[seq])
    u1 = torch.where(t < tile_end[-1], u1, u0)
    return torch.stack([seq, u0, u1, pos_base[seq]], 1).contiguous()


def key_table(lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """64-key blocks of each packed sequence: int64 ``[NB_max, 4]`` rows ``[seq, block, len, 0]``
    (``len = 0`` marks an unused row)."""
    B = lens.shape[0]
    nb_max = -(-num_tokens // 64) + B
    nblk = torch.div(lens + 63, 64, rounding_mode="floor")
    end = torch.cumsum(nblk, 0)
    t = torch.arange(nb_max, device=lens.device, dtype=torch.int64)
    seq = torch.searchsorted(end, t, right=True).clamp_(max=max(B - 1, 0))
    blk = t - (end - nblk)[seq]
    n = torch.where(t < end[-1], lens[seq], 0)
    return torch.stack([seq, blk, n, torch.zeros_like(n)], 1).contiguous()


def varlen_rows(cu_seqlens: torch.Tensor):
    """``(counts, tok_start, pos_base)`` of the packed varlen layout (``cu_seqlens``)."""
    cu = cu_seqlens.to(torch.int64)
    counts = cu[1:] - cu[:-1]
    tok_start = cu[:-1].contiguous()
    return counts, tok_start, tok_start  # position of token t = t - cu[seq]


def cached_rows(q_seq: torch.Tensor, q_pos: torch.Tensor, num_seqs: int):
    """``(counts, tok_start, pos_base)`` of the rollout layout (rows of a sequence contiguous, in
    batch order, consecutive positions: what ``rl_engine.ops.attention.cached_attention`` builds)."""
    T = q_seq.shape[0]
    # scatter_add, not bincount: no host sync (bincount sizes its output from the data), so the
    # launcher can be captured in a CUDA graph
    counts = torch.zeros(num_seqs, dtype=torch.int64, device=q_seq.device).scatter_add_(0, q_seq, torch.ones_like(q_seq))
    tok_start = torch.cumsum(counts, 0) - counts
    first = tok_start.clamp(max=max(T - 1, 0))
    pos_base = tok_start - q_pos[first] if T else tok_start
    return counts, tok_start, pos_base


def rollout_tiles(q_seq: torch.Tensor, q_pos: torch.Tensor, num_seqs: int, group: int, rows: int) -> torch.Tensor:
    """``tile_table(*cached_rows(q_seq, q_pos, num_seqs), group, rows, T)`` in one launch
    (``rlk_attn_tiles``; the per-call fixed cost of small decode steps); same integers."""
    T = q_seq.shape[0]
    nt = -(-T * group // rows) + num_seqs
    tab = torch.empty((nt, 4), dtype=torch.int64, device=q_seq.device)
    radix, rounds = 16, 1
    while radix**rounds <= T:
        rounds += 1
    with device_guard(q_seq):
        rlk_attn_tiles[(1,)](q_seq, q_pos, tab, T, num_seqs, nt, rounds, radix ** (rounds - 1), group, ROWS=rows,
                             CHUNK=64, RADIX=radix, JB=16, PDL=eligibility.use_pdl(q_seq.device), num_warps=4,
                             enable_fp_fusion=False)
    return tab


def varlen_tiles(cu_seqlens: torch.Tensor, group: int, rows: int, num_tokens: int) -> torch.Tensor:
    """``tile_table(*varlen_rows(cu_seqlens), group, rows, num_tokens)`` in one launch
    (``rlk_attn_varlen_tiles``) instead of ~15 small torch kernels; same integers."""
    B = cu_seqlens.shape[0] - 1
    nt = -(-num_tokens * group // rows) + B
    tab = torch.empty((nt, 4), dtype=torch.int64, device=cu_seqlens.device)
    if B <= 0 or nt == 0:
        return tab
    cu = cu_seqlens.contiguous()
    with device_guard(cu):
        rlk_attn_varlen_tiles[(triton.cdiv(nt, 128),)](cu, tab, B, nt, group, BLOCK_M=rows, TBLOCK=128, SBLOCK=32,
                                                       PDL=eligibility.use_pdl(cu.device), num_warps=4)
    return tab


# ----------------------------------------------------------------------------------------------
# Forward


def attend(q, k_rows, v_rows, page_rows, page_size, counts, tok_start, pos_base, max_positions, scale, window, *,
           path: str, variant: Variant = Variant.POINTER_LOADS, config: AttnConfig | None = None,
           want_lse: bool = False, want_f32: bool = False, tiles: torch.Tensor | OneTokenTiles | None = None):
    """The forward for every query row (all entry points end here).

    Args:
        q: ``[T, Hq, D]``; k_rows, v_rows: ``[N, Hkv, D]`` storage rows.
        page_rows, page_size: storage row of position ``p`` of batch sequence ``i`` is
            ``page_rows[i, p // page_size] + p % page_size`` (one column: ``page_rows[i, 0] + p``).
        counts, tok_start, pos_base: ``[B]`` int64 on the device: sequence ``i`` owns query rows
            ``tok_start[i] .. + counts[i] - 1``, row ``t`` at position ``t - pos_base[i]``.
        max_positions: host bound on ``1 + `` the largest query position (sizes the split grid).
        path: ``"prefill"`` (splits in sequence inside one program) or ``"decode"`` (one program
            per split + ``rlk_attn_combine``; with ``max_positions <= 1024``, one split, the
            prefill kernel with the decode tiles); all give the same bits.
        variant: the kernel variant (``configs.Variant``: how key / value blocks arrive, or which
            Hopper kernel runs a decode step's splits), chosen by ``eligibility.train_variant`` /
            ``eligibility.decode_variant``; refused with the reason where the call does not fit
            it. Every variant gives the same bits.
        config: force a tile configuration (tests); default from the config tables.
        want_lse, want_f32: also return the lse and the unrounded fp32 output.
        tiles: the tile table for ``config``'s BLOCK_M when the caller built it already
            (``rollout_tiles``), or ``OneTokenTiles(q_pos)`` for a step of one query token per
            sequence (no table); default ``tile_table(counts, tok_start, pos_base, ...)``.

    Returns ``(out [T, Hq, D] in q.dtype, lse [T, Hq] fp32 | None, out_f32 | None)``.
    """
    T, Hq, D = q.shape
    Hkv = k_rows.shape[1]
    G = Hq // Hkv
    B = counts.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device) if want_lse else None
    out32 = torch.empty((T, Hq, D), dtype=torch.float32, device=q.device) if want_f32 else None
    if T == 0 or B == 0:
        return out, lse, out32
    tuning = current_tuning()
    sb = tuning.split_blocks
    paged = page_rows.shape[1] > 1
    one = isinstance(tiles, OneTokenTiles)
    tab = tiles.q_pos if one else tiles
    tma = variant is Variant.PACKED_TMA
    cache_tma = variant is Variant.CACHE_TMA
    wg_split = variant is Variant.WARPGROUP_PAGED_DECODE
    wgt_split = variant.transposed
    wgt_quad = variant is Variant.TRANSPOSED_DECODE_QUAD
    if cache_tma and paged:
        raise ValueError(f"variant={variant.value}: expected a contiguous cache, got paged={paged}")
    if wg_split and not (paged and window is None and int(page_size) in eligibility.WG_DECODE_PAGE_SIZES and D == 128
                         and q.element_size() == 2 and path == "decode" and not want_lse and not want_f32):
        raise ValueError(f"variant={variant.value}: expected a decode-path call for the output only over a paged "
                         f"cache of {eligibility.WG_DECODE_PAGE_SIZES} pages, no window and 16-bit rows of D = 128, "
                         f"got path={path!r}, want_lse={want_lse}, want_f32={want_f32}, paged={paged}, "
                         f"page_size={page_size}, window={window}, D={D}, dtype={q.dtype}")
    # a compile-time constant of the forward kernels: 1 (unused) for a contiguous cache, so that
    # contiguous caches of any length share one compilation
    psz = int(page_size) if paged else 1
    arch = arch_of(q.device)
    cfg = config or (configs.select_decode(q.dtype, D, page_size if paged else None, arch=arch) if path == "decode"
                     else configs.select_prefill(q.dtype, D, page_size if paged else None, arch=arch))
    if wgt_split and not (window is None and (not paged or int(page_size) in eligibility.WG_DECODE_PAGE_SIZES)
                          and D == 128 and q.element_size() == 2 and path == "decode" and not want_lse
                          and not want_f32 and eligibility.copyable_rows(k_rows, v_rows)
                          and (one or cfg.block_m <= 16) and D // cfg.v_slices >= 64) or (wgt_quad and not (
                              D // cfg.v_slices == 64)):
        raise ValueError(f"variant={variant.value}: expected a decode-path call for the output only over a "
                         f"contiguous cache or {eligibility.WG_DECODE_PAGE_SIZES} pages, no window, 16-bit rows of "
                         f"D = 128 a TMA copy can read and tiles of at most 16 rows, got path={path!r}, "
                         f"want_lse={want_lse}, want_f32={want_f32}, paged={paged}, page_size={page_size}, "
                         f"window={window}, D={D}, dtype={q.dtype}, one={one}, block_m={cfg.block_m}, "
                         f"v_slices={cfg.v_slices} (at most 2: 64-column slices; four blocks a step: exactly 2)")
    if one and (tab.shape != (B,) or G > cfg.block_m):
        raise ValueError(f"tiles: expected OneTokenTiles(q_pos) with q_pos of shape [{B}] and G = {G} <= BLOCK_M = "
                         f"{cfg.block_m}")
    if tab is None:
        tab = tile_table(counts, tok_start, pos_base, G, cfg.block_m, T)
    nt = tab.shape[0]
    ieee = q.dtype == torch.float32
    has_w = window is not None
    w = int(window) if has_w else 0
    dummy = out32 if out32 is not None else (lse if lse is not None else out)
    vsl = cfg.v_slices
    if vsl < 1 or D % vsl or D // vsl < 16:
        raise ValueError(f"config: v_slices={vsl} must divide head_dim={D} into slices of at least 16 columns")
    if cfg.unroll not in (1, 2, 4):
        raise ValueError(f"config: unroll={cfg.unroll}, expected 1, 2 or 4 blocks per step")
    if cfg.unroll == 4 and cfg.block_m != 16:
        raise ValueError(f"config: unroll=4 takes 16-row tiles (each warp holds a block's scores), got "
                         f"block_m={cfg.block_m}")
    # rlk_attn_quad copies four blocks of keys in one box; the train path's masked blocks copy one
    # with the same descriptor, so four blocks a step there take the pointer loads (the same bits)
    tma = tma and cfg.unroll != 4
    quad = 4 if cfg.unroll == 4 else 1
    stages = cfg.num_stages
    if quad == 4:
        # a stage of four-block steps holds four key blocks (64 KiB at D = 128, 16-bit): three
        # stages fit an SM's shared memory only with 16-row tiles and at most 64 value columns
        # (offline sm_90 compile, Triton 3.6: 170 KiB at 32 columns, 203 KiB at 64, 268 KiB at 128)
        stages = min(stages, 3 if cfg.block_m == 16 and D // vsl <= 64 and q.element_size() == 2 else 2)
    common = dict(HQ=Hq, HKV=Hkv, HEAD_D=D, BLOCK_M=cfg.block_m, HAS_WINDOW=has_w)
    runs = configs.split_runs(q.dtype)
    # storage rows may be views with their own row / head strides (an engine's cache buffer);
    # the head dim must be unit-stride
    if k_rows.stride(2) != 1 or v_rows.stride(2) != 1:
        raise ValueError("k_cache: expected unit stride along head_dim")
    kv_strides = (k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1))
    if path not in ("prefill", "decode"):
        raise ValueError(f"path: expected 'prefill' or 'decode', got {path!r}")
    ns = configs.num_splits(max_positions)
    # one KV split at most: the decode tiles run through the prefill kernel (the same split body
    # and merge from the same initial state, so the same bits), one launch and no workspace
    kernel = "prefill" if path == "prefill" or ns == 1 else "decode"
    pdl = eligibility.use_pdl(q.device)  # each kernel waits on the device for the tile table / workspace
    with device_guard(q):
        if wg_split and ns == 1:  # the warpgroup kernel's programs finish their rows: no combine
            from rl_engine.backends.triton.attention import hopper_warpgroup

            hopper_warpgroup.launch_split(q, k_rows, v_rows, out, None, tab, page_rows, page_size, G,
                                          configs.score_scale(scale), ns, vsl, tile_rows=cfg.block_m, one=one,
                                          order=configs.split_grid_order(nt, Hkv, vsl, q.device), split_blocks=sb,
                                          pdl=pdl)
        elif wgt_split and ns == 1:
            from rl_engine.backends.triton.attention import hopper_transposed_decode

            hopper_transposed_decode.launch_split_t(q, k_rows, v_rows, out, None, tab, page_rows, page_size, G,
                                                    configs.score_scale(scale), ns, vsl, paged=paged,
                                                    tile_rows=cfg.block_m, one=one,
                                                    order=configs.split_grid_order(nt, Hkv, vsl, q.device),
                                                    split_blocks=sb, pdl=pdl, quad=wgt_quad)
        elif kernel == "prefill":
            # a tile spans several KV splits only if some query position is >= 1024: then an fp32
            # scratch tile per program holds the merged accumulator between splits
            # (tiles x kv heads x BLOCK_M x D fp32, about the size of an fp32 output, freed on return)
            multi = max_positions > KV_BLOCK * sb
            if multi:
                scr = torch.empty((nt * Hkv * cfg.block_m * D,), dtype=torch.float32, device=q.device)
            else:
                scr = torch.empty((1,), dtype=torch.float32, device=q.device)
            if tma and (vsl != 1 or paged):
                raise ValueError(f"variant={variant.value}: expected one value slice and packed rows, got "
                                 f"v_slices={vsl}, paged={paged}")
            k_desc, v_desc = (kv_descriptors(k_rows, v_rows, D // vsl, quad) if tma or cache_tma
                              else (k_rows, v_rows))
            rlk_attn_fwd[(nt, Hkv, vsl)](
                q, k_rows, v_rows, k_desc, v_desc, out, out32 if out32 is not None else dummy, lse if lse is not None else dummy, scr,
                tab, page_rows, page_rows.stride(0), psz, G, w, configs.score_scale(scale), *kv_strides, **common,
                DV=D // vsl, PAGED=paged, IEEE=ieee, STORE_F32=want_f32, STORE_LSE=want_lse, SPLIT=runs, MULTI=multi,
                ONE=one, PDL=pdl, SB=sb, TMA=tma or cache_tma, U=cfg.unroll, TMA_EDGE=tma, num_warps=cfg.num_warps,
                num_stages=stages, enable_fp_fusion=False, launch_pdl=pdl,
            )
        else:
            ws_m = torch.empty((nt, Hkv, ns, cfg.block_m), dtype=torch.float32, device=q.device)
            ws_l = torch.empty_like(ws_m)
            ws_a = torch.empty((nt, Hkv, ns, cfg.block_m, D), dtype=torch.float32, device=q.device)
            k_desc, v_desc = kv_descriptors(k_rows, v_rows, D // vsl, quad) if cache_tma else (k_rows, v_rows)
            if wg_split:
                from rl_engine.backends.triton.attention import hopper_warpgroup

                hopper_warpgroup.launch_split(q, k_rows, v_rows, out, (ws_m, ws_l, ws_a), tab, page_rows, page_size,
                                              G, configs.score_scale(scale), ns, vsl, tile_rows=cfg.block_m, one=one,
                                              order=configs.split_grid_order(nt, Hkv, ns * vsl, q.device),
                                              split_blocks=sb, pdl=pdl)
            elif wgt_split:
                from rl_engine.backends.triton.attention import hopper_transposed_decode

                hopper_transposed_decode.launch_split_t(q, k_rows, v_rows, out, (ws_m, ws_l, ws_a), tab, page_rows,
                                                        page_size, G, configs.score_scale(scale), ns, vsl, paged=paged,
                                                        tile_rows=cfg.block_m, one=one,
                                                        order=configs.split_grid_order(nt, Hkv, ns * vsl, q.device),
                                                        split_blocks=sb, pdl=pdl, quad=wgt_quad)
            else:
                order = configs.split_grid_order(nt, Hkv, ns * vsl, q.device)
                grid = ((nt, Hkv, ns * vsl), (Hkv, nt, ns * vsl), (ns * vsl, nt, Hkv))[order]
                rlk_attn_fwd_split[grid](
                    q, k_rows, v_rows, k_desc, v_desc, ws_m, ws_l, ws_a, tab, page_rows, page_rows.stride(0), psz, G, w,
                    configs.score_scale(scale), *kv_strides, ns, **common, DV=D // vsl, PAGED=paged, IEEE=ieee,
                    SPLIT=runs, ONE=one, PDL=pdl, SB=sb, U=cfg.unroll, TMA=cache_tma, ORDER=order,
                    num_warps=cfg.num_warps, num_stages=stages, enable_fp_fusion=False, launch_pdl=pdl,
                )
            dc = min(D, COMBINE_COLUMNS)
            rlk_attn_combine[(nt, Hkv, D // dc)](
                out, out32 if out32 is not None else dummy, lse if lse is not None else dummy, ws_m, ws_l, ws_a,
                tab, G, w, ns, **common, DC=dc, STORE_F32=want_f32, STORE_LSE=want_lse, ONE=one, PDL=pdl,
                SB=sb, GROUP=configs.combine_group(ns), num_warps=cfg.num_warps, enable_fp_fusion=False,
                launch_pdl=pdl,
            )
    return out, lse, out32


def kv_descriptors(k_rows: torch.Tensor, v_rows: torch.Tensor, dv: int, key_blocks: int = 1):
    """TMA descriptors of the ``[rows, Hkv·D]`` views of the key and value storage rows: boxes of
    ``key_blocks`` 64-row blocks of a head's ``D`` key columns (4 for ``rlk_attn_quad``) and of 64
    rows of ``dv`` value columns (a value slice)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n_rows, hkv, d = k_rows.shape
    return (TensorDescriptor(k_rows, [n_rows, hkv * d], [k_rows.stride(0), 1], [KV_BLOCK * key_blocks, d]),
            TensorDescriptor(v_rows, [n_rows, hkv * d], [v_rows.stride(0), 1], [KV_BLOCK, dv]))


def _warpgroup_forward(q, k, v, cu_seqlens, scale, window, bound: int, for_backward: bool):
    """``varlen_forward`` by ``hopper_warpgroup.rlk_attn_fwd_wg`` (tiles of
    ``AttentionTuning.wg_forward_block_m`` rows from the same tile table)."""
    from rl_engine.backends.triton.attention import hopper_warpgroup

    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = torch.empty_like(q)
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device) if for_backward else None
    out32 = torch.empty((T, Hq, D), dtype=torch.float32, device=q.device) if for_backward else None
    if T == 0 or cu_seqlens.shape[0] < 2:
        return out, lse, out32
    tuning = current_tuning()
    block_m, split_blocks = tuning.wg_forward_block_m, tuning.split_blocks
    tab = varlen_tiles(cu_seqlens, G, block_m, T)
    page_rows = cu_seqlens[:-1].unsqueeze(1)  # a view: the kernel reads int32 or int64 rows as int64
    multi = bound > KV_BLOCK * split_blocks
    nt = tab.shape[0]
    scr = torch.empty((nt * Hkv * block_m * D if multi else 1,), dtype=torch.float32, device=q.device)
    with device_guard(q):
        hopper_warpgroup.launch(q, k, v, out, out32, lse, scr, tab, page_rows, G, window, configs.score_scale(scale),
                                store_f32=for_backward, store_lse=for_backward, multi=multi,
                                split_blocks=split_blocks, pdl=eligibility.use_pdl(q.device))
    return out, lse, out32


def varlen_forward(q, k, v, cu_seqlens, scale, window, *, path: str = "prefill", config: AttnConfig | None = None,
                   max_seqlen: int | None = None, for_backward: bool = True):
    """Train-path forward: ``(out, lse, out_f32)`` (``out_f32`` only for 16-bit inputs, else empty).

    ``max_seqlen``: a host bound on the longest sequence (default: the token count). Only the
    launch specialisation depends on it (no tile spans two KV splits when it is at most 1024, so
    the kernel is compiled without the split merge); the bits do not.
    ``for_backward=False`` (a forward that no backward will follow): only ``out`` is stored and
    ``(out, None, None)`` returned — the fp32 output and the lse are extra stores (about a
    quarter of the prefill time at 32 × 512, bf16), the bits of ``out`` are the same."""
    T, Hq, D = q.shape
    B = cu_seqlens.shape[0] - 1
    bound = T if max_seqlen is None else min(int(max_seqlen), T)
    if path == "prefill" and eligibility.wg_eligible(q, k, v, config):
        return _warpgroup_forward(q, k, v, cu_seqlens, scale, window, bound, for_backward)
    arch = arch_of(q.device)
    cfg = config or (configs.select_decode(q.dtype, D, arch=arch) if path == "decode"
                     else configs.select_prefill(q.dtype, D, arch=arch))
    # key row of position 0: the first token (a view, no cast kernel: the kernels read int32 or
    # int64 rows as int64, rlk_attn_kv_base)
    page_rows = cu_seqlens[:-1].unsqueeze(1)
    nseq = page_rows.new_empty(B)  # only its length is read (the table is built)
    tab = varlen_tiles(cu_seqlens, Hq // k.shape[1], cfg.block_m, T) if T and B > 0 else None
    want_f32 = for_backward and q.dtype != torch.float32
    out, lse, out32 = attend(q, k, v, page_rows, _NO_PAGES, nseq, nseq, nseq, bound, scale, window,
                             path=path, variant=eligibility.train_variant(q, k, v, cfg), config=cfg,
                             want_lse=for_backward, want_f32=want_f32, tiles=tab)
    if not for_backward:
        return out, None, None
    if out32 is None:
        out32 = q.new_empty((0,), dtype=torch.float32)
    return out, lse, out32


def cached_forward(q, k_rows, v_rows, page_rows, page_size, q_seq, q_pos, scale, window, *, path: str | None = None,
                   config: AttnConfig | None = None, decode_only: bool = False):
    """Rollout-path forward over the cache rows (keys/values already written). ``q_seq`` must be
    non-decreasing (the rollout layout that ``rl_engine.ops.attention.cached_attention`` builds).

    ``decode_only``: the caller knows that every sequence of the batch has exactly one query token
    (``q_seq == arange(B)``, known on the host from the step's lengths). Then, on the decode path
    with ``G <= 16`` and where ``configs.tile_free_rows`` says so, no tile table is built: each
    kernel forms its tile's row from ``q_pos``
    (``rlk_attn_rows(ONE=True)``), one launch less per call (1.8-3.8 µs of a decode step on the
    H200). The same integers reach the kernels, so the same bits. A wrong
    ``decode_only`` reads the wrong rows: it is the ops layer's to derive, not a user's to set."""
    T, Hq, D = q.shape
    B = page_rows.shape[0]
    Hkv = k_rows.shape[1]
    G = Hq // Hkv
    P = page_rows.shape[1]
    bound = page_size if P == 1 else P * page_size
    if path is None:
        path = "decode" if configs.use_decode_path(T, B, G) else "prefill"
    max_positions = min(bound, 1 << 40)
    ns = configs.num_splits(max_positions)
    few = configs.few_programs(B, Hkv, q.device)  # fewer (sequence, kv head) pairs than SMs
    programs = None  # the decode step's (tile, kv head, split) programs, where the rules pick its tile
    if config is not None:
        cfg = config
    elif path == "decode":
        few_tile = few and configs.one_wave(B * Hkv * ns, q.device)
        small_pages = P > 1 and page_size < KV_BLOCK  # the paged tiles (select_decode's own test)
        # steps of few pairs past one wave take the many-pairs tile too (``one_wave``)
        cfg = configs.select_decode(q.dtype, D, page_size if P > 1 else None, few=few_tile, many=not few_tile,
                                    arch=arch_of(q.device))
        # programs: tiles (one per sequence in a decode-only step, else the table's bound) x kv heads x splits
        programs = (B if decode_only else -(-T * G // cfg.block_m) + B) * Hkv * ns
        if few and current_tuning().auto_value_slices:
            cfg = replace(cfg, v_slices=configs.value_slices(programs, D, q.device, small_pages=small_pages))
        multi = few_tile and configs.multi_block_steps(D)
        if multi and configs.quad_blocks(cfg.v_slices):
            cfg = configs.quad_tile(cfg)
        elif multi and configs.pair_blocks(programs * cfg.v_slices, P > 1, q.device):
            cfg = replace(cfg, unroll=2)
    else:
        cfg = configs.select_prefill(q.dtype, D, page_size if P > 1 else None, arch=arch_of(q.device))
    q_seq = q_seq.to(torch.int64).contiguous()
    q_pos = q_pos.to(torch.int64).contiguous()
    if decode_only and T != B:
        raise ValueError(f"decode_only: expected one query token per sequence (T == B), got T={T}, B={B}")
    one = (decode_only and path == "decode" and G <= cfg.block_m
           and configs.tile_free_rows())
    if one:
        tiles = OneTokenTiles(q_pos)
    else:
        tiles = rollout_tiles(q_seq, q_pos, B, G, cfg.block_m) if T and B else None
    # a decode step's variant: its splits on a Hopper kernel where that kernel's band takes the step
    # (each its own tile: ``cfg`` sizes the table and the combine), else the portable kernels with
    # TMA copies for the unmasked run over a contiguous cache (``eligibility.decode_variant``)
    variant = Variant.POINTER_LOADS
    if path == "decode":
        variant = eligibility.decode_variant(q, k_rows, v_rows, page_size, P > 1, window, one=one, cfg=cfg,
                                             programs=programs)
    if variant.transposed:
        cfg = replace(cfg, v_slices=current_tuning().wgt_value_slices)
    nseq = torch.empty(B, dtype=torch.int64, device=q.device)  # only its length is read (table built)
    out, _, _ = attend(q, k_rows, v_rows, page_rows.contiguous(), page_size, nseq, nseq, nseq,
                       max_positions, scale, window, path=path, variant=variant, config=cfg, tiles=tiles)
    return out


# ----------------------------------------------------------------------------------------------
# Backward


def varlen_backward(grad, q, k, v, out, lse, cu_seqlens, scale, window, *, config: AttnConfig | None = None):
    """``(dq, dk, dv)`` in the input dtype; ``out`` is the unrounded fp32 output for 16-bit inputs.
    ``config`` forces the backward configuration (benchmark candidates); default the ``backward``
    table's (``configs.select_backward``)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if T == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    counts, tok_start, pos_base = varlen_rows(cu_seqlens)
    cfg = config or configs.select_backward(q.dtype, D, arch=arch_of(q.device))
    runs = configs.split_runs(q.dtype)
    grad = grad.contiguous()
    out = out.contiguous()
    ieee = q.dtype == torch.float32
    has_w = window is not None
    w = int(window) if has_w else 0
    delta = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
    R = T * Hq
    block_r = 64
    with device_guard(q):
        rlk_attn_bwd_delta[(triton.cdiv(R, block_r),)](grad, out, delta, R, HEAD_D=D, LOG2D=int(math.log2(D)),
                                                       BLOCK_R=block_r, num_warps=4, enable_fp_fusion=False)
        tab = varlen_tiles(cu_seqlens, G, cfg.block_m, T)
        rlk_attn_bwd_dq[(tab.shape[0], Hkv)](
            q, k, v, grad, lse, delta, dq, tab, tok_start, G, w, configs.score_scale(scale), float(scale), HQ=Hq,
            HKV=Hkv, HEAD_D=D, BLOCK_M=cfg.block_m, HAS_WINDOW=has_w, IEEE=ieee, SPLIT=runs, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, enable_fp_fusion=False,
        )
        ktab = key_table(counts, T)
        rlk_attn_bwd_dkdv[(ktab.shape[0], Hkv)](
            q, k, v, grad, lse, delta, dk, dv, ktab, tok_start, G, w, configs.score_scale(scale), float(scale), HQ=Hq,
            HKV=Hkv,
            HEAD_D=D, HAS_WINDOW=has_w, IEEE=ieee, SPLIT=runs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=False,
        )
    return dq, dk, dv
