"""The ``@triton.jit`` device functions every attention kernel shares (inlined into the kernels,
never launched on their own), so that one expression compiles one way on every path.

The row bookkeeping ``rlk_attn_rows`` (from a tile-table row, ``rlk_attn_table_row``, or a split
program's grid axes, ``rlk_attn_split_ids``), the key / value row addresses ``rlk_attn_kv_rows``
and loads ``rlk_attn_load``, the block body ``rlk_attn_block`` (scores ``rlk_attn_scores``, the
online-softmax step ``rlk_attn_step``), the multi-block steps ``rlk_attn_pair`` / ``rlk_attn_quad``
and the unmasked run's walk ``rlk_attn_unmasked``, the split ``rlk_attn_split``, the merge
``rlk_attn_merge``, the final division ``rlk_attn_finish``, the fixed pairwise row sum
``rlk_attn_rowsum``, the flush-to-zero ``rlk_attn_exp2`` and the programmatic-dependent-launch
hooks ``rlk_attn_gdc_wait`` / ``rlk_attn_gdc_launch``. The algorithm and the rules that make every
path give the same bits are in the package docstring (``__init__.py``) and docs/design/attention.md
("GPU (Triton)").
"""

from __future__ import annotations

import triton
import triton.language as tl

from rl_engine.backends.triton.attention.configs import COMPILED_CUDA

__all__ = [
    "rlk_attn_gdc_wait",
    "rlk_attn_gdc_launch",
    "rlk_attn_exp2",
    "rlk_attn_rowsum",
    "rlk_attn_split_ids",
    "rlk_attn_table_row",
    "rlk_attn_rows",
    "rlk_attn_kv_rows",
    "rlk_attn_kv_base",
    "rlk_attn_pages",
    "rlk_attn_load_rows",
    "rlk_attn_load_paged",
    "rlk_attn_load",
    "rlk_attn_scores",
    "rlk_attn_step",
    "rlk_attn_block",
    "rlk_attn_pair",
    "rlk_attn_pair_step",
    "rlk_attn_rowsum3",
    "rlk_attn_quarters",
    "rlk_attn_vblock",
    "rlk_attn_quad",
    "rlk_attn_unmasked",
    "rlk_attn_split",
    "rlk_attn_merge",
    "rlk_attn_finish",
]

#: ``@triton.jit`` device functions (inlined into the kernels, never launched on their own).
DEVICE_FUNCTIONS = tuple(__all__)

#: ``rlk_attn_exp2`` as the flush-to-zero ``ex2`` (CUDA, compiled kernels); the Triton interpreter
#: and ROCm (no PTX inline assembly) take ``tl.exp2`` (``configs.COMPILED_CUDA``).
_FTZ_EXP = tl.constexpr(COMPILED_CUDA)


@triton.jit
def rlk_attn_gdc_wait(PDL: tl.constexpr):
    """Before the first load of data a preceding kernel of the step writes (a no-op unless
    launched with programmatic dependent launch; compiled in only for ``PDL``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def rlk_attn_gdc_launch(PDL: tl.constexpr):
    """Let the next kernel of the step launch now (it waits in ``rlk_attn_gdc_wait``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def rlk_attn_exp2(x):
    """``2^x`` in fp32 as ``ex2.approx.ftz``: the instruction of ``tl.exp2`` (MUFU.EX2) for results
    of at least ``2^-126``; below, ``tl.exp2``'s ``ex2.approx.f32`` halves the input and squares
    the result (a compare, two predicated multiplies and their latency on every element: on the
    H200, by ncu, the largest stall of the prefill kernel) to return a subnormal, this returns
    +0. ``2^{-inf} = +0`` either way. The kernels keep scores and softmax maxima in base-2 units
    (``qk_scale = scale · log2 e``, ``rlk_attn_step``), so no product precedes the ``ex2``. Every
    forward and backward kernel uses this one function, so every path keeps the same bits; a
    probability below ``2^-126`` is below fp32 resolution next to the row's maximum term anyway."""
    if _FTZ_EXP:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def rlk_attn_rowsum(x, BLOCK_M: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """``Σ_j x[:, j]`` by the fixed pairwise fold of the CPU backend's ``fold_sum``
    (``x[:, :N/2] + x[:, N/2:]``, then halving, ``LOG2N`` steps): every step is an elementwise
    IEEE add, so a row's sum depends only on the row, never on the register layout.

    The halves are strided (columns ``j`` and ``j + N/2``) rather than adjacent pairs: in the
    MMA accumulator layouts (wgmma and mma.sync alike) a thread holds columns ``j`` and
    ``j + 8·i``, so the first ``LOG2N - 3`` steps pair values inside one thread and the
    reshape/permute/split are relabelings of registers, not shared-memory layout conversions."""
    for i in tl.static_range(LOG2N):
        x = tl.reshape(x, [BLOCK_M, 2, N >> (i + 1)])
        a, b = tl.split(tl.permute(x, (0, 2, 1)))
        x = a + b
    return tl.reshape(x, [BLOCK_M])


@triton.jit
def rlk_attn_split_ids(ORDER: tl.constexpr):
    """A decode split program's ``(tile, kv head (int64), split · value slices + slice)`` from the
    grid axes in the order ``ORDER`` (``configs.split_grid_order``; which of them the hardware schedules
    fastest): 0 ``(tiles, kv heads, splits)``, 1 ``(kv heads, tiles, splits)``, 2 ``(splits, tiles,
    kv heads)``. Shared by ``rlk_attn_fwd_split`` and the Gluon split kernels
    (``hopper_common.rlk_attn_wgd_program``: a Gluon kernel inlines this function as it is)."""
    if ORDER == 1:  # kv heads fastest
        t = tl.program_id(1)
        kvh = tl.program_id(0).to(tl.int64)
        js = tl.program_id(2)
    elif ORDER == 2:  # splits fastest
        t = tl.program_id(1)
        kvh = tl.program_id(2).to(tl.int64)
        js = tl.program_id(0)
    else:  # tiles fastest
        t = tl.program_id(0)
        kvh = tl.program_id(1).to(tl.int64)
        js = tl.program_id(2)
    return t, kvh, js


@triton.jit
def rlk_attn_table_row(tab_ptr, t64, G: tl.constexpr, ONE: tl.constexpr):
    """Tile ``t64``'s table row ``(seq, unit0, unit1, pos_base)`` (int64 scalars; ``rlk_attn_rows``):
    read from the tile table, or, for ``ONE`` (``tab_ptr`` is ``q_pos``, tile ``t`` is sequence
    ``t``'s one token), formed as ``[t, t·G, t·G + G, t - q_pos[t]]``. Shared with the Gluon split
    kernels (``hopper_common.rlk_attn_wgd_program``)."""
    if ONE:
        seq = t64
        u0 = t64 * G
        u1 = u0 + G
        pbase = t64 - tl.load(tab_ptr + t64)
    else:
        seq = tl.load(tab_ptr + t64 * 4)
        u0 = tl.load(tab_ptr + t64 * 4 + 1)
        u1 = tl.load(tab_ptr + t64 * 4 + 2)
        pbase = tl.load(tab_ptr + t64 * 4 + 3)
    return seq, u0, u1, pbase


@triton.jit
def rlk_attn_rows(tab_ptr, t, G: tl.constexpr, W, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                  ONE: tl.constexpr):
    """Rows of query tile ``t``: ``(seq, valid, tok, g, pos, wlo, lo, hi, first, last, cap)``.

    Tile table row ``[seq, unit0, unit1, pos_base]``: the tile holds units ``unit0 .. unit1-1``
    (unit = token·G + g, g fastest) of batch sequence ``seq``; token ``tok`` sits at position
    ``tok - pos_base``. Padding rows get ``lo = BIG``, ``hi = -1`` (never active).

    ``ONE`` (a decode step with exactly one new token per sequence and ``G <= BLOCK_M``):
    ``tab_ptr`` is ``q_pos`` and tile ``t`` is sequence ``t``'s one token, so its table row is
    ``[t, t·G, t·G + G, t - q_pos[t]]`` (what ``launch.tile_table`` gives such a step) and is formed here
    instead of read: no table kernel runs before the step.

    ``G`` is a compile-time constant and the per-row arithmetic is int32 relative to ``unit0``
    (one scalar int64 division per program): a runtime int64 ``unit // G`` per row compiles to
    the 64-bit division subroutine, ~1/3 of a kernel's extra instructions per program against
    the ablation probe (H200). Same integers."""
    seq, u0, u1, pbase = rlk_attn_table_row(tab_ptr, t.to(tl.int64), G, ONE)
    tok0 = u0 // G
    rel = (u0 - tok0 * G).to(tl.int32) + tl.arange(0, BLOCK_M)  # unit - G·tok0, in [0, G + BLOCK_M)
    valid = tl.arange(0, BLOCK_M).to(tl.int64) < u1 - u0
    tq = rel // G
    g = rel - tq * G
    tok = tok0 + tq
    pos = tl.where(valid, tok - pbase, 0).to(tl.int32)  # positions < 2**31: int32 keeps masks cheap
    if HAS_WINDOW:
        wlo = tl.maximum(pos - W + 1, 0)
    else:
        wlo = tl.zeros_like(pos)
    lo = tl.where(valid, wlo // 64, 1 << 30)
    hi = tl.where(valid, pos // 64, -1)
    first = tl.min(lo, axis=0)
    last = tl.max(hi, axis=0)
    cap = tl.max(tl.where(valid, pos, 0), axis=0)
    return seq, valid, tok, g, pos, wlo, lo, hi, first, last, cap


@triton.jit
def rlk_attn_kv_rows(pr_ptr, seq, pr_stride, page_size, kbase, kpos, PAGED: tl.constexpr):
    """Storage rows (int64) of key positions ``kpos`` (int32) of batch sequence ``seq``: through
    the page table, or ``kbase + kpos`` for a contiguous cache (``kbase = page_rows[seq, 0]``,
    loaded once per program by ``rlk_attn_kv_base`` so that no block's loads wait on a dependent
    scalar load). ``page_size`` is a compile-time constant of the forward kernels: the page
    arithmetic is an int32 shift / multiply, not a 64-bit division per key of every block."""
    if PAGED:
        page = tl.load(pr_ptr + seq * pr_stride + kpos // page_size)
        return page + (kpos % page_size).to(tl.int64)
    else:
        return kbase + kpos.to(tl.int64)


@triton.jit
def rlk_attn_kv_base(pr_ptr, seq, pr_stride):
    """``page_rows[seq, 0]``: the storage row of position 0 of a contiguous cache (int64)."""
    return tl.load(pr_ptr + seq * pr_stride).to(tl.int64)


@triton.jit
def rlk_attn_pages(pr_ptr, seq, pr_stride, page_size, cap, b):
    """The page-table entries (int64 storage rows of each key's page) of block ``b``'s 64 keys,
    positions clamped to ``cap`` as ``rlk_attn_load`` clamps them."""
    kpos = tl.minimum(b * 64 + tl.arange(0, 64), cap)
    return tl.load(pr_ptr + seq * pr_stride + kpos // page_size)


@triton.jit
def rlk_attn_load_rows(k_ptr, v_ptr, rows, kvh, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D: tl.constexpr):
    """Pointer loads of one block: the keys of storage ``rows`` (int64, ``[64]``) transposed
    (``[D, 64]``) and their value rows (``[64, DV]``, columns ``offs_v``), kv head ``kvh``."""
    offs_d = tl.arange(0, HEAD_D)
    koff = rows * sk_row + kvh * sk_head
    voff = rows * sv_row + kvh * sv_head
    kt = tl.load(k_ptr + koff[None, :] + offs_d[:, None])  # [D, 64]
    v = tl.load(v_ptr + voff[:, None] + offs_v[None, :])  # [64, DV]
    return kt, v


@triton.jit
def rlk_attn_load_paged(k_ptr, v_ptr, pages, page_size, cap, kvh, b, sk_row, sk_head, sv_row, sv_head, offs_v,
                        HEAD_D: tl.constexpr):
    """``rlk_attn_load``'s pointer loads over a paged cache with block ``b``'s page-table entries
    ``pages`` already loaded (``rlk_attn_pages``): the same rows, so the same values."""
    kpos = tl.minimum(b * 64 + tl.arange(0, 64), cap)
    rows = pages + (kpos % page_size).to(tl.int64)
    return rlk_attn_load_rows(k_ptr, v_ptr, rows, kvh, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D)


@triton.jit
def rlk_attn_load(k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, b, sk_row, sk_head,
                  sv_row, sv_head, offs_v, HEAD_D: tl.constexpr, PAGED: tl.constexpr, TMA: tl.constexpr, v0):
    """Key block ``b`` transposed (``[D, 64]``) and its value rows (``[64, DV]``, columns ``offs_v``):
    by pointers, positions clamped to ``cap``, or by TMA copies (``rlk_attn_block``; ``v0`` is
    the first of the ``offs_v`` columns, the value copy's column offset)."""
    if TMA:
        row0 = (kbase + b * 64).to(tl.int32)
        col = (kvh * HEAD_D).to(tl.int32)
        kt = tl.trans(k_desc.load([row0, col]))  # [D, 64]
        v = v_desc.load([row0, col + v0])  # [64, DV]
    else:
        kpos = b * 64 + tl.arange(0, 64)
        rows = rlk_attn_kv_rows(pr_ptr, seq, pr_stride, page_size, kbase, tl.minimum(kpos, cap), PAGED)
        kt, v = rlk_attn_load_rows(k_ptr, v_ptr, rows, kvh, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D)
    return kt, v


@triton.jit
def rlk_attn_scores(q, kt, IEEE: tl.constexpr):
    """``q · kᵀ`` of one block, fp32 ``[BLOCK_M, 64]``, unscaled (``rlk_attn_step`` applies the
    scale inside the exponent's multiply-add)."""
    if IEEE:
        return tl.dot(q, kt, input_precision="ieee")
    else:
        return tl.dot(q, kt)


@triton.jit
def rlk_attn_step(s, v, b, m, l, acc, pos, wlo, qk_scale, BLOCK_M: tl.constexpr, IEEE: tl.constexpr,
                  MASKED: tl.constexpr):
    """The online-softmax update of the state ``(m, l, acc)`` by block ``b``'s unscaled scores
    ``s = q·kᵀ`` and value rows ``v`` (``rlk_attn_block``), in base-2 units: ``qk_scale = c =
    scale · log2 e``, the running maximum ``m = max_j (max_k s_jk) · c`` (one product per row: a
    product by ``c > 0`` is monotone, so this is the maximum of the products) and
    ``P = 2^{fma(s, c, −m)}`` (one multiply-add per score, rounded once, then ``ex2``; the
    product ``s·c`` itself is never rounded). ``e^{scale·s − m_e}`` of the textbook is the same
    number, computed with two fewer fp32 operations per score."""
    if MASKED:
        kpos = b * 64 + tl.arange(0, 64)
        vis = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] >= wlo[:, None])
        s = tl.where(vis, s, float("-inf"))
        mn = tl.maximum(m, tl.max(s, axis=1) * qk_scale + 0.0)
        shift = tl.where(mn == float("-inf"), 0.0, mn)
    else:
        mn = tl.maximum(m, tl.max(s, axis=1) * qk_scale + 0.0)
        shift = mn
    alpha = rlk_attn_exp2(m - shift)
    p = rlk_attn_exp2(tl.fma(s, qk_scale, -shift[:, None]))  # exactly +0 where s is -inf (a row that sees no key)
    l = tl.fma(l, alpha, rlk_attn_rowsum(p, BLOCK_M, 64, 6))
    if IEEE:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return mn, l, acc


@triton.jit
def rlk_attn_block(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, pos, wlo, b,
                   m, l, acc, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, PAGED: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr,
                   TMA: tl.constexpr, v0):
    """One 64-key block ``b`` of the online softmax. ``MASKED=False`` is only used for blocks
    every row of the tile sees entirely (``wlo <= 64·b`` and ``64·b + 63 <= pos``, so every row is
    active): there the score mask and the -inf guard are identities and are left out, the
    arithmetic of the visible entries is the same, hence the same bits (the kernels are compiled
    with ``enable_fp_fusion=False``, so no multiply-add is contracted in one variant only).

    A row that sees no key of a masked block (the block is outside its range ``[lo, hi]``, or a
    padding row) keeps its state exactly, without a per-row select: its scores are all ``-inf``,
    so ``m' = max(m, -inf) = m``. With ``m`` finite, ``α = 2^0 = 1``, ``P = +0`` and
    ``l·1 + 0 = l``, ``acc·1 + 0 = acc`` (never ``-0``); with ``m = -inf`` (no key seen yet) the
    shift is taken as 0, so ``α = P = 0`` and the state stays ``(-inf, +0, +0)``. A row inside
    its range sees at least one key of the block (its visible keys are contiguous), so ``m'`` is
    finite and the guard changes nothing.

    ``offs_v``: the value columns this program accumulates (all ``HEAD_D``, or a slice of
    ``AttnConfig.v_slices``); the scores use the whole head dim either way.

    ``TMA``: the block's 64 key and value rows arrive by one tensor-memory-accelerator copy each
    from row ``kbase + 64·b`` of the ``[rows, Hkv·D]`` view, without the clamp to ``cap``. Used
    for every block of the train path's packed rows (``Variant.PACKED_TMA``: the rows past the tile's last
    query are the next tokens of the pack, assumed finite inputs (``"raise"`` checks them), or the
    copy's zero fill past the end, and their scores are masked to ``-inf``, ``P = +0``), and for
    the unmasked blocks of a decode step over a contiguous cache (``Variant.CACHE_TMA``: rows
    at or before every query position; ``rlk_attn_split``'s masked blocks keep the clamp). The
    same values reach the same products, so the same bits."""
    kt, v = rlk_attn_load(k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, b, sk_row,
                          sk_head, sv_row, sv_head, offs_v, HEAD_D, PAGED, TMA, v0)
    s = rlk_attn_scores(q, kt, IEEE)
    return rlk_attn_step(s, v, b, m, l, acc, pos, wlo, qk_scale, BLOCK_M, IEEE, MASKED)


@triton.jit
def rlk_attn_pair(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, pos, wlo, b,
                  m, l, acc, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, PAGED: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, v0):
    """Blocks ``b`` and ``b + 1``, both seen entirely by every row (the unmasked run), as the two
    ``rlk_attn_block`` steps in order (``AttnConfig.unroll = 2``), their work issued phase by
    phase: both blocks' loads, score products and row maxima, then both exponentials and row
    sums, then the two ``P·V`` products. Only the order of independent work changes (the scores
    of a block do not depend on the state); the running maximum, ``l`` and the accumulator take
    block ``b`` then block ``b + 1`` with the same operations as two single steps, so the same
    bits. In a 16-row decode tile each block's step is a latency chain (cross-warp reductions,
    a shared-memory round trip for ``P``), which this lets the compiler overlap between blocks."""
    kt0, va = rlk_attn_load(k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, b, sk_row,
                            sk_head, sv_row, sv_head, offs_v, HEAD_D, PAGED, TMA, v0)
    kt1, vb = rlk_attn_load(k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, b + 1,
                            sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D, PAGED, TMA, v0)
    return rlk_attn_pair_step(q, kt0, va, kt1, vb, m, l, acc, qk_scale, BLOCK_M, IEEE)


@triton.jit
def rlk_attn_pair_step(q, kt0, va, kt1, vb, m, l, acc, qk_scale, BLOCK_M: tl.constexpr, IEEE: tl.constexpr):
    """``rlk_attn_pair``'s arithmetic on two loaded unmasked blocks (keys ``kt0``, ``kt1``
    transposed, values ``va``, ``vb``), in block order."""
    s0 = rlk_attn_scores(q, kt0, IEEE)
    s1 = rlk_attn_scores(q, kt1, IEEE)
    # as rlk_attn_step (unmasked): mn = max(m, max(s)·c + 0), shift = mn, for b then b + 1
    x0 = tl.max(s0, axis=1) * qk_scale + 0.0
    x1 = tl.max(s1, axis=1) * qk_scale + 0.0
    mn0 = tl.maximum(m, x0)
    mn1 = tl.maximum(mn0, x1)
    alpha0 = rlk_attn_exp2(m - mn0)
    alpha1 = rlk_attn_exp2(mn0 - mn1)
    p0 = rlk_attn_exp2(tl.fma(s0, qk_scale, -mn0[:, None]))
    p1 = rlk_attn_exp2(tl.fma(s1, qk_scale, -mn1[:, None]))
    r0 = rlk_attn_rowsum(p0, BLOCK_M, 64, 6)
    r1 = rlk_attn_rowsum(p1, BLOCK_M, 64, 6)
    l = tl.fma(tl.fma(l, alpha0, r0), alpha1, r1)
    if IEEE:
        acc = tl.dot(p0, va, acc * alpha0[:, None], input_precision="ieee")
        acc = tl.dot(p1, vb, acc * alpha1[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p0.to(va.dtype), va, acc * alpha0[:, None])
        acc = tl.dot(p1.to(vb.dtype), vb, acc * alpha1[:, None])
    return mn1, l, acc


@triton.jit
def rlk_attn_rowsum3(x, NB: tl.constexpr, BLOCK_M: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """``rlk_attn_rowsum`` of each of ``NB`` stacked blocks (``x``: ``[NB, BLOCK_M, N]`` ->
    ``[NB, BLOCK_M]``): the same strided halving, pair for pair, so each block's row sums have the
    bits ``rlk_attn_rowsum`` gives that block alone."""
    for i in tl.static_range(LOG2N):
        x = tl.reshape(x, [NB, BLOCK_M, 2, N >> (i + 1)])
        a, b = tl.split(tl.permute(x, (0, 1, 3, 2)))
        x = a + b
    return tl.reshape(x, [NB, BLOCK_M])


@triton.jit
def rlk_attn_quarters(x):
    """The four ``[..., 4]`` → ``[...]`` slices of ``x`` along its last axis, in index order."""
    e, o = tl.split(tl.reshape(x, x.shape[:-1] + [2, 2]))  # e: indices 0, 2; o: 1, 3
    x0, x2 = tl.split(e)
    x1, x3 = tl.split(o)
    return x0, x1, x2, x3


@triton.jit
def rlk_attn_vblock(v_ptr, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, b, sv_row, sv_head, offs_v,
                    PAGED: tl.constexpr):
    """Value rows of block ``b`` (``[64, DV]``, columns ``offs_v``) by pointer loads, positions
    clamped to ``cap`` (``rlk_attn_load``'s value half)."""
    kpos = b * 64 + tl.arange(0, 64)
    rows = rlk_attn_kv_rows(pr_ptr, seq, pr_stride, page_size, kbase, tl.minimum(kpos, cap), PAGED)
    return tl.load(v_ptr + (rows * sv_row + kvh * sv_head)[:, None] + offs_v[None, :])


@triton.jit
def rlk_attn_quad(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, b, m, l, acc,
                  qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  PAGED: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, v0):
    """Blocks ``b .. b + 3``, every one seen entirely by every row (the unmasked run), as four
    ``rlk_attn_block`` steps in order (``AttnConfig.unroll = 4``, 16-row tiles; shapes: ``q``
    ``[BLOCK_M, D]``, ``m``, ``l`` ``[BLOCK_M]``, ``acc`` ``[BLOCK_M, DV]``).

    What depends on the state is only the running maximum, ``l`` and the ``P·V`` accumulator; the
    four blocks' scores do not. So the four score products are one batched ``tl.dot``
    (``[4, BLOCK_M, D] · [4, D, 64]``: the compiler gives each warp one block, the same
    ``mma.sync`` instructions over the head dim in the same order as the single block's product,
    hence the same scores), and the row maxima, exponentials and row sums of the four blocks are
    computed inside each warp, with no reduction across warps. The states between blocks follow
    exactly:

    * ``mn_j = max(mn_{j−1}, x_j)`` with ``x_j = max_k s_jk · c + 0``, taken in block order from
      each thread's four ``x_j`` (``rlk_attn_quarters``) and selected back into ``[4, BLOCK_M]``
      (a maximum is exact; in order, the step needs 21 CTA barriers a trip instead of the
      prefix scan's 33, offline sm_90);
    * ``α_j = 2^{mn_{j−1} − mn_j}`` (``mn_{−1} = m``, the state before block 0),
      ``P_j = 2^{fma(s_j, c, −mn_j)}``, row sums by
      ``rlk_attn_rowsum3`` (the same pairs as ``rlk_attn_rowsum``);
    * ``l ← fma(l, α_j, Σ P_j)`` and ``acc ← P_j·V_j + acc·α_j`` for ``j = 0 .. 3`` in order: the
      same operations, operands and order as four ``rlk_attn_step`` calls, so the same bits.

    ``TMA`` (a contiguous cache): the four key blocks by one TMA copy (``k_desc``'s box is
    ``[256, D]``, ``launch.attend``'s descriptor for ``unroll = 4``), the value blocks by one copy each;
    else pointer loads (``[4, D, 64]`` keys, positions clamped to ``cap``: a no-op here)."""
    jj = tl.arange(0, 4)
    if TMA:
        top = (kbase + b * 64).to(tl.int32)
        col = (kvh * HEAD_D).to(tl.int32)
        kt = tl.permute(tl.reshape(k_desc.load([top, col]), [4, 64, HEAD_D]), (0, 2, 1))  # [4, D, 64]
        col = col + v0
        va = v_desc.load([top, col])
        vb = v_desc.load([top + 64, col])
        vc = v_desc.load([top + 128, col])
        vd = v_desc.load([top + 192, col])
    else:
        offs_d = tl.arange(0, HEAD_D)
        kpos = b * 64 + jj[:, None] * 64 + tl.arange(0, 64)[None, :]  # [4, 64]
        krows = rlk_attn_kv_rows(pr_ptr, seq, pr_stride, page_size, kbase, tl.minimum(kpos, cap), PAGED)
        kt = tl.load(k_ptr + (krows * sk_row + kvh * sk_head)[:, None, :] + offs_d[None, :, None])  # [4, D, 64]
        va = rlk_attn_vblock(v_ptr, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, b, sv_row, sv_head, offs_v,
                             PAGED)
        vb = rlk_attn_vblock(v_ptr, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, b + 1, sv_row, sv_head,
                             offs_v, PAGED)
        vc = rlk_attn_vblock(v_ptr, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, b + 2, sv_row, sv_head,
                             offs_v, PAGED)
        vd = rlk_attn_vblock(v_ptr, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, b + 3, sv_row, sv_head,
                             offs_v, PAGED)
    s = rlk_attn_scores(tl.broadcast_to(q[None, :, :], [4, BLOCK_M, HEAD_D]), kt, IEEE)  # [4, BLOCK_M, 64] fp32
    x = tl.max(s, axis=2) * qk_scale + 0.0  # [4, BLOCK_M]
    x0, x1, x2, x3 = rlk_attn_quarters(tl.permute(x, (1, 0)))
    mn0 = tl.maximum(m, x0)
    mn1 = tl.maximum(mn0, x1)
    mn2 = tl.maximum(mn1, x2)
    mn3 = tl.maximum(mn2, x3)
    sel = jj[:, None]  # block j's row takes mn_j
    mn = tl.where(sel == 0, mn0[None, :],
                  tl.where(sel == 1, mn1[None, :], tl.where(sel == 2, mn2[None, :], mn3[None, :])))
    p = rlk_attn_exp2(tl.fma(s, qk_scale, -mn[:, :, None]))
    r = rlk_attn_rowsum3(p, 4, BLOCK_M, 64, 6)
    r0, r1, r2, r3 = rlk_attn_quarters(tl.permute(r, (1, 0)))
    a0 = rlk_attn_exp2(m - mn0)  # the state before block j has the maximum mn_{j-1} (m before block 0)
    a1 = rlk_attn_exp2(mn0 - mn1)
    a2 = rlk_attn_exp2(mn1 - mn2)
    a3 = rlk_attn_exp2(mn2 - mn3)
    l = tl.fma(tl.fma(tl.fma(tl.fma(l, a0, r0), a1, r1), a2, r2), a3, r3)
    if IEEE:
        p0, p1, p2, p3 = rlk_attn_quarters(tl.permute(p, (1, 2, 0)))
        acc = tl.dot(p0, va, acc * a0[:, None], input_precision="ieee")
        acc = tl.dot(p1, vb, acc * a1[:, None], input_precision="ieee")
        acc = tl.dot(p2, vc, acc * a2[:, None], input_precision="ieee")
        acc = tl.dot(p3, vd, acc * a3[:, None], input_precision="ieee")
    else:
        p0, p1, p2, p3 = rlk_attn_quarters(tl.permute(p.to(va.dtype), (1, 2, 0)))
        acc = tl.dot(p0, va, acc * a0[:, None])
        acc = tl.dot(p1, vb, acc * a1[:, None])
        acc = tl.dot(p2, vc, acc * a2[:, None])
        acc = tl.dot(p3, vd, acc * a3[:, None])
    return mn3, l, acc


@triton.jit
def rlk_attn_unmasked(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, pos, wlo, u0,
                      u1, m, l, acc, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, PAGED: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
                      U: tl.constexpr, v0):
    """The unmasked run's blocks ``u0 .. u1`` (every row sees them entirely), ``U`` per step
    (``AttnConfig.unroll``: ``rlk_attn_block``, ``rlk_attn_pair`` or ``rlk_attn_quad``). Returns the
    state and the last block walked: with ``U > 1`` the blocks left over (fewer than ``U``) are
    the masked run's, ``last + 1 ..`` (a mask that hides nothing gives the same bits).

    Over a paged cache (pointer loads) the one-block and pair walks load the next step's
    page-table entries before the current step's products (``rlk_attn_pages``): the software
    pipeline issues the next block's copies at the end of an iteration, and their rows no longer
    wait on a page-table load issued there. H200: batch 64 × 4096 keys over
    16-token pages 270.9 → 260.4 µs. The same rows, so the same bits."""
    if U == 2 and PAGED and not TMA:
        # as the one-block walk below: the page-table entries of the next pair are loaded before
        # this pair's products (the same rows, so the same bits)
        pairs = tl.maximum(u1 - u0 + 1, 0) // 2
        p0 = rlk_attn_pages(pr_ptr, seq, pr_stride, page_size, cap, u0)
        p1 = rlk_attn_pages(pr_ptr, seq, pr_stride, page_size, cap, u0 + 1)
        for i in range(0, pairs):
            b = u0 + 2 * i
            n0 = rlk_attn_pages(pr_ptr, seq, pr_stride, page_size, cap, tl.minimum(b + 2, u1))
            n1 = rlk_attn_pages(pr_ptr, seq, pr_stride, page_size, cap, tl.minimum(b + 3, u1))
            kt0, va = rlk_attn_load_paged(k_ptr, v_ptr, p0, page_size, cap, kvh, b, sk_row, sk_head, sv_row, sv_head,
                                          offs_v, HEAD_D)
            kt1, vb = rlk_attn_load_paged(k_ptr, v_ptr, p1, page_size, cap, kvh, b + 1, sk_row, sk_head, sv_row,
                                          sv_head, offs_v, HEAD_D)
            m, l, acc = rlk_attn_pair_step(q, kt0, va, kt1, vb, m, l, acc, qk_scale, BLOCK_M, IEEE)
            p0 = n0
            p1 = n1
        last = u0 + 2 * pairs - 1
    elif U == 2:
        pairs = tl.maximum(u1 - u0 + 1, 0) // 2
        for i in range(0, pairs):
            m, l, acc = rlk_attn_pair(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh,
                                      pos, wlo, u0 + 2 * i, m, l, acc, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v,
                                      HEAD_D, BLOCK_M, PAGED, IEEE, TMA, v0)
        last = u0 + 2 * pairs - 1
    elif U == 4:
        quads = tl.maximum(u1 - u0 + 1, 0) // 4
        for i in range(0, quads):
            m, l, acc = rlk_attn_quad(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh,
                                      u0 + 4 * i, m, l, acc, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D,
                                      BLOCK_M, PAGED, IEEE, TMA, v0)
        last = u0 + 4 * quads - 1
    elif PAGED and not TMA:
        # the page-table entries of the next block are loaded before this block's products, so
        # the next block's key / value copies (issued after them) need not wait for a dependent
        # page-table load; the same rows, so the same bits
        pages = rlk_attn_pages(pr_ptr, seq, pr_stride, page_size, cap, u0)
        for b in range(u0, u1 + 1):
            nxt = rlk_attn_pages(pr_ptr, seq, pr_stride, page_size, cap, tl.minimum(b + 1, u1))
            kt, v = rlk_attn_load_paged(k_ptr, v_ptr, pages, page_size, cap, kvh, b, sk_row, sk_head, sv_row, sv_head,
                                        offs_v, HEAD_D)
            m, l, acc = rlk_attn_step(rlk_attn_scores(q, kt, IEEE), v, b, m, l, acc, pos, wlo, qk_scale, BLOCK_M, IEEE,
                                      False)
            pages = nxt
        last = u1
    else:
        for b in range(u0, u1 + 1):
            m, l, acc = rlk_attn_block(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh,
                                       pos, wlo, b, m, l, acc, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D,
                                       BLOCK_M, PAGED, IEEE, False, TMA, v0)
        last = u1
    return m, l, acc, last


@triton.jit
def rlk_attn_split(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, pos, wlo,
                   valid, b0, b1, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D: tl.constexpr,
                   DV: tl.constexpr, BLOCK_M: tl.constexpr, PAGED: tl.constexpr, IEEE: tl.constexpr,
                   SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, TMA: tl.constexpr, U: tl.constexpr,
                   TMA_EDGE: tl.constexpr, v0):
    """One KV split's online softmax over blocks ``b0 .. b1`` (increasing) from the state
    ``(-inf, 0, 0)``; a row's state changes only in the blocks of its own range ``[lo, hi]``
    (``rlk_attn_block``: no per-row select). ``TMA``: the unmasked run's blocks by TMA copies;
    ``TMA_EDGE``: the masked blocks too; ``v0``: the first value column of ``offs_v``.

    The blocks are walked in three runs, in order: masked blocks before ``f0``, the blocks
    ``f0 .. f1`` that every valid row sees entirely (no masks), masked blocks after ``f1``.
    ``f0 = ceil(max wlo / 64)``, ``f1 = floor((min pos + 1) / 64) - 1`` over the valid rows.
    (Padding rows, never stored, may take finite values in the unmasked run.)

    ``U = 2`` or ``4`` (``AttnConfig.unroll``) walks the unmasked run that many blocks per step
    (``rlk_attn_unmasked``: ``rlk_attn_pair``, ``rlk_attn_quad``); the blocks left over (fewer
    than ``U``) join the masked run after it (a mask that hides nothing gives the same bits). The
    blocks are the same, in the same order, so the same bits."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    if SPLIT and not HAS_WINDOW:
        # no window: every row sees the blocks from 0, so the blocks every row sees entirely are
        # a prefix ``b0 .. min(b1, f1)``; two runs (unmasked, then masked), in increasing order
        f1 = (tl.min(tl.where(valid, pos, 1 << 30), axis=0) + 1) // 64 - 1
        u1 = tl.minimum(b1, f1)
        m, l, acc, u1 = rlk_attn_unmasked(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap,
                                          kvh, pos, wlo, b0, u1, m, l, acc, qk_scale, sk_row, sk_head, sv_row, sv_head,
                                          offs_v, HEAD_D, BLOCK_M, PAGED, IEEE, TMA, U, v0)
        for b in range(tl.maximum(u1 + 1, b0), b1 + 1):
            m, l, acc = rlk_attn_block(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, pos, wlo,
                                       b, m, l, acc, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D,
                                       BLOCK_M, PAGED, IEEE, True, TMA_EDGE, v0)
    elif SPLIT:
        f0 = (tl.max(tl.where(valid, wlo, 0), axis=0) + 63) // 64
        f1 = (tl.min(tl.where(valid, pos, 1 << 30), axis=0) + 1) // 64 - 1
        u0 = tl.maximum(b0, f0)
        u1 = tl.minimum(b1, f1)
        u1 = tl.where(u1 >= u0, u1, b0 - 1)  # no unmasked run: everything in the first masked run
        u0 = tl.where(u1 >= u0, u0, b1 + 1)
        e1 = tl.minimum(u0 - 1, b1)
        for b in range(b0, e1 + 1):
            m, l, acc = rlk_attn_block(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, pos, wlo,
                                       b, m, l, acc, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D,
                                       BLOCK_M, PAGED, IEEE, True, TMA_EDGE, v0)
        m, l, acc, last = rlk_attn_unmasked(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size,
                                            cap, kvh, pos, wlo, u0, u1, m, l, acc, qk_scale, sk_row, sk_head, sv_row,
                                            sv_head, offs_v, HEAD_D, BLOCK_M, PAGED, IEEE, TMA, U, v0)
        u1 = tl.where(u1 >= u0, last, u1)
        for b in range(tl.maximum(u1 + 1, e1 + 1), b1 + 1):
            m, l, acc = rlk_attn_block(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, pos, wlo,
                                       b, m, l, acc, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D,
                                       BLOCK_M, PAGED, IEEE, True, TMA_EDGE, v0)
    else:  # one masked run (fp32 by default: IEEE products by FMA, a third of the code to compile)
        for b in range(b0, b1 + 1):
            m, l, acc = rlk_attn_block(q, k_ptr, v_ptr, k_desc, v_desc, pr_ptr, seq, kbase, pr_stride, page_size, cap, kvh, pos, wlo,
                                       b, m, l, acc, qk_scale, sk_row, sk_head, sv_row, sv_head, offs_v, HEAD_D,
                                       BLOCK_M, PAGED, IEEE, True, TMA_EDGE, v0)
    return m, l, acc


@triton.jit
def rlk_attn_merge(M, L, A, m, l, a):
    """``merge((M, L, A), (m, l, a))``. A split a row does not reach has ``(m, l, a) = (-inf, 0, +0)``
    and merging it is an exact identity (``2^{M-M'} = 1``, ``2^{m-M'} = 0``, exact zeros added to
    values that are never ``-0``); while ``M`` is still ``-inf`` the state stays ``(-inf, 0, +0)``
    (the shift is taken as 0 to avoid ``-inf - -inf``). No select on the accumulator."""
    Mn = tl.maximum(M, m)
    Ms = tl.where(Mn == float("-inf"), 0.0, Mn)
    ea = rlk_attn_exp2(M - Ms)
    ec = rlk_attn_exp2(m - Ms)
    Ln = tl.fma(l, ec, L * ea)
    An = tl.fma(a, ec[:, None], A * ea[:, None])
    return Mn, Ln, An


@triton.jit
def rlk_attn_finish(M, L, A, out_ptr, out32_ptr, lse_ptr, q_off, lse_off, valid, lse_valid, offs_d,
                    STORE_F32: tl.constexpr, STORE_LSE: tl.constexpr):
    """``out = ACC · (1 / L)`` rounded once to the output dtype (and the fp32 copy / lse if asked).

    The reciprocal is one IEEE division per row (``div_rn``), then one fp32 product per element:
    every forward kernel finishes here, so the train path, prefill and decode keep the same bits.
    (A ``div_rn`` per element is ~1/3 of a kernel's extra instructions against the
    ablation probe: the IEEE division expands to a reciprocal, its refinement and a slow-path
    branch, 64 times per thread at 128 × 128.)

    ``offs_d`` may be a slice of the head dim (``rlk_attn_combine``'s column chunks): each element
    is its own product, so a slice gives the columns' bits; ``lse_valid`` lets one chunk store
    the row's lse."""
    r = tl.div_rn(tl.full(L.shape, 1.0, tl.float32), L)
    o = A * r[:, None]
    mask = valid[:, None]
    tl.store(out_ptr + q_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_F32:
        tl.store(out32_ptr + q_off[:, None] + offs_d[None, :], o, mask=mask)
    if STORE_LSE:
        tl.store(lse_ptr + lse_off, (M + tl.log2(L)) * 0.6931471805599453, mask=lse_valid)
