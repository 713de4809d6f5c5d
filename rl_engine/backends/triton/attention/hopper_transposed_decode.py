"""The transposed Hopper decode split kernel (Gluon): ``rlk_attn_split_wgt`` runs the KV splits of a
decode step with the products transposed, scores ``k·qᵀ`` with the tile's query rows as the
``wgmma``'s ``N`` (8 or 16) and ``accᵀ = Vᵀ·Pᵀ + accᵀ·α``, over a contiguous cache (64-row block
copies) or 16- / 32-key pages (one TMA copy a page), one or four blocks a step (four: a one-warp
loader partition issues the copies); with its launcher ``launch_split_t``.

It is ``portable_forward.rlk_attn_fwd_split``'s computation (``device.rlk_attn_split``'s order:
the unmasked run, then the masked blocks, from ``(-inf, 0, +0)``; a step of one KV split finishes
its rows as ``device.rlk_attn_finish``): only the layout of the products and the order in which
independent work is issued change, so the same bits (GPU tests,
``tests/backends/triton/attention/test_attention_hopper_transposed_decode.py``).
``eligibility.wgt_decode_eligible`` and ``configs.wgt_decode_programs`` say where it runs.

Import this module only to launch (``launch.attend``): it imports ``triton.experimental.gluon``
(Triton 3.6's Hopper API), which ``import rl_engine`` never does.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from rl_engine.backends.triton.attention.hopper_common import (BLOCK_N, page_descriptors, rlk_attn_wg_exp2,
                                                               rlk_attn_wg_state0, rlk_attn_wg_q_tile,
                                                               rlk_attn_wg_ring, rlk_attn_wg_ring_end,
                                                               rlk_attn_wg_gdc_wait, rlk_attn_wgd_gdc_launch,
                                                               rlk_attn_wgd_entries, rlk_attn_wgd_copy,
                                                               rlk_attn_wgd_gather, rlk_attn_wgd_program,
                                                               rlk_attn_wgd_blocks, rlk_attn_wgd_store)
from rl_engine.backends.triton.attention.configs import wgt_tile_rows
from rl_engine.backends.triton.attention.tuning import current_tuning

__all__ = ["DEVICE_FUNCTIONS", "KERNEL_NAMES", "exchange_layouts", "launch_split_t", "rlk_attn_split_wgt"]

KERNEL_NAMES = ("rlk_attn_split_wgt",)
#: ``@gluon.jit`` device functions in this module's namespace (its own and the shared ones from
#: ``hopper_common``), inlined into the kernel.
DEVICE_FUNCTIONS = ("rlk_attn_wgt_softmax", "rlk_attn_wgt_stage", "rlk_attn_wgt_pv", "rlk_attn_wgt_entries",
                    "rlk_attn_wgt_walk", "rlk_attn_wgt_block", "rlk_attn_wgt_copy4", "rlk_attn_wgt_entries4",
                    "rlk_attn_wgt_scores4", "rlk_attn_wgt_max4", "rlk_attn_wgt_fold", "rlk_attn_wgt_pv_fold",
                    "rlk_attn_wgt_quad", "rlk_attn_wgt_quads", "rlk_attn_wgt_quads_ws", "rlk_attn_wgt_loader",
                    "rlk_attn_wgt_masked", "rlk_attn_wg_exp2", "rlk_attn_wg_state0", "rlk_attn_wg_q_tile",
                    "rlk_attn_wg_ring", "rlk_attn_wg_ring_end", "rlk_attn_wg_gdc_wait", "rlk_attn_wgd_gdc_launch",
                    "rlk_attn_wgd_entries", "rlk_attn_wgd_copy", "rlk_attn_wgd_gather", "rlk_attn_wgd_program",
                    "rlk_attn_wgd_blocks", "rlk_attn_wgd_store")


@functools.lru_cache(maxsize=None)
def exchange_layouts(nq: int):
    """The layouts in which ``rlk_attn_split_wgt`` reads back what its four warps exchange through
    shared memory: per-warp partials ``[4, NQ]`` (``x``) and transposed probabilities
    ``[4, 16, NQ]`` (``f``: warp, key in the warp's 16, query row), the warp axis in registers and
    the other axes spread over the lanes as in the ``wgmma`` accumulator (thread ``t`` holds rows
    ``t // 4`` and ``t // 4 + 8``, columns ``2·(t % 4) + {0, 1} + 8·i``), replicated over the
    warps. So each thread gets every warp's value at its own position, and what it reduces lands
    in the accumulator's column layout without another exchange.

    Cached per ``nq``: building the two layouts costs more host time than the launch itself (the
    layouts' ``__post_init__`` unwraps every basis), and the cached objects are the same
    constexpr values, so the specialization key and the compiled kernel do not change."""
    col_regs = [[1]] + ([[8]] if nq == 16 else [])
    x = gl.DistributedLinearLayout(reg_bases=[[0, c[0]] for c in col_regs] + [[1, 0], [2, 0]],
                                   lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]], warp_bases=[[0, 0], [0, 0]],
                                   block_bases=[], shape=[4, nq])
    f = gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 8, 0]] + ([[0, 0, 8]] if nq == 16 else [])
                                   + [[1, 0, 0], [2, 0, 0]],
                                   lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                   warp_bases=[[0, 0, 0], [0, 0, 0]], block_bases=[], shape=[4, 16, nq])
    return x, f


@gluon.jit
def rlk_attn_wgt_softmax(s, m, b, pos, kpos0, qk_scale, x_smem, MASKED: gl.constexpr, NQ: gl.constexpr,
                         col_s: gl.constexpr, x_layout: gl.constexpr):
    """Block ``b``'s running maximum and probabilities from its transposed scores ``s = k·qᵀ``
    (``[64, NQ]``: keys × query rows; ``rlk_attn_wg_softmax`` without the row sum): returns
    ``(m', P, α)``, ``P`` transposed. ``MASKED``: some valid row does not see the whole block (keys
    past its position masked, the ``-inf`` guard). The maximum over a block's keys (exact in any
    order) is each warp's over its 16 keys, then the four exchanged through ``x_smem``."""
    if MASKED:
        kpos = b * 64 + kpos0
        vis = gl.expand_dims(kpos, 1) <= gl.expand_dims(pos, 0)
        s = gl.where(vis, s, float("-inf"))
    x_smem.store(gl.max(gl.reshape(s, [4, 16, NQ]), axis=1))
    gl.thread_barrier()
    mn = gl.maximum(m, gl.convert_layout(gl.max(x_smem.load(x_layout), axis=0), col_s) * qk_scale + 0.0)
    if MASKED:
        shift = gl.where(mn == float("-inf"), 0.0, mn)
    else:
        shift = mn
    alpha = rlk_attn_wg_exp2(m - shift)
    p = rlk_attn_wg_exp2(gl.fma(s, qk_scale, -gl.expand_dims(shift, 0)))
    return mn, p, alpha


@gluon.jit
def rlk_attn_wgt_stage(p, l, alpha, p_buf, f_smem, NQ: gl.constexpr, col_s: gl.constexpr, f_layout: gl.constexpr):
    """Stage transposed ``P`` (``[64, NQ]``) and return ``l' = fma(l, α, Σ P)``: ``P`` rounded to the
    value dtype into ``p_buf`` (``[NQ, 64]``, the ``P·V`` product's ``B`` operand, visible to the
    tensor cores once every warp has written) and in fp32 into ``f_smem``; each thread reads back
    every warp's probabilities at its own position and folds them by ``device.rlk_attn_rowsum``'s
    pairs: keys ``j`` and ``j + 32`` (warps ``w``, ``w + 2``), ``j`` and ``j + 16`` (warps ``w``,
    ``w + 1``), then ``j + 8`` (the thread's other row), ``j + 4``, ``j + 2``, ``j + 1`` (lanes).
    Every step is one IEEE add per element, so the row sums of the untransposed tile."""
    p_buf.store(gl.permute(p.to(p_buf.dtype), (1, 0)))
    f_smem.store(gl.reshape(p, [4, 16, NQ]))
    fence_async_shared()
    gl.thread_barrier()
    x = gl.sum(gl.reshape(f_smem.load(f_layout), [2, 2, 16, NQ]), axis=0)
    x = gl.sum(x, axis=0)
    for i in gl.static_range(4):
        x = gl.sum(gl.reshape(x, [2, 16 >> (i + 1), NQ]), axis=0)
    return gl.fma(l, alpha, gl.convert_layout(gl.reshape(x, [NQ]), col_s))


@gluon.jit
def rlk_attn_wgt_pv(p_buf, alpha, acc, v_smem, v_bars, j, ST: gl.constexpr, col_o: gl.constexpr):
    """Issue block ``j``'s transposed ``P·V`` (asynchronous; returns its token): ``accᵀ·α`` (the
    product's accumulator input, ``α`` per query row = per column), then ``Vᵀ·Pᵀ`` once the value
    block has arrived (``Vᵀ``: the value slot read transposed, ``Pᵀ``: ``p_buf``)."""
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, col_o), 0)
    mbarrier.wait(v_bars.index(j % ST), phase=(j // ST) & 1)
    return warpgroup_mma(v_smem.index(j % ST).permute((1, 0)), p_buf.permute((1, 0)), acc, is_async=True)


@gluon.jit
def rlk_attn_wgt_entries(pr_row, kbase, b, PPB: gl.constexpr, PAGED: gl.constexpr):
    """Block ``b``'s copy rows: its pages' page-table entries (``rlk_attn_wgd_entries``) or, over a
    contiguous cache, the block's first storage row ``kbase + 64·b`` (one 64-row copy)."""
    if PAGED:
        e = rlk_attn_wgd_entries(pr_row, b, PPB)
    else:
        e0 = (kbase + b * 64).to(gl.int32)
        e = (e0, e0 * 0, e0 * 0, e0 * 0)
    return e


@gluon.jit
def rlk_attn_wgt_walk(q_smem, k_smem, v_smem, p_bufs, x_smem, f_smem, k_bars, v_bars, k_desc, v_desc, pr_row, kbase,
                      col, vcol, b0, nu, pos, kpos0, qk_scale, BN: gl.constexpr, NQ: gl.constexpr, DV: gl.constexpr,
                      ST: gl.constexpr, PS: gl.constexpr, PPB: gl.constexpr, PAGED: gl.constexpr,
                      s_layout: gl.constexpr, o_layout: gl.constexpr, col_s: gl.constexpr, col_o: gl.constexpr,
                      x_layout: gl.constexpr, f_layout: gl.constexpr):
    """``rlk_attn_wgd_walk`` with transposed products: the unmasked run ``b0 .. b0 + nu - 1``
    (``nu >= 1``, its first ``ST`` blocks' copies issued) from ``(-inf, 0, +0)``. Block ``j + 1``'s
    scores ``k·qᵀ`` are issued before block ``j``'s ``P·V``; block ``j + 1``'s softmax runs while
    that product runs; ``P`` alternates between two shared-memory buffers."""
    last = nu - 1
    ek = rlk_attn_wgt_entries(pr_row, kbase, b0 + gl.minimum(ST, last), PPB, PAGED)
    en = rlk_attn_wgt_entries(pr_row, kbase, b0 + gl.minimum(ST + 1, last), PPB, PAGED)
    zero_s = gl.zeros([BN, NQ], gl.float32, s_layout)
    qt = q_smem.permute((1, 0))
    mbarrier.wait(k_bars.index(0), phase=0)
    s_tok = warpgroup_mma(k_smem.index(0), qt, zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    rlk_attn_wgd_copy(k_desc, k_smem, k_bars, ek, col, ST, nu, ST, PS, PPB)
    m, p, alpha = rlk_attn_wgt_softmax(s, gl.full([NQ], float("-inf"), gl.float32, col_s), b0, pos, kpos0, qk_scale,
                                       x_smem, False, NQ, col_s, x_layout)
    l = rlk_attn_wgt_stage(p, gl.zeros([NQ], gl.float32, col_s), alpha, p_bufs.index(0), f_smem, NQ, col_s, f_layout)
    acc = gl.zeros([DV, NQ], gl.float32, o_layout)
    for j in range(0, last):
        jn = j + 1
        ef = rlk_attn_wgt_entries(pr_row, kbase, b0 + gl.minimum(jn + ST + 1, last), PPB, PAGED)
        mbarrier.wait(k_bars.index(jn % ST), phase=(jn // ST) & 1)
        s_tok = warpgroup_mma(k_smem.index(jn % ST), qt, zero_s, use_acc=False, is_async=True)
        acc_tok = rlk_attn_wgt_pv(p_bufs.index(j % 2), alpha, acc, v_smem, v_bars, j, ST, col_o)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        # block jn's key slot is free: it takes block jn + ST
        rlk_attn_wgd_copy(k_desc, k_smem, k_bars, en, col, jn + ST, nu, ST, PS, PPB)
        m, p, alpha = rlk_attn_wgt_softmax(s, m, b0 + jn, pos, kpos0, qk_scale, x_smem, False, NQ, col_s, x_layout)
        l = rlk_attn_wgt_stage(p, l, alpha, p_bufs.index(jn % 2), f_smem, NQ, col_s, f_layout)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        # block j's value slot is free: it takes block j + ST
        rlk_attn_wgd_copy(v_desc, v_smem, v_bars, ek, vcol, j + ST, nu, ST, PS, PPB)
        ek = en
        en = ef
    acc = warpgroup_mma_wait(0, deps=(rlk_attn_wgt_pv(p_bufs.index(last % 2), alpha, acc, v_smem, v_bars, last, ST,
                                                      col_o), ))
    return m, l, acc


@gluon.jit
def rlk_attn_wgt_block(smem, slot, b: gl.constexpr, BIG: gl.constexpr):
    """Block ``b`` of four-block ring slot ``slot``: a 64-row slice of the slot's 256-row tile
    (``BIG``: a contiguous cache, the four blocks one copy) or its own 64-row slot."""
    if BIG:
        buf = smem.index(slot).slice(64 * b, 64)
    else:
        buf = smem.index(slot * 4 + b)
    return buf


@gluon.jit
def rlk_attn_wgt_copy4(desc, smem, bars, es, col, qi, nqd, QST: gl.constexpr, PS: gl.constexpr, PPB: gl.constexpr,
                       BIG: gl.constexpr):
    """Issue the TMA copies of four-block step ``qi``'s blocks (entries ``es``: four
    ``rlk_attn_wgt_entries`` tuples) into ring slot ``qi % QST``, one barrier for the four blocks;
    if ``qi < nqd``. ``BIG`` (a contiguous cache): the four blocks are consecutive rows, so one
    256-row copy (box ``[256, cols]``) into the slot's 256-row tile, 8 copy instructions in the
    kernel instead of 32 and 15 CTA barriers a step instead of 21 (offline sm_90a), and a
    batch-1 × 4096 step 10.3–10.7 µs instead of 12.0–12.1 (H200). A block is a
    64-row slice of the tile (``rlk_attn_wgt_block``), a whole number of swizzle periods, so its
    ``wgmma`` reads the same elements: the same bits (GPU tests). Else (pages) every block's
    ``PPB`` page copies into its own 64-row slot."""
    pred = qi < nqd
    slot = qi % QST
    bar = bars.index(slot)
    if BIG:  # the four contiguous blocks: one 256-row copy
        mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc, [es[0][0], col], bar, smem.index(slot), pred=pred)
    else:
        mbarrier.expect(bar, desc.block_type.nbytes * (4 * PPB), pred=pred)
        for b in gl.static_range(4):
            buf = smem.index(slot * 4 + b)
            for i in gl.static_range(PPB):
                tma.async_copy_global_to_shared(desc, [es[b][i], col], bar, buf.slice(i * PS, PS), pred=pred)


@gluon.jit
def rlk_attn_wgt_entries4(pr_row, kbase, b, PPB: gl.constexpr, PAGED: gl.constexpr):
    """The copy rows of blocks ``b .. b + 3`` (``rlk_attn_wgt_entries``)."""
    return (rlk_attn_wgt_entries(pr_row, kbase, b, PPB, PAGED),
            rlk_attn_wgt_entries(pr_row, kbase, b + 1, PPB, PAGED),
            rlk_attn_wgt_entries(pr_row, kbase, b + 2, PPB, PAGED),
            rlk_attn_wgt_entries(pr_row, kbase, b + 3, PPB, PAGED))


@gluon.jit
def rlk_attn_wgt_scores4(k_smem, k_bars, qt, qi, QST: gl.constexpr, zero_s, BIG: gl.constexpr):
    """Issue four-block step ``qi``'s four score products ``k·qᵀ`` (asynchronous) once its key
    blocks have arrived; returns their tokens."""
    slot = qi % QST
    mbarrier.wait(k_bars.index(slot), phase=(qi // QST) & 1)
    t0 = warpgroup_mma(rlk_attn_wgt_block(k_smem, slot, 0, BIG), qt, zero_s, use_acc=False, is_async=True)
    t1 = warpgroup_mma(rlk_attn_wgt_block(k_smem, slot, 1, BIG), qt, zero_s, use_acc=False, is_async=True)
    t2 = warpgroup_mma(rlk_attn_wgt_block(k_smem, slot, 2, BIG), qt, zero_s, use_acc=False, is_async=True)
    t3 = warpgroup_mma(rlk_attn_wgt_block(k_smem, slot, 3, BIG), qt, zero_s, use_acc=False, is_async=True)
    return t0, t1, t2, t3


@gluon.jit
def rlk_attn_wgt_max4(s0, s1, s2, s3, x_smem, NQ: gl.constexpr, col_s: gl.constexpr, x_layout: gl.constexpr):
    """Each block's maximum score per query row (``[NQ]`` each, unscaled): every warp's over its 16
    keys, the four warps' exchanged through ``x_smem`` (one barrier for the four blocks)."""
    x_smem.slice(0, 4).store(gl.max(gl.reshape(s0, [4, 16, NQ]), axis=1))
    x_smem.slice(4, 4).store(gl.max(gl.reshape(s1, [4, 16, NQ]), axis=1))
    x_smem.slice(8, 4).store(gl.max(gl.reshape(s2, [4, 16, NQ]), axis=1))
    x_smem.slice(12, 4).store(gl.max(gl.reshape(s3, [4, 16, NQ]), axis=1))
    gl.thread_barrier()
    x0 = gl.convert_layout(gl.max(x_smem.slice(0, 4).load(x_layout), axis=0), col_s)
    x1 = gl.convert_layout(gl.max(x_smem.slice(4, 4).load(x_layout), axis=0), col_s)
    x2 = gl.convert_layout(gl.max(x_smem.slice(8, 4).load(x_layout), axis=0), col_s)
    x3 = gl.convert_layout(gl.max(x_smem.slice(12, 4).load(x_layout), axis=0), col_s)
    return x0, x1, x2, x3


@gluon.jit
def rlk_attn_wgt_fold(f_buf, NQ: gl.constexpr, col_s: gl.constexpr, f_layout: gl.constexpr):
    """``rlk_attn_wgt_stage``'s row sums of the probabilities staged in ``f_buf`` (``[4, 16, NQ]``)."""
    x = gl.sum(gl.reshape(f_buf.load(f_layout), [2, 2, 16, NQ]), axis=0)
    x = gl.sum(x, axis=0)
    for i in gl.static_range(4):
        x = gl.sum(gl.reshape(x, [2, 16 >> (i + 1), NQ]), axis=0)
    return gl.convert_layout(gl.reshape(x, [NQ]), col_s)


@gluon.jit
def rlk_attn_wgt_pv_fold(acc, l, alpha, v_buf, p_buf, f_buf, NQ: gl.constexpr, col_s: gl.constexpr,
                         col_o: gl.constexpr, f_layout: gl.constexpr):
    """One block of a four-block step's chain: ``accᵀ ← Vᵀ·Pᵀ + accᵀ·α`` (the block's staged ``Pᵀ``
    and value slot), and, while that product runs, ``l ← fma(l, α, Σ P)`` from the staged fp32
    probabilities (``rlk_attn_wgt_fold``)."""
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, col_o), 0)
    acc = warpgroup_mma(v_buf.permute((1, 0)), p_buf.permute((1, 0)), acc, is_async=True)
    l = gl.fma(l, alpha, rlk_attn_wgt_fold(f_buf, NQ, col_s, f_layout))
    return warpgroup_mma_wait(0, deps=(acc, )), l


@gluon.jit
def rlk_attn_wgt_quad(s0, s1, s2, s3, m, l, acc, k_smem, v_smem, p_bufs, x_smem, f_smem, k_bars, v_bars, k_desc, v_desc,
                      qt, ek, en, col, vcol, qi, nqd, qk_scale, zero_s, NQ: gl.constexpr, QST: gl.constexpr,
                      PS: gl.constexpr, PPB: gl.constexpr, col_s: gl.constexpr, col_o: gl.constexpr,
                      x_layout: gl.constexpr, f_layout: gl.constexpr, NEXT: gl.constexpr, BIG: gl.constexpr,
                      LOADER: gl.constexpr, k_free, v_free):
    """Four-block step ``qi`` of the unmasked run (``device.rlk_attn_quad``'s values with the
    transposed products): the blocks' maxima taken in order, ``mn_j = max(mn_{j−1}, x_j·c + 0)``,
    ``α_j = 2^{mn_{j−1} − mn_j}``, ``P_j = 2^{fma(s_j, c, −mn_j)}``, ``l ← fma(l, α_j, Σ P_j)`` and
    ``accᵀ ← Vᵀ_j·Pᵀ_j + accᵀ·α_j`` for ``j = 0 .. 3``: four ``rlk_attn_block`` steps. Its key slot
    takes step ``qi + QST``'s keys (entries ``ek``) once its scores ``s0 .. s3`` are in; ``NEXT``:
    step ``qi + 1``'s score products run during this step's ``P·V`` chain and are returned
    (else the scores returned are this step's, unused). ``LOADER``: the copies are the loader
    partition's (``rlk_attn_wgt_loader``); this step tells it when its key slot (every warp past
    the maxima's barrier, so past its score products) and its value slot (a barrier after the
    ``P·V`` chain) are free (``k_free``, ``v_free``: one arrival each)."""
    if not LOADER:
        rlk_attn_wgt_copy4(k_desc, k_smem, k_bars, ek, col, qi + QST, nqd, QST, PS, PPB, BIG)
    x0, x1, x2, x3 = rlk_attn_wgt_max4(s0, s1, s2, s3, x_smem, NQ, col_s, x_layout)
    if LOADER:
        mbarrier.arrive(k_free.index(qi % QST))
    mn0 = gl.maximum(m, x0 * qk_scale + 0.0)
    mn1 = gl.maximum(mn0, x1 * qk_scale + 0.0)
    mn2 = gl.maximum(mn1, x2 * qk_scale + 0.0)
    mn3 = gl.maximum(mn2, x3 * qk_scale + 0.0)
    a0 = rlk_attn_wg_exp2(m - mn0)
    a1 = rlk_attn_wg_exp2(mn0 - mn1)
    a2 = rlk_attn_wg_exp2(mn1 - mn2)
    a3 = rlk_attn_wg_exp2(mn2 - mn3)
    p0 = rlk_attn_wg_exp2(gl.fma(s0, qk_scale, -gl.expand_dims(mn0, 0)))
    p1 = rlk_attn_wg_exp2(gl.fma(s1, qk_scale, -gl.expand_dims(mn1, 0)))
    p2 = rlk_attn_wg_exp2(gl.fma(s2, qk_scale, -gl.expand_dims(mn2, 0)))
    p3 = rlk_attn_wg_exp2(gl.fma(s3, qk_scale, -gl.expand_dims(mn3, 0)))
    dt: gl.constexpr = p_bufs.dtype
    p_bufs.index(0).store(gl.permute(p0.to(dt), (1, 0)))
    p_bufs.index(1).store(gl.permute(p1.to(dt), (1, 0)))
    p_bufs.index(2).store(gl.permute(p2.to(dt), (1, 0)))
    p_bufs.index(3).store(gl.permute(p3.to(dt), (1, 0)))
    f_smem.slice(0, 4).store(gl.reshape(p0, [4, 16, NQ]))
    f_smem.slice(4, 4).store(gl.reshape(p1, [4, 16, NQ]))
    f_smem.slice(8, 4).store(gl.reshape(p2, [4, 16, NQ]))
    f_smem.slice(12, 4).store(gl.reshape(p3, [4, 16, NQ]))
    fence_async_shared()
    gl.thread_barrier()
    if NEXT:
        t0, t1, t2, t3 = rlk_attn_wgt_scores4(k_smem, k_bars, qt, qi + 1, QST, zero_s, BIG)
    slot = qi % QST
    mbarrier.wait(v_bars.index(slot), phase=(qi // QST) & 1)
    acc, l = rlk_attn_wgt_pv_fold(acc, l, a0, rlk_attn_wgt_block(v_smem, slot, 0, BIG), p_bufs.index(0),
                                  f_smem.slice(0, 4), NQ, col_s, col_o, f_layout)
    acc, l = rlk_attn_wgt_pv_fold(acc, l, a1, rlk_attn_wgt_block(v_smem, slot, 1, BIG), p_bufs.index(1),
                                  f_smem.slice(4, 4), NQ, col_s, col_o, f_layout)
    acc, l = rlk_attn_wgt_pv_fold(acc, l, a2, rlk_attn_wgt_block(v_smem, slot, 2, BIG), p_bufs.index(2),
                                  f_smem.slice(8, 4), NQ, col_s, col_o, f_layout)
    acc, l = rlk_attn_wgt_pv_fold(acc, l, a3, rlk_attn_wgt_block(v_smem, slot, 3, BIG), p_bufs.index(3),
                                  f_smem.slice(12, 4), NQ, col_s, col_o, f_layout)
    # the value slot is free: it takes step qi + QST's values
    if LOADER:
        gl.thread_barrier()
        mbarrier.arrive(v_free.index(slot))
    else:
        rlk_attn_wgt_copy4(v_desc, v_smem, v_bars, ek, vcol, qi + QST, nqd, QST, PS, PPB, BIG)
    if NEXT:
        s0, s1, s2, s3 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3))
    return mn3, l, acc, s0, s1, s2, s3


@gluon.jit
def rlk_attn_wgt_quads(q_smem, k_smem, v_smem, p_bufs, x_smem, f_smem, k_bars, v_bars, k_desc, v_desc, pr_row, kbase,
                       col, vcol, b0, nqd, qk_scale, NQ: gl.constexpr, DV: gl.constexpr, QST: gl.constexpr,
                       PS: gl.constexpr, PPB: gl.constexpr, PAGED: gl.constexpr, s_layout: gl.constexpr,
                       o_layout: gl.constexpr, col_s: gl.constexpr, col_o: gl.constexpr, x_layout: gl.constexpr,
                       f_layout: gl.constexpr, BIG: gl.constexpr, LOADER: gl.constexpr = False, k_free=None,
                       v_free=None):
    """The unmasked run's first ``4·nqd`` blocks from ``b0`` (``nqd >= 1``; the first ``QST`` steps'
    copies issued, or every copy the loader partition's with ``LOADER``) four a step
    (``rlk_attn_wgt_quad``) from ``(-inf, 0, +0)``. A step's page-table entries are loaded a step
    before its copies are issued."""
    zero_s = gl.zeros([64, NQ], gl.float32, s_layout)
    qt = q_smem.permute((1, 0))
    if LOADER:
        ek = (col, col, col, col)
        ek = (ek, ek, ek, ek)
    else:
        ek = rlk_attn_wgt_entries4(pr_row, kbase, b0 + 4 * gl.minimum(QST, nqd - 1), PPB, PAGED)
    t0, t1, t2, t3 = rlk_attn_wgt_scores4(k_smem, k_bars, qt, 0, QST, zero_s, BIG)
    s0, s1, s2, s3 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3))
    m, l, acc = rlk_attn_wg_state0(NQ, DV, NQ, col_s, o_layout)
    for qi in range(0, nqd - 1):
        if LOADER:
            en = ek
        else:
            en = rlk_attn_wgt_entries4(pr_row, kbase, b0 + 4 * gl.minimum(qi + QST + 1, nqd - 1), PPB, PAGED)
        m, l, acc, s0, s1, s2, s3 = rlk_attn_wgt_quad(s0, s1, s2, s3, m, l, acc, k_smem, v_smem, p_bufs, x_smem, f_smem,
                                                      k_bars, v_bars, k_desc, v_desc, qt, ek, en, col, vcol, qi, nqd,
                                                      qk_scale, zero_s, NQ, QST, PS, PPB, col_s, col_o, x_layout,
                                                      f_layout, True, BIG, LOADER, k_free, v_free)
        ek = en
    m, l, acc, s0, s1, s2, s3 = rlk_attn_wgt_quad(s0, s1, s2, s3, m, l, acc, k_smem, v_smem, p_bufs, x_smem, f_smem,
                                                  k_bars, v_bars, k_desc, v_desc, qt, ek, ek, col, vcol, nqd - 1, nqd,
                                                  qk_scale, zero_s, NQ, QST, PS, PPB, col_s, col_o, x_layout, f_layout,
                                                  False, BIG, LOADER, k_free, v_free)
    return m, l, acc


@gluon.jit
def rlk_attn_wgt_quads_ws(q_smem, k_smem, v_smem, p_bufs, x_smem, f_smem, k_bars, v_bars, k_free, v_free, nqd, qk_scale,
                          NQ: gl.constexpr, DV: gl.constexpr, QST: gl.constexpr, PS: gl.constexpr, PPB: gl.constexpr,
                          s_layout: gl.constexpr,
                          o_layout: gl.constexpr, col_s: gl.constexpr, col_o: gl.constexpr, x_layout: gl.constexpr,
                          f_layout: gl.constexpr):
    """The default partition of a paged four-block walk with a loader partition: ``rlk_attn_wgt_quads``
    without copies; returns ``(m, l, acc)``."""
    m, l, acc = rlk_attn_wgt_quads(q_smem, k_smem, v_smem, p_bufs, x_smem, f_smem, k_bars, v_bars, None, None, None,
                                   None, 0, 0, 0, nqd, qk_scale, NQ, DV, QST, PS, PPB, True, s_layout, o_layout, col_s,
                                   col_o, x_layout, f_layout, False, True, k_free, v_free)
    return (m, l, acc)


@gluon.jit
def rlk_attn_wgt_loader(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_free, v_free, pr_row, b0, col, vcol, nqd,
                        QST: gl.constexpr, PS: gl.constexpr, PPB: gl.constexpr):
    """The loader partition (one warp) of a paged four-block walk: step ``qi``'s page-table entries,
    then, once the consumer has freed the ring slot (``k_free`` / ``v_free`` from step ``qi − QST``),
    its ``4·PPB`` key and value page copies, one barrier each (``rlk_attn_wgt_copy4``). The copies,
    their rows and their barriers are the single-partition kernel's; only the warps that issue
    them differ, so the consumer reads the same tiles."""
    for qi in range(0, nqd):
        slot = qi % QST
        es = rlk_attn_wgt_entries4(pr_row, 0, b0 + 4 * qi, PPB, True)
        if qi >= QST:
            mbarrier.wait(k_free.index(slot), phase=((qi // QST) + 1) & 1)
        rlk_attn_wgt_copy4(k_desc, k_smem, k_bars, es, col, qi, nqd, QST, PS, PPB, False)
        if qi >= QST:
            mbarrier.wait(v_free.index(slot), phase=((qi // QST) + 1) & 1)
        rlk_attn_wgt_copy4(v_desc, v_smem, v_bars, es, vcol, qi, nqd, QST, PS, PPB, False)


@gluon.jit
def rlk_attn_wgt_masked(q_smem, k_buf, v_buf, p_buf, x_smem, f_smem, k_ptr, v_ptr, pr_row, kbase, b, cap, kvh, v0,
                        sk_row, sk_head, sv_row, sv_head, m, l, acc, pos, kpos0, qk_scale, BN: gl.constexpr,
                        NQ: gl.constexpr, HEAD_D: gl.constexpr, DV: gl.constexpr, PS: gl.constexpr,
                        PAGED: gl.constexpr, s_layout: gl.constexpr, col_s: gl.constexpr, col_o: gl.constexpr,
                        ld_layout: gl.constexpr, x_layout: gl.constexpr, f_layout: gl.constexpr):
    """``rlk_attn_wgd_masked`` with transposed products (either cache): block ``b``'s rows by
    pointer loads clamped to ``cap`` into idle ring slots, then the masked step."""
    rlk_attn_wgd_gather(k_buf, v_buf, k_ptr, v_ptr, pr_row, kbase, b, cap, kvh, v0, sk_row, sk_head, sv_row, sv_head,
                        BN, HEAD_D, DV, PS, PAGED, ld_layout)
    zero_s = gl.zeros([BN, NQ], gl.float32, s_layout)
    s_tok = warpgroup_mma(k_buf, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    m, p, alpha = rlk_attn_wgt_softmax(s, m, b, pos, kpos0, qk_scale, x_smem, True, NQ, col_s, x_layout)
    l = rlk_attn_wgt_stage(p, l, alpha, p_buf, f_smem, NQ, col_s, f_layout)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, col_o), 0)
    acc = warpgroup_mma_wait(0, deps=(warpgroup_mma(v_buf.permute((1, 0)), p_buf.permute((1, 0)), acc,
                                                    is_async=True), ))
    # the buffers are written again by the next masked block only after every warp's products
    gl.thread_barrier()
    return m, l, acc


@gluon.jit
def rlk_attn_split_wgt(q_ptr, k_desc, v_desc, k_ptr, v_ptr, out_ptr, ws_m_ptr, ws_l_ptr, ws_a_ptr, tab_ptr, pr_ptr,
                       pr_stride, qk_scale, sk_row, sk_head, sv_row, sv_head, NS, HQ, HKV, PS: gl.constexpr,
                       PAGED: gl.constexpr, G: gl.constexpr, HEAD_D: gl.constexpr, DV: gl.constexpr,
                       NQ: gl.constexpr, WS_M: gl.constexpr, ONE: gl.constexpr, ST: gl.constexpr, PDL: gl.constexpr,
                       SB: gl.constexpr, ORDER: gl.constexpr, FINISH: gl.constexpr, X_LAYOUT: gl.constexpr,
                       F_LAYOUT: gl.constexpr, QUAD: gl.constexpr):
    """``rlk_attn_split_wg`` with the products transposed, for decode tiles of at most ``NQ``
    (8 or 16) query rows over a contiguous (``PAGED=False``: each block one 64-row copy) or paged
    cache: the scores are ``k·qᵀ`` (``[64 keys, NQ]``, a ``wgmma`` of ``N = NQ``) and the
    accumulator ``accᵀ = Vᵀ·Pᵀ + accᵀ·α`` (``[DV, NQ]``; ``Pᵀ`` through shared memory), where the
    untransposed kernel fills a 64-row ``wgmma`` tile with the tile's few rows. Each output
    element is the same sum of the same products in the same 16-term steps, the running maxima,
    exponentials and the fixed pairwise row sums are ``rlk_attn_split``'s, so the same bits (GPU
    tests). Grid, workspace, value slices and ``FINISH``: ``rlk_attn_split_wg``'s.

    ``ST`` ring slots of one block each (``rlk_attn_wgt_walk``) or, with ``QUAD``, of four blocks
    (the unmasked run four blocks a step, ``rlk_attn_wgt_quads``; over a contiguous cache a slot is
    one 256-row tile filled by one copy, ``k_desc`` / ``v_desc`` then having 256-row boxes; over
    pages the page copies are issued by a one-warp loader partition, ``rlk_attn_wgt_loader``, under
    ``gl.warp_specialize``, while the four compute warps run ``rlk_attn_wgt_quads_ws``; the
    blocks left over join the masked run, whose step on blocks every row sees entirely gives the same
    bits). ``X_LAYOUT``, ``F_LAYOUT``: the exchange read-back layouts of ``exchange_layouts(NQ)``."""
    rlk_attn_wg_gdc_wait(PDL)
    rlk_attn_wgd_gdc_launch(PDL)
    BN: gl.constexpr = 64
    PPB: gl.constexpr = 64 // PS
    VS: gl.constexpr = HEAD_D // DV
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [NQ // 4, 128 // NQ], [4, 1], [1, 0])
    dtype: gl.constexpr = k_desc.dtype
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, HEAD_D], dtype)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, BN], dtype)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    flat3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])

    t64, kvh, j, vs, seq, u0, u1, pbase, tok0, p_lo, cap, last = rlk_attn_wgd_program(tab_ptr, G, VS, ONE, ORDER)
    pr_row = pr_ptr + seq * pr_stride
    # a contiguous cache's base row is loaded beside the table row (every program's ``seq`` is a
    # batch sequence), not after it: the first copies wait on one load round trip, not two
    if PAGED:
        kbase = seq * 0
    else:
        kbase = gl.load(pr_row).to(gl.int64)
    if (last >= 0) & (j <= last // SB):
        b0, b1, nu = rlk_attn_wgd_blocks(j, last, p_lo, SB)
        col = (kvh * HEAD_D).to(gl.int32)
        v0 = (vs * DV).to(gl.int32)

        # QUAD: ST ring slots of four blocks each; else of one block
        SLOTS: gl.constexpr = 4 * ST if QUAD else ST
        BIG: gl.constexpr = QUAD and not PAGED  # four contiguous blocks: one 256-row copy, one 256-row slot
        # four paged blocks a step: their 4·PPB page copies issued by a loader partition (one warp)
        LOADER: gl.constexpr = QUAD and PAGED
        # the key / value ring: ST slots (SLOTS blocks in all; a four-block slot's copies share a barrier)
        if BIG:
            k_smem, v_smem, k_bars, v_bars = rlk_attn_wg_ring(k_desc, v_desc, ST, ST, 4 * BN, HEAD_D, DV)
        else:
            k_smem, v_smem, k_bars, v_bars = rlk_attn_wg_ring(k_desc, v_desc, ST, ST, BN, HEAD_D, DV, SLOTS // ST)
        p_bufs = gl.allocate_shared_memory(dtype, [4 if QUAD else 2, NQ, BN], p_smem_layout)
        # per-block exchange buffers, block i's at rows 4·i ..: warp maxima [4, NQ], probabilities [4, 16, NQ]
        x_smem = gl.allocate_shared_memory(gl.float32, [16, NQ], flat)
        f_smem = gl.allocate_shared_memory(gl.float32, [16 if QUAD else 4, 16, NQ], flat3)
        if QUAD:
            nqd = nu // 4  # four-block steps; the blocks left over join the masked run
            nw = 4 * nqd
        else:
            nqd = 0
            nw = nu
        if LOADER:  # the consumer's "slot free" signals to the loader, one arrival a phase
            k_free = gl.allocate_shared_memory(gl.int64, [ST, 1], mbarrier.MBarrierLayout())
            v_free = gl.allocate_shared_memory(gl.int64, [ST, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(ST):
                mbarrier.init(k_free.index(i), count=1)
                mbarrier.init(v_free.index(i), count=1)
            fence_async_shared()
        # the first blocks' copies are issued before the tile's Q rows are loaded
        if QUAD:
            if (nqd > 0) and (not LOADER):
                es = ()
                for i in gl.static_range(ST):
                    es = es + (rlk_attn_wgt_entries4(pr_row, kbase, b0 + 4 * gl.minimum(i, nqd - 1), PPB, PAGED), )
                for i in gl.static_range(ST):
                    rlk_attn_wgt_copy4(k_desc, k_smem, k_bars, es[i], col, i, nqd, ST, PS, PPB, BIG)
                    rlk_attn_wgt_copy4(v_desc, v_smem, v_bars, es[i], col + v0, i, nqd, ST, PS, PPB, BIG)
        elif nu > 0:
            es = ()
            for i in gl.static_range(ST):
                es = es + (rlk_attn_wgt_entries(pr_row, kbase, b0 + gl.minimum(i, nu - 1), PPB, PAGED), )
            for i in gl.static_range(ST):
                rlk_attn_wgd_copy(k_desc, k_smem, k_bars, es[i], col, i, nu, ST, PS, PPB)
                rlk_attn_wgd_copy(v_desc, v_smem, v_bars, es[i], col + v0, i, nu, ST, PS, PPB)

        q_smem, offs_d = rlk_attn_wg_q_tile(q_ptr, u0, u1, tok0, kvh, G, HQ, HEAD_D, NQ, io_layout, q_smem_layout)

        r_c = gl.arange(0, NQ, layout=col_s)
        rel_c = (u0 - tok0 * G).to(gl.int32) + r_c
        valid_c = r_c.to(gl.int64) < u1 - u0
        pos = gl.where(valid_c, tok0 + rel_c // G - pbase, 0).to(gl.int32)
        kpos0 = gl.arange(0, BN, layout=row_s)
        if LOADER and nqd > 0:
            m, l, acc = gl.warp_specialize([
                (rlk_attn_wgt_quads_ws, (q_smem, k_smem, v_smem, p_bufs, x_smem, f_smem, k_bars, v_bars, k_free, v_free,
                                         nqd, qk_scale, NQ, DV, ST, PS, PPB, s_layout, o_layout, col_s, col_o, X_LAYOUT,
                                         F_LAYOUT)),
                (rlk_attn_wgt_loader, (k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_free, v_free, pr_row, b0, col,
                                       col + v0, nqd, ST, PS, PPB)),
            ], [1], [48])
        elif QUAD and nqd > 0:
            m, l, acc = rlk_attn_wgt_quads(q_smem, k_smem, v_smem, p_bufs, x_smem, f_smem, k_bars, v_bars, k_desc,
                                           v_desc, pr_row, kbase, col, col + v0, b0, nqd, qk_scale, NQ, DV, ST, PS, PPB,
                                           PAGED, s_layout, o_layout, col_s, col_o, X_LAYOUT, F_LAYOUT, BIG)
        elif not QUAD and nu > 0:
            m, l, acc = rlk_attn_wgt_walk(q_smem, k_smem, v_smem, p_bufs, x_smem.slice(0, 4), f_smem.slice(0, 4),
                                          k_bars, v_bars, k_desc, v_desc, pr_row, kbase, col, col + v0, b0, nu, pos,
                                          kpos0, qk_scale, BN, NQ, DV, ST, PS, PPB, PAGED, s_layout, o_layout, col_s,
                                          col_o, X_LAYOUT, F_LAYOUT)
        else:
            m, l, acc = rlk_attn_wg_state0(NQ, DV, NQ, col_s, o_layout)
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        for b in range(b0 + nw, b1 + 1):
            m, l, acc = rlk_attn_wgt_masked(q_smem, rlk_attn_wgt_block(k_smem, 0, 0, BIG),
                                            rlk_attn_wgt_block(v_smem, 0, 0, BIG), p_bufs.index(0),
                                            x_smem.slice(0, 4), f_smem.slice(0, 4),
                                            k_ptr, v_ptr, pr_row, kbase, b, cap, kvh, v0, sk_row, sk_head, sv_row,
                                            sv_head, m, l, acc, pos, kpos0, qk_scale, BN, NQ, HEAD_D, DV, PS, PAGED,
                                            s_layout, col_s, col_o, ld_layout, X_LAYOUT, F_LAYOUT)
        rlk_attn_wg_ring_end(k_bars, v_bars, ST, ST)
        if LOADER:
            rlk_attn_wg_ring_end(k_free, v_free, ST, ST)

        rlk_attn_wgd_store(acc, m, l, valid_c, r_c, gl.arange(0, NQ, layout=col_o), v0 + gl.arange(0, DV, layout=row_o),
                           out_ptr, ws_m_ptr, ws_l_ptr, ws_a_ptr, t64, kvh, j, vs, u0, u1, tok0, NS, HQ, HKV, G, HEAD_D,
                           WS_M, FINISH, 1, col_o)


# ----------------------------------------------------------------------------------------------
# Host side


def launch_split_t(q, k, v, out, ws, tab, page_rows, page_size, G, qk_scale, splits, v_slices, *, paged, tile_rows, one,
                   order, split_blocks, pdl, quad=False):
    """Launch ``rlk_attn_split_wgt`` with ``AttentionTuning.wgt_decode_slots`` ring slots (with
    ``quad``, the unmasked run four blocks a step: ``AttentionTuning.wgt_quad_slots`` slots of four
    blocks each): ``hopper_warpgroup.launch_split``'s arguments over a paged (``paged``:
    ``page_size``-key pages listed in ``page_rows``) or contiguous cache (``page_rows[:, 0]``: each
    sequence's first storage row; 64-row block copies)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    finish = ws is None
    if finish != (splits == 1):
        raise ValueError(f"ws: expected a workspace exactly when splits > 1, got splits={splits}, ws={ws is not None}")
    nq = wgt_tile_rows(one, G, tile_rows)
    nt = tab.shape[0]
    ws_m, ws_l, ws_a = (out, out, out) if finish else ws
    ps = int(page_size) if paged else BLOCK_N
    # four contiguous blocks a step: one 256-row copy each of keys and values
    k_desc, v_desc = page_descriptors(k, v, 4 * BLOCK_N if quad and not paged else ps, D // v_slices)
    x_layout, f_layout = exchange_layouts(nq)
    tuning = current_tuning()
    sp = splits * v_slices
    grid = ((nt, Hkv, sp), (Hkv, nt, sp), (sp, nt, Hkv))[order]
    rlk_attn_split_wgt[grid](
        q, k_desc, v_desc, k, v, out, ws_m, ws_l, ws_a, tab, page_rows, page_rows.stride(0), qk_scale, k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), splits, Hq, Hkv, PS=ps, PAGED=bool(paged), G=G, HEAD_D=D,
        DV=D // v_slices, NQ=nq, WS_M=int(tile_rows), ONE=bool(one),
        ST=tuning.wgt_quad_slots if quad else tuning.wgt_decode_slots, PDL=bool(pdl), SB=split_blocks, ORDER=order,
        FINISH=finish, X_LAYOUT=x_layout, F_LAYOUT=f_layout, QUAD=bool(quad), num_warps=4, enable_fp_fusion=False,
        launch_pdl=bool(pdl),
    )
