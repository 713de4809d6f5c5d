"""The portable Triton backward kernels of ``attention.varlen_attention`` (varlen / train path;
packed layout: key row of position ``p`` = ``cu[seq] + p``), deterministic, no atomics:

* ``rlk_attn_bwd_delta``    ``delta = Σ_d dO ⊙ O`` (fp32, fixed pairwise tree over ``D``);
* ``rlk_attn_bwd_dq``       each query tile over its KV blocks, increasing;
* ``rlk_attn_bwd_dkdv``     each 64-key block over the query blocks that see it, increasing,
  the GQA group rows in order ``g = 0 .. G-1``.

Launched by ``launch.varlen_backward``; the block bodies are ``rlk_attn_bwd_dq_block`` and
``rlk_attn_bwd_dkdv_block``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rl_engine.backends.triton.attention.device import (rlk_attn_exp2, rlk_attn_rowsum, rlk_attn_rows)

__all__ = ["KERNEL_NAMES", "DEVICE_FUNCTIONS", "rlk_attn_bwd_dq_block", "rlk_attn_bwd_dkdv_block",
           "rlk_attn_bwd_delta", "rlk_attn_bwd_dq", "rlk_attn_bwd_dkdv"]

KERNEL_NAMES = ("rlk_attn_bwd_delta", "rlk_attn_bwd_dq", "rlk_attn_bwd_dkdv")
#: ``@triton.jit`` device functions in this module's namespace (its own and the shared ones it
#: calls from ``device``), never launched on their own.
DEVICE_FUNCTIONS = ("rlk_attn_bwd_dq_block", "rlk_attn_bwd_dkdv_block", "rlk_attn_exp2", "rlk_attn_rowsum",
                    "rlk_attn_rows")


@triton.jit
def rlk_attn_bwd_dq_block(q, do, lse2, delta, dq, k_ptr, v_ptr, base, cap, kvh, pos, wlo, valid, b, qk_scale,
                          HKV, HEAD_D: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
    """``dq += dS · K`` for key block ``b`` (``MASKED=False``: every row of the tile sees the
    whole block, the masks are identities and are left out)."""
    offs_n = tl.arange(0, 64)
    offs_d = tl.arange(0, HEAD_D)
    kpos = b * 64 + offs_n
    off = ((base + tl.minimum(kpos, cap).to(tl.int64)) * HKV + kvh) * HEAD_D
    kt = tl.load(k_ptr + off[None, :] + offs_d[:, None])  # [D, 64]
    vt = tl.load(v_ptr + off[None, :] + offs_d[:, None])  # [D, 64]
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
        dp = tl.dot(do, vt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
        dp = tl.dot(do, vt)
    if MASKED:
        vis = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] >= wlo[:, None]) & valid[:, None]
        s = tl.where(vis, s, float("-inf"))
    p = rlk_attn_exp2(tl.fma(s, qk_scale, -lse2[:, None]))  # lse2 = lse · log2 e
    ds = p * (dp - delta[:, None])
    if MASKED:
        ds = tl.where(vis, ds, 0.0)
    if IEEE:
        dq = tl.dot(ds, tl.trans(kt), dq, input_precision="ieee")
    else:
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
    return dq


@triton.jit
def rlk_attn_bwd_dkdv_block(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, base, kvh, kpos, kvalid, n, qb, G, W,
                            qk_scale, HQ, HEAD_D: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
                            MASKED: tl.constexpr):
    """``dv += Pᵀ dO``, ``dk += dSᵀ Q`` for the 64-position query block ``qb``, group rows
    ``g = 0 .. G-1`` in order (``MASKED=False``: every pair of the block is visible and valid)."""
    offs_d = tl.arange(0, HEAD_D)
    qpos = qb * 64 + tl.arange(0, 64).to(tl.int64)
    qvalid = qpos < n
    vis = (qpos[:, None] >= kpos[None, :]) & qvalid[:, None] & kvalid[None, :]
    if HAS_WINDOW:
        vis = vis & (qpos[:, None] <= kpos[None, :] + W - 1)
    for g in range(0, G):
        r_off = (base + qpos) * HQ + kvh * G + g
        qo = r_off[:, None] * HEAD_D + offs_d[None, :]
        if MASKED:
            q = tl.load(q_ptr + qo, mask=qvalid[:, None], other=0.0)
            do = tl.load(do_ptr + qo, mask=qvalid[:, None], other=0.0)
            lse = tl.load(lse_ptr + r_off, mask=qvalid, other=0.0)
            delta = tl.load(delta_ptr + r_off, mask=qvalid, other=0.0)
        else:
            q = tl.load(q_ptr + qo)
            do = tl.load(do_ptr + qo)
            lse = tl.load(lse_ptr + r_off)
            delta = tl.load(delta_ptr + r_off)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
            dp = tl.dot(do, tl.trans(v))
        if MASKED:
            s = tl.where(vis, s, float("-inf"))
        p = rlk_attn_exp2(tl.fma(s, qk_scale, -(lse * 1.4426950408889634)[:, None]))
        ds = p * (dp - delta[:, None])
        if MASKED:
            ds = tl.where(vis, ds, 0.0)
        if IEEE:
            dv = tl.dot(tl.trans(p), do, dv, input_precision="ieee")
            dk = tl.dot(tl.trans(ds), q, dk, input_precision="ieee")
        else:
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv)
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk)
    return dk, dv


@triton.jit
def rlk_attn_bwd_delta(do_ptr, o_ptr, delta_ptr, R, HEAD_D: tl.constexpr, LOG2D: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    """``delta[r] = Σ_d dO[r, d] · O[r, d]`` in fp32 by the fixed pairwise tree."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HEAD_D)
    mask = rows[:, None] < R
    do = tl.load(do_ptr + rows[:, None] * HEAD_D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + rows[:, None] * HEAD_D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + rows, rlk_attn_rowsum(do * o, BLOCK_R, HEAD_D, LOG2D), mask=rows < R)


@triton.jit
def rlk_attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, tab_ptr, pr_ptr, G: tl.constexpr, W,
                    qk_scale, scale,
                    HQ, HKV, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    seq, valid, tok, g, pos, wlo, lo, hi, first, last, cap = rlk_attn_rows(tab_ptr, t, G, W, HAS_WINDOW, BLOCK_M,
                                                                           False)
    if last >= 0:
        offs_d = tl.arange(0, HEAD_D)
        head = kvh * G + g
        r_off = tok * HQ + head
        q_off = r_off * HEAD_D
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        do = tl.load(do_ptr + q_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        lse2 = tl.load(lse_ptr + r_off, mask=valid, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + r_off, mask=valid, other=0.0)
        base = tl.load(pr_ptr + seq)
        dq = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        # blocks first .. last in order: masked, then those every valid row sees whole, then masked
        if SPLIT:
            f0 = (tl.max(tl.where(valid, wlo, 0), axis=0) + 63) // 64
            f1 = (tl.min(tl.where(valid, pos, 1 << 30), axis=0) + 1) // 64 - 1
            u0 = tl.maximum(first, f0)
            u1 = tl.minimum(last, f1)
            u1 = tl.where(u1 >= u0, u1, first - 1)
            u0 = tl.where(u1 >= u0, u0, last + 1)
            e1 = tl.minimum(u0 - 1, last)
            for b in range(first, e1 + 1):
                dq = rlk_attn_bwd_dq_block(q, do, lse2, delta, dq, k_ptr, v_ptr, base, cap, kvh, pos, wlo, valid,
                                           b, qk_scale, HKV, HEAD_D, IEEE, True)
            for b in range(u0, u1 + 1):
                dq = rlk_attn_bwd_dq_block(q, do, lse2, delta, dq, k_ptr, v_ptr, base, cap, kvh, pos, wlo, valid,
                                           b, qk_scale, HKV, HEAD_D, IEEE, False)
            for b in range(tl.maximum(u1 + 1, e1 + 1), last + 1):
                dq = rlk_attn_bwd_dq_block(q, do, lse2, delta, dq, k_ptr, v_ptr, base, cap, kvh, pos, wlo, valid,
                                           b, qk_scale, HKV, HEAD_D, IEEE, True)
        else:  # one masked run (see rlk_attn_split)
            for b in range(first, last + 1):
                dq = rlk_attn_bwd_dq_block(q, do, lse2, delta, dq, k_ptr, v_ptr, base, cap, kvh, pos, wlo, valid,
                                           b, qk_scale, HKV, HEAD_D, IEEE, True)
        dq = dq * scale
        tl.store(dq_ptr + q_off[:, None] + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def rlk_attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, ktab_ptr, cu_ptr, G, W,
                      qk_scale, scale, HQ, HKV, HEAD_D: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    seq = tl.load(ktab_ptr + t * 4)
    kb = tl.load(ktab_ptr + t * 4 + 1)
    n = tl.load(ktab_ptr + t * 4 + 2)  # sequence length (0: no block here)
    if n > 0:
        base = tl.load(cu_ptr + seq)
        offs_d = tl.arange(0, HEAD_D)
        offs = tl.arange(0, 64).to(tl.int64)
        kpos = kb * 64 + offs
        kvalid = kpos < n
        koff = ((base + kpos) * HKV + kvh) * HEAD_D
        k = tl.load(k_ptr + koff[:, None] + offs_d[None, :], mask=kvalid[:, None], other=0.0)  # [64, D]
        v = tl.load(v_ptr + koff[:, None] + offs_d[None, :], mask=kvalid[:, None], other=0.0)
        dk = tl.zeros([64, HEAD_D], tl.float32)
        dv = tl.zeros([64, HEAD_D], tl.float32)
        qlast = n - 1
        if HAS_WINDOW:
            qlast = tl.minimum(qlast, kb * 64 + 63 + W - 1)
        q1 = qlast // 64
        # query blocks kb .. q1 in order: the diagonal block (masked), the blocks whose every
        # (query, key) pair is visible and valid (unmasked), the rest (masked)
        if SPLIT:
            u1 = n // 64 - 1  # last query block with 64 valid rows
            if HAS_WINDOW:
                u1 = tl.minimum(u1, (kb * 64 + W - 64) // 64)  # 64·qb + 63 <= 64·kb + W - 1
            u1 = tl.where(kb * 64 + 64 <= n, tl.minimum(u1, q1), kb)  # keys all valid, else no unmasked run
            for qb in range(kb, kb + 1):
                dk, dv = rlk_attn_bwd_dkdv_block(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, base, kvh, kpos,
                                                 kvalid, n, qb, G, W, qk_scale, HQ, HEAD_D, HAS_WINDOW, IEEE, True)
            for qb in range(kb + 1, u1 + 1):
                dk, dv = rlk_attn_bwd_dkdv_block(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, base, kvh, kpos,
                                                 kvalid, n, qb, G, W, qk_scale, HQ, HEAD_D, HAS_WINDOW, IEEE, False)
            for qb in range(tl.maximum(u1, kb) + 1, q1 + 1):
                dk, dv = rlk_attn_bwd_dkdv_block(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, base, kvh, kpos,
                                                 kvalid, n, qb, G, W, qk_scale, HQ, HEAD_D, HAS_WINDOW, IEEE, True)
        else:  # one masked run (see rlk_attn_split)
            for qb in range(kb, q1 + 1):
                dk, dv = rlk_attn_bwd_dkdv_block(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, base, kvh, kpos,
                                                 kvalid, n, qb, G, W, qk_scale, HQ, HEAD_D, HAS_WINDOW, IEEE, True)
        dk = dk * scale
        tl.store(dk_ptr + koff[:, None] + offs_d[None, :], dk.to(dk_ptr.dtype.element_ty), mask=kvalid[:, None])
        tl.store(dv_ptr + koff[:, None] + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kvalid[:, None])
