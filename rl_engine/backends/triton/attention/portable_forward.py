"""The portable Triton forward kernels of ``attention.varlen_attention`` /
``attention.cached_attention`` (every launched name starts with ``rlk_``):

* ``rlk_attn_fwd``          one program per (query tile, kv head): the KV splits of the tile's
  range one after the other, each folded into the row state with ``rlk_attn_merge`` (prefill,
  varlen forward, and decode steps of one KV split);
* ``rlk_attn_fwd_split``    one program per (query tile, kv head, KV split): one split's
  ``(m, l, acc)`` into an fp32 workspace that ``split_kv_combine.rlk_attn_combine`` folds
  (flash-decoding);

either may take ``AttnConfig.v_slices`` programs per unit, each accumulating a slice of the value
columns (the same scores and state in each: same bits). Every launch passes
``enable_fp_fusion=False``; 16-bit inputs skip the masks on the blocks every row of a tile sees
entirely (``rlk_attn_block(..., MASKED=False)``, ``configs.split_runs``). The launchers are in
``launch``; the shared device functions in ``device``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rl_engine.backends.triton.attention.device import (rlk_attn_gdc_wait, rlk_attn_gdc_launch, rlk_attn_split_ids,
                                                        rlk_attn_rows, rlk_attn_kv_base, rlk_attn_split,
                                                        rlk_attn_merge, rlk_attn_finish)

__all__ = ["KERNEL_NAMES", "DEVICE_FUNCTIONS", "rlk_attn_fwd", "rlk_attn_fwd_split"]

KERNEL_NAMES = ("rlk_attn_fwd", "rlk_attn_fwd_split")
#: ``@triton.jit`` device functions in this module's namespace (its own and the shared ones it
#: calls from ``device``), never launched on their own.
DEVICE_FUNCTIONS = ("rlk_attn_gdc_wait", "rlk_attn_gdc_launch", "rlk_attn_split_ids", "rlk_attn_rows",
                    "rlk_attn_kv_base", "rlk_attn_split", "rlk_attn_merge", "rlk_attn_finish")


@triton.jit
def rlk_attn_fwd(q_ptr, k_ptr, v_ptr, k_desc, v_desc, out_ptr, out32_ptr, lse_ptr, scr_ptr, tab_ptr, pr_ptr, pr_stride,
                 page_size: tl.constexpr, G: tl.constexpr, W,
                 qk_scale, sk_row, sk_head, sv_row, sv_head, HQ, HKV, HEAD_D: tl.constexpr, DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr, IEEE: tl.constexpr,
                 STORE_F32: tl.constexpr, STORE_LSE: tl.constexpr, SPLIT: tl.constexpr, MULTI: tl.constexpr,
                 ONE: tl.constexpr, PDL: tl.constexpr, SB: tl.constexpr, TMA: tl.constexpr, U: tl.constexpr,
                 TMA_EDGE: tl.constexpr):
    """Grid (tiles, kv heads, ``HEAD_D / DV``): the splits of a tile (``SB`` blocks each) in sequence,
    merged; the third axis takes ``DV`` value columns each (``AttnConfig.v_slices``; the first
    stores the lse). ``TMA``: the unmasked run's blocks by TMA copies; ``TMA_EDGE``: the masked
    blocks too (the train path's packed rows, ``Variant.PACKED_TMA``; a cache's masked blocks keep
    the pointer loads clamped to the tile's last position, ``Variant.CACHE_TMA``)."""
    rlk_attn_gdc_wait(PDL)
    t = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    vs = tl.program_id(2)
    seq, valid, tok, g, pos, wlo, lo, hi, first, last, cap = rlk_attn_rows(tab_ptr, t, G, W, HAS_WINDOW, BLOCK_M,
                                                                           ONE)
    kbase = rlk_attn_kv_base(pr_ptr, seq, pr_stride)  # beside the table row (see rlk_attn_fwd_split)
    if last >= 0:
        offs_d = tl.arange(0, HEAD_D)
        if DV == HEAD_D:  # one slice (every prefill and train launch): the code without slices
            offs_v = offs_d
            lse_valid = valid
        else:
            offs_v = vs * DV + tl.arange(0, DV)
            lse_valid = valid & (tl.full([BLOCK_M], vs, tl.int32) == 0)  # (a vector compare: see rlk_attn_ws_load)
        head = kvh * G + g
        q_off = (tok * HQ + head) * HEAD_D
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        s_first = first // SB
        s_last = last // SB
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.zeros([BLOCK_M], tl.float32)
        if MULTI:
            # Splits before the last: each merged into the state, whose accumulator waits in an fp32
            # scratch tile between splits (one accumulator in registers, not two; the store/reload
            # is exact). The scratch is tile-major, so its addresses are the program's base plus
            # constant offsets (no per-element pointers held in registers across the block walk).
            # The first split merges with the initial (-inf, 0, +0) state, as rlk_attn_combine does.
            scr = (scr_ptr + (t.to(tl.int64) * HKV + kvh) * (BLOCK_M * HEAD_D)
                   + (tl.arange(0, BLOCK_M)[:, None] * HEAD_D + offs_v[None, :]))
            for sp in range(s_first, s_last):
                m, l, a = rlk_attn_split(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size,
                                         cap, kvh, pos, wlo, valid, tl.maximum(first, sp * SB), sp * SB + SB - 1,
                                         qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D, DV, BLOCK_M,
                                         PAGED, IEEE, SPLIT, HAS_WINDOW, TMA, U, TMA_EDGE, vs * DV)
                if sp > s_first:
                    A = tl.load(scr)
                else:
                    A = tl.zeros([BLOCK_M, DV], tl.float32)
                M, L, A = rlk_attn_merge(M, L, A, m, l, a)
                tl.store(scr, A)
        # The last split (the only one when MULTI is off: every query position < 1024), then the
        # output. A tile inside one split skips the scratch: merging one split into the initial
        # state is an exact identity (M = m; L = fma(l, 1, 0) = l; A = fma(a, 1, 0) = a, a never -0).
        m, l, a = rlk_attn_split(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh,
                                 pos, wlo, valid, tl.maximum(first, s_last * SB), last, qk_scale, sk_row, sk_head,
                                 sv_row, sv_head, offs_v, HEAD_D, DV, BLOCK_M, PAGED, IEEE, SPLIT, HAS_WINDOW, TMA, U,
                                 TMA_EDGE, vs * DV)
        if MULTI:
            if s_last > s_first:
                M, L, A = rlk_attn_merge(M, L, tl.load(scr), m, l, a)
            else:
                M, L, A = m, l, a
        else:
            M, L, A = m, l, a
        rlk_attn_finish(M, L, A, out_ptr, out32_ptr, lse_ptr, q_off, tok * HQ + head, valid, lse_valid, offs_v,
                        STORE_F32, STORE_LSE)


@triton.jit
def rlk_attn_fwd_split(q_ptr, k_ptr, v_ptr, k_desc, v_desc, ws_m_ptr, ws_l_ptr, ws_a_ptr, tab_ptr, pr_ptr, pr_stride,
                       page_size: tl.constexpr, G: tl.constexpr, W,
                       qk_scale, sk_row, sk_head, sv_row, sv_head, NS, HQ, HKV, HEAD_D: tl.constexpr,
                       DV: tl.constexpr, BLOCK_M: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr,
                       IEEE: tl.constexpr, SPLIT: tl.constexpr, ONE: tl.constexpr, PDL: tl.constexpr,
                       SB: tl.constexpr, U: tl.constexpr, TMA: tl.constexpr, ORDER: tl.constexpr):
    """Grid (tiles, kv heads, splits · ``HEAD_D / DV``) in the axis order ``ORDER`` (``split_grid_order``:
    which of them the hardware schedules fastest; the work of a program does not depend on it):
    program ``(t, h, j·VS + vs)`` runs split
    ``j`` of tile ``t`` for value columns ``vs·DV ..`` (``AttnConfig.v_slices``; the ``vs = 0``
    program stores the split's ``m``, ``l``, which every slice computes alike) into the workspace
    that ``rlk_attn_combine`` folds. ``TMA`` (contiguous caches, ``Variant.CACHE_TMA``): the
    blocks of the unmasked run arrive by TMA copies (key ``[64, D]``, value ``[64, DV]`` boxes of
    the ``[rows, Hkv·D]`` views); the masked blocks by pointer loads. The same bits."""
    rlk_attn_gdc_wait(PDL)
    rlk_attn_gdc_launch(PDL)  # the combine may launch (it waits for this kernel's end)
    t, kvh, js = rlk_attn_split_ids(ORDER)
    j = js // (HEAD_D // DV)
    vs = js % (HEAD_D // DV)
    seq, valid, tok, g, pos, wlo, lo, hi, first, last, cap = rlk_attn_rows(tab_ptr, t, G, W, HAS_WINDOW, BLOCK_M,
                                                                           ONE)
    # the base row is loaded beside the table row, not after it (``seq`` is a batch sequence for
    # every program, padding tiles included): the first key loads wait on one round trip, not two
    kbase = rlk_attn_kv_base(pr_ptr, seq, pr_stride)
    sp = first // SB + j
    if (last >= 0) & (sp <= last // SB):
        offs_d = tl.arange(0, HEAD_D)
        if DV == HEAD_D:
            offs_v = offs_d
            state = valid
        else:
            offs_v = vs * DV + tl.arange(0, DV)
            state = valid & (tl.full([BLOCK_M], vs, tl.int32) == 0)  # one slice stores the state
        q_off = (tok * HQ + kvh * G + g) * HEAD_D
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        b0 = tl.maximum(first, sp * SB)
        b1 = tl.minimum(last, sp * SB + SB - 1)
        # TMA: the unmasked run's blocks by TMA copies (rows every valid row sees: written cache
        # rows of this sequence); the masked edge blocks by pointer loads clamped to ``cap``
        m, l, a = rlk_attn_split(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh,
                                 pos, wlo, valid, b0, b1, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D,
                                 DV, BLOCK_M, PAGED, IEEE, SPLIT, HAS_WINDOW, TMA, U, False, vs * DV)
        # only the tile's valid rows (a decode tile of G or fewer units in 16 rows): padding rows
        # are never read back, so their stores would be workspace traffic for nothing
        slot = ((t.to(tl.int64) * HKV + kvh) * NS + j) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(ws_m_ptr + slot, m, mask=state)
        tl.store(ws_l_ptr + slot, l, mask=state)
        tl.store(ws_a_ptr + slot[:, None] * HEAD_D + offs_v[None, :], a, mask=valid[:, None])
