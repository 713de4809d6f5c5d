"""The split-KV combine of decode steps: ``rlk_attn_combine`` folds the workspace splits that
``portable_forward.rlk_attn_fwd_split`` (or a Hopper split kernel) stored, left to right with the
same merge as the prefill kernel's in-program fold, then ``out = ACC / L`` (flash-decoding's second
launch). Launched by ``launch.attend``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rl_engine.backends.triton.attention.device import (rlk_attn_gdc_wait, rlk_attn_rows, rlk_attn_merge,
                                                        rlk_attn_finish)

__all__ = ["KERNEL_NAMES", "DEVICE_FUNCTIONS", "rlk_attn_ws_load", "rlk_attn_combine"]

KERNEL_NAMES = ("rlk_attn_combine",)
#: ``@triton.jit`` device functions in this module's namespace (its own and the shared ones it
#: calls from ``device``), never launched on their own.
DEVICE_FUNCTIONS = ("rlk_attn_ws_load", "rlk_attn_gdc_wait", "rlk_attn_rows", "rlk_attn_merge", "rlk_attn_finish")


@triton.jit
def rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j, n, valid, offs_d, HEAD_D: tl.constexpr,
                     BLOCK_M: tl.constexpr):
    """Split ``j`` of a tile's workspace, ``(m, l, a[:, offs_d])``; a padding row, or a split past
    the tile's last (``j >= n``), reads the initial state ``(-inf, 0, +0)``, whose merge is an
    exact identity (``rlk_attn_merge``)."""
    slot = (base + j) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = valid & (tl.full([BLOCK_M], j, tl.int32) < n)  # (a vector compare: the interpreter's & of a
    # vector and a scalar compare gives an int32 mask that its load rejects)
    m = tl.load(ws_m_ptr + slot, mask=ok, other=float("-inf"))
    l = tl.load(ws_l_ptr + slot, mask=ok, other=0.0)
    a = tl.load(ws_a_ptr + slot[:, None] * HEAD_D + offs_d[None, :], mask=ok[:, None], other=0.0)
    return m, l, a


@triton.jit
def rlk_attn_combine(out_ptr, out32_ptr, lse_ptr, ws_m_ptr, ws_l_ptr, ws_a_ptr, tab_ptr, G: tl.constexpr, W, NS,
                     HQ, HKV, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, DC: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, STORE_F32: tl.constexpr, STORE_LSE: tl.constexpr, ONE: tl.constexpr,
                     PDL: tl.constexpr, SB: tl.constexpr, GROUP: tl.constexpr):
    """Fold a tile's splits ``0 .. n-1`` left to right with ``rlk_attn_merge``, then finish.

    Grid (tiles, kv heads, ``HEAD_D / DC``): each program takes ``DC`` columns of the
    accumulator (a column's merge reads only that column and the row's ``m``, ``l``, which every
    chunk merges alike). The loads of a group of splits are issued before their merges: the
    fold is a chain, but its loads are not, and one load round-trip per split is most of a
    long decode step's combine (20.5 µs for 32 splits at batch 1 on the H200; 6.5 µs with
    groups of eight). ``GROUP`` (1, 2, 4, 8 or 16: ``combine_group``, the launch's
    split count rounded up to a power of two, at most 16) splits are loaded, then merged, per
    trip: a step of 4 splits merges 4 times, not 16. Splits past the last read the
    initial state, an exact identity, so the group size does not change the bits. The merge
    order is unchanged.

    Under programmatic dependent launch the program reads its tile's table row before it waits
    for the split kernel: the table (or ``q_pos``) was written before the split kernel passed its
    own wait, which every split program did before this launch, so only the workspace loads wait
    (one dependent load round trip off the step's tail)."""
    t = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    dc = tl.program_id(2)
    seq, valid, tok, g, pos, wlo, lo, hi, first, last, cap = rlk_attn_rows(tab_ptr, t, G, W, HAS_WINDOW, BLOCK_M,
                                                                           ONE)
    if last >= 0:
        rlk_attn_gdc_wait(PDL)
        offs_d = dc * DC + tl.arange(0, DC)
        head = kvh * G + g
        n = last // SB - first // SB + 1
        base = (t.to(tl.int64) * HKV + kvh) * NS
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.zeros([BLOCK_M], tl.float32)
        A = tl.zeros([BLOCK_M, DC], tl.float32)
        for j in range(0, n, GROUP):  # GROUP loads in flight, then GROUP merges in order
            m0, l0, a0 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 0, n, valid, offs_d,
                                          HEAD_D, BLOCK_M)
            if GROUP >= 2:
                m1, l1, a1 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 1, n, valid, offs_d,
                                              HEAD_D, BLOCK_M)
            if GROUP >= 4:
                m2, l2, a2 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 2, n, valid, offs_d,
                                              HEAD_D, BLOCK_M)
                m3, l3, a3 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 3, n, valid, offs_d,
                                              HEAD_D, BLOCK_M)
            if GROUP >= 8:
                m4, l4, a4 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 4, n, valid, offs_d,
                                              HEAD_D, BLOCK_M)
                m5, l5, a5 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 5, n, valid, offs_d,
                                              HEAD_D, BLOCK_M)
                m6, l6, a6 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 6, n, valid, offs_d,
                                              HEAD_D, BLOCK_M)
                m7, l7, a7 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 7, n, valid, offs_d,
                                              HEAD_D, BLOCK_M)
            if GROUP >= 16:
                m8, l8, a8 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 8, n, valid, offs_d,
                                              HEAD_D, BLOCK_M)
                m9, l9, a9 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 9, n, valid, offs_d,
                                              HEAD_D, BLOCK_M)
                m10, l10, a10 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 10, n, valid, offs_d,
                                                 HEAD_D, BLOCK_M)
                m11, l11, a11 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 11, n, valid, offs_d,
                                                 HEAD_D, BLOCK_M)
                m12, l12, a12 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 12, n, valid, offs_d,
                                                 HEAD_D, BLOCK_M)
                m13, l13, a13 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 13, n, valid, offs_d,
                                                 HEAD_D, BLOCK_M)
                m14, l14, a14 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 14, n, valid, offs_d,
                                                 HEAD_D, BLOCK_M)
                m15, l15, a15 = rlk_attn_ws_load(ws_m_ptr, ws_l_ptr, ws_a_ptr, base, j + 15, n, valid, offs_d,
                                                 HEAD_D, BLOCK_M)
            M, L, A = rlk_attn_merge(M, L, A, m0, l0, a0)
            if GROUP >= 2:
                M, L, A = rlk_attn_merge(M, L, A, m1, l1, a1)
            if GROUP >= 4:
                M, L, A = rlk_attn_merge(M, L, A, m2, l2, a2)
                M, L, A = rlk_attn_merge(M, L, A, m3, l3, a3)
            if GROUP >= 8:
                M, L, A = rlk_attn_merge(M, L, A, m4, l4, a4)
                M, L, A = rlk_attn_merge(M, L, A, m5, l5, a5)
                M, L, A = rlk_attn_merge(M, L, A, m6, l6, a6)
                M, L, A = rlk_attn_merge(M, L, A, m7, l7, a7)
            if GROUP >= 16:
                M, L, A = rlk_attn_merge(M, L, A, m8, l8, a8)
                M, L, A = rlk_attn_merge(M, L, A, m9, l9, a9)
                M, L, A = rlk_attn_merge(M, L, A, m10, l10, a10)
                M, L, A = rlk_attn_merge(M, L, A, m11, l11, a11)
                M, L, A = rlk_attn_merge(M, L, A, m12, l12, a12)
                M, L, A = rlk_attn_merge(M, L, A, m13, l13, a13)
                M, L, A = rlk_attn_merge(M, L, A, m14, l14, a14)
                M, L, A = rlk_attn_merge(M, L, A, m15, l15, a15)
        rlk_attn_finish(M, L, A, out_ptr, out32_ptr, lse_ptr, (tok * HQ + head) * HEAD_D, tok * HQ + head, valid,
                        valid & (tl.full([BLOCK_M], dc, tl.int32) == 0), offs_d, STORE_F32, STORE_LSE)
