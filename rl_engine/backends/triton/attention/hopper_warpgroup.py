"""Hopper warpgroup kernels (Gluon): the train path's forward ``rlk_attn_fwd_wg`` and the paged
decode split kernel ``rlk_attn_split_wg`` (after the forward's notes below), with their launchers.

The same computation as ``portable_forward.rlk_attn_fwd`` on the train path's packed rows with TMA
copies (``eligibility.tma_eligible``: 16-bit rows, one value slice, no pages), written with explicit
asynchronous warpgroup MMAs so that the tensor cores and the softmax overlap inside one program:
block ``j + 1``'s score product runs while block ``j``'s ``P`` is converted and the accumulator
rescaled, and block ``j``'s ``P·V`` runs while block ``j + 1``'s online-softmax step runs on the
CUDA cores (FlashAttention-3's intra-warpgroup pipelining). Triton 3.6 issues every ``tl.dot`` of
the Triton kernel and waits for it with nothing pending (offline compile), so there the two units
take turns.

Only the order in which independent work is issued changes. Every value is the Triton kernel's
(``device.rlk_attn_step``, ``rlk_attn_merge``, ``rlk_attn_finish``):

* ``s = q·kᵀ``: ``wgmma`` over the head dim in 16-column steps, increasing, from zero;
* ``m' = max(m, rowmax(s)·c + 0)``, the ``-inf`` guard on the shift for masked blocks,
  ``α = 2^(m − shift)``, ``P = 2^fma(s, c, −shift)`` (``ex2.approx.ftz``);
* ``l' = fma(l, α, Σ P)`` with the fixed pairwise row sum (``device.rlk_attn_rowsum``);
* ``acc' = P·V + acc·α`` with ``acc·α`` as the ``wgmma`` accumulator, ``P`` rounded to the
  input dtype;
* each KV split of ``SB`` blocks walked from ``(-inf, 0, +0)``, the splits merged in increasing
  order through the fp32 scratch tile (``portable_forward.rlk_attn_fwd``'s structure);
* ``out = acc · (1 / L)``, ``lse = (M + log2 L) · ln 2``.

A block whose mask hides nothing gives the unmasked step's bits (the guard and the select are
identities there), so each block takes the masked step exactly when some valid row of the tile
does not see all of it. The GPU tests compare every row, lse and fp32 row raw-bit with the Triton
kernel (``tests/backends/triton/attention/test_attention_hopper_warpgroup.py``).

The paged decode split kernel (``rlk_attn_split_wg``, ``eligibility.wg_decode_eligible`` and
``configs.wg_decode_programs``) is ``portable_forward.rlk_attn_fwd_split`` over a cache of 16- or 32-key
pages with this kernel's step: a 64-key block spans four (two) pages, and each page arrives as
one TMA copy into its 16-row (32-row) slice of the block's shared-memory ring slot, all under
the block's one barrier. Triton 3.6 cannot express this (its descriptor loads copy one box into
a block of their own, and its many-row ``gather`` is ``tile::gather4``, sm_100+), so the Triton
kernel gathers such blocks by pointer loads. The decode tile's at most 16 valid rows sit in a
64-row ``wgmma`` tile (the smallest); the masked blocks past a split's unmasked run take pointer
loads clamped to the tile's last position, stored into an idle ring slot. A step of one KV
split finishes its rows in the kernel. The GPU tests compare every row raw-bit with the Triton
kernels (the same test module).

Import this module only to launch (``launch.attend``, ``launch.varlen_forward``): it imports
``triton.experimental.gluon`` (Triton 3.6's Hopper API), which ``import rl_engine`` never does.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rl_engine.backends.triton.attention.hopper_common import (BLOCK_N, page_descriptors, smem_layout,
                                                               rlk_attn_wg_exp2, rlk_attn_wg_state0,
                                                               rlk_attn_wg_rows_io, rlk_attn_wg_q_tile,
                                                               rlk_attn_wg_ring, rlk_attn_wg_ring_end,
                                                               rlk_attn_wg_gdc_wait, rlk_attn_wgd_gdc_launch,
                                                               rlk_attn_wgd_entries, rlk_attn_wgd_copy,
                                                               rlk_attn_wgd_gather, rlk_attn_wgd_program,
                                                               rlk_attn_wgd_blocks, rlk_attn_wgd_store)
from rl_engine.backends.triton.attention.tuning import current_tuning

__all__ = ["DEVICE_FUNCTIONS", "KERNEL_NAMES", "descriptors", "launch", "launch_split", "rlk_attn_fwd_wg",
           "rlk_attn_split_wg"]

KERNEL_NAMES = ("rlk_attn_fwd_wg", "rlk_attn_split_wg")
#: ``@gluon.jit`` device functions in this module's namespace (its own and the shared ones from
#: ``hopper_common``), inlined into the kernels.
DEVICE_FUNCTIONS = ("rlk_attn_wg_rowsum", "rlk_attn_wg_merge", "rlk_attn_wg_softmax", "rlk_attn_wg_scratch",
                    "rlk_attn_wg_pv", "rlk_attn_wg_walk", "rlk_attn_wg_load", "rlk_attn_wgd_first",
                    "rlk_attn_wgd_walk", "rlk_attn_wgd_masked", "rlk_attn_wg_exp2", "rlk_attn_wg_state0",
                    "rlk_attn_wg_rows_io", "rlk_attn_wg_q_tile", "rlk_attn_wg_ring", "rlk_attn_wg_ring_end",
                    "rlk_attn_wg_gdc_wait", "rlk_attn_wgd_gdc_launch", "rlk_attn_wgd_entries", "rlk_attn_wgd_copy",
                    "rlk_attn_wgd_gather", "rlk_attn_wgd_program", "rlk_attn_wgd_blocks", "rlk_attn_wgd_store")


@gluon.jit
def rlk_attn_wg_rowsum(x, BM: gl.constexpr, N: gl.constexpr, LOG2N: gl.constexpr, layout: gl.constexpr):
    """The fixed pairwise fold of ``device.rlk_attn_rowsum``: columns ``j`` and ``j + N/2`` added,
    then halving, ``LOG2N`` steps. Each step is a sum over a reshaped axis of two (``[BM, 2, N/2]``):
    one IEEE add ``a + b`` per element, the same number either way round, so the same bits as the
    Triton kernel's ``split`` and add; the compiler exchanges the halves held by other lanes (the
    two steps whose columns sit in another lane of the MMA layout). The result is relabelled to
    ``layout`` (the score rows' slice layout, the same registers: ``assert_trivial``)."""
    for i in gl.static_range(LOG2N):
        x = gl.sum(gl.reshape(x, [BM, 2, N >> (i + 1)]), axis=1)
    return gl.convert_layout(gl.reshape(x, [BM]), layout, assert_trivial=True)


@gluon.jit
def rlk_attn_wg_merge(M, L, A, m, l, a):
    """``device.rlk_attn_merge``."""
    Mn = gl.maximum(M, m)
    Ms = gl.where(Mn == float("-inf"), 0.0, Mn)
    ea = rlk_attn_wg_exp2(M - Ms)
    ec = rlk_attn_wg_exp2(m - Ms)
    Ln = gl.fma(l, ec, L * ea)
    An = gl.fma(a, gl.expand_dims(ec, 1), A * gl.expand_dims(ea, 1))
    return Mn, Ln, An


@gluon.jit
def rlk_attn_wg_softmax(s, m, l, b, f0, f1, pos, wlo, kpos0, qk_scale, BM: gl.constexpr, BN: gl.constexpr,
                        row_s: gl.constexpr):
    """Block ``b``'s online-softmax step on its scores ``s`` (``device.rlk_attn_step``, without the
    ``P·V`` product): returns ``(m', l', P, α)``. Masked exactly when some valid row of the tile
    does not see the whole block (``b`` outside ``f0 .. f1``)."""
    if (b < f0) | (b > f1):
        kpos = b * 64 + kpos0
        vis = ((gl.expand_dims(kpos, 0) <= gl.expand_dims(pos, 1))
               & (gl.expand_dims(kpos, 0) >= gl.expand_dims(wlo, 1)))
        s = gl.where(vis, s, float("-inf"))
        mn = gl.maximum(m, gl.max(s, axis=1) * qk_scale + 0.0)
        shift = gl.where(mn == float("-inf"), 0.0, mn)
    else:
        mn = gl.maximum(m, gl.max(s, axis=1) * qk_scale + 0.0)
        shift = mn
    alpha = rlk_attn_wg_exp2(m - shift)
    p = rlk_attn_wg_exp2(gl.fma(s, qk_scale, -gl.expand_dims(shift, 1)))
    l = gl.fma(l, alpha, rlk_attn_wg_rowsum(p, BM, BN, 6, row_s))
    return mn, l, p, alpha


@gluon.jit
def rlk_attn_wg_scratch(base, BM: gl.constexpr, HEAD_D: gl.constexpr, o_layout: gl.constexpr):
    """The scratch tile's element pointers in the accumulator's layout, register-major: element
    ``(r, c)`` of the ``wgmma`` accumulator (thread ``t = 32·(r // 16) + 4·(r % 8) + (c % 8) // 2``,
    register ``k = 4·(c // 8) + 2·((r % 16) // 8) + c % 2``) sits at ``k · threads + t``. A thread's
    addresses are one base plus constants, and each register's load or store is one coalesced
    128-byte line a warp. (Row-major addresses need sixteen 64-bit bases a thread, which the
    compiler keeps live across the split loop; thread-major ones, one contiguous run a thread,
    make every access touch 32 sectors: 4 × 4096 runs 1.7× slower on the H200.) The scratch
    is this program's own, written and read in the same layout, and exact fp32, so its layout
    does not touch the bits."""
    r = gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
    c = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    NT: gl.constexpr = 2 * BM  # threads: one warp per 16 rows
    rpart = ((r % 16) // 8) * (2 * NT) + (r // 16) * 32 + (r % 8) * 4
    cpart = ((c // 8) * 4 + (c % 2)) * NT + (c % 8) // 2
    return base + gl.expand_dims(rpart, 1) + gl.expand_dims(cpart, 0)


@gluon.jit
def rlk_attn_wg_pv(p, alpha, acc, v_smem, v_bars, j, V_ST: gl.constexpr, p_layout: gl.constexpr,
                   row_o: gl.constexpr):
    """Issue block ``j``'s ``P·V`` (asynchronous; returns its token): ``P`` rounded to the value
    dtype into the ``wgmma`` operand registers, the accumulator rescaled by ``α`` (the product's
    accumulator input), then the product once the value block has arrived."""
    pv = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    mbarrier.wait(v_bars.index(j % V_ST), phase=(j // V_ST) & 1)
    return warpgroup_mma(pv, v_smem.index(j % V_ST), acc, is_async=True)


@gluon.jit
def rlk_attn_wg_walk(q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, kbase, col, first, nb, j0, j1, f0, f1, pos,
                     wlo, kpos0, qk_scale, BM: gl.constexpr, BN: gl.constexpr, HEAD_D: gl.constexpr,
                     K_ST: gl.constexpr, V_ST: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                     p_layout: gl.constexpr, row_s: gl.constexpr, row_o: gl.constexpr):
    """Blocks ``first + j0 .. first + j1`` (one KV split, or every block when none is merged) from
    the state ``(-inf, 0, +0)``: returns ``(m, l, acc)``. ``j`` counts the tile's blocks from
    ``first``: block ``j``'s keys and values sit in ring slots ``j % K_ST`` and ``j % V_ST``; the
    copies run ahead across split ends (``rlk_attn_wg_load``, up to block ``nb - 1``).

    Iteration ``j``, nothing in flight on entry, block ``j``'s ``P`` and ``α`` computed: block
    ``j + 1``'s score product is issued first; ``P`` goes to its operand registers and the
    accumulator is rescaled while it runs; block ``j``'s ``P·V`` is issued; the scores retire and
    block ``j + 1``'s softmax runs while the ``P·V`` runs; the ``P·V`` retires. No register an
    in-flight ``wgmma`` reads or writes is touched before it retires (``P`` goes to its operand
    registers only once the previous product has retired, as in FlashAttention-3; a ``P·V`` left
    in flight across the back edge makes ``ptxas`` serialise every ``wgmma``, warning C7514). The
    split's merge runs between walks, with nothing in flight: inside the pipelined order the
    accumulator, the scratch tile and the next block's scores would be live at once (254 registers)."""
    zero_s = gl.zeros([BM, BN], gl.float32, s_layout)
    mbarrier.wait(k_bars.index(j0 % K_ST), phase=(j0 // K_ST) & 1)
    s_tok = warpgroup_mma(q_smem, k_smem.index(j0 % K_ST).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    # block j0's key slot is free: it takes block j0 + K_ST
    rlk_attn_wg_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kbase, col, first, j0 + K_ST, nb, K_ST, V_ST, True)
    m, l, p, alpha = rlk_attn_wg_softmax(s, gl.full([BM], float("-inf"), gl.float32, row_s),
                                         gl.zeros([BM], gl.float32, row_s), first + j0, f0, f1, pos, wlo, kpos0,
                                         qk_scale, BM, BN, row_s)
    acc = gl.zeros([BM, HEAD_D], gl.float32, o_layout)
    for j in range(j0, j1):
        jn = j + 1
        mbarrier.wait(k_bars.index(jn % K_ST), phase=(jn // K_ST) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(jn % K_ST).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc_tok = rlk_attn_wg_pv(p, alpha, acc, v_smem, v_bars, j, V_ST, p_layout, row_o)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        # block j + 1's key slot is free: it takes block j + 1 + K_ST
        rlk_attn_wg_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kbase, col, first, jn + K_ST, nb, K_ST, V_ST,
                         True)
        m, l, p, alpha = rlk_attn_wg_softmax(s, m, l, first + jn, f0, f1, pos, wlo, kpos0, qk_scale, BM, BN, row_s)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        # block j's value slot is free: it takes block j + V_ST
        rlk_attn_wg_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kbase, col, first, j + V_ST, nb, K_ST, V_ST,
                         False)
    # the walk's last block
    acc = warpgroup_mma_wait(0, deps=(rlk_attn_wg_pv(p, alpha, acc, v_smem, v_bars, j1, V_ST, p_layout, row_o), ))
    rlk_attn_wg_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kbase, col, first, j1 + V_ST, nb, K_ST, V_ST,
                     False)
    return m, l, acc


@gluon.jit
def rlk_attn_wg_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kbase, col, first, j, nb,
                     K_ST: gl.constexpr, V_ST: gl.constexpr, KEY: gl.constexpr):
    """Issue the TMA copy of block ``first + j``'s keys (``KEY``) or values into its ring slot,
    if ``j < nb``."""
    pred = j < nb
    row0 = (kbase + (first + j) * 64).to(gl.int32)
    if KEY:
        slot = j % K_ST
        bar = k_bars.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [row0, col], bar, k_smem.index(slot), pred=pred)
    else:
        slot = j % V_ST
        bar = v_bars.index(slot)
        mbarrier.expect(bar, v_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(v_desc, [row0, col], bar, v_smem.index(slot), pred=pred)


@gluon.jit
def rlk_attn_fwd_wg(q_ptr, k_desc, v_desc, out_ptr, out32_ptr, lse_ptr, scr_ptr, tab_ptr, pr_ptr, pr_stride,
                    G: gl.constexpr, W, qk_scale, HQ, HKV, HEAD_D: gl.constexpr, HAS_WINDOW: gl.constexpr,
                    STORE_F32: gl.constexpr, STORE_LSE: gl.constexpr, MULTI: gl.constexpr, SB: gl.constexpr,
                    K_ST: gl.constexpr, V_ST: gl.constexpr, BLOCK_ROWS: gl.constexpr, PDL: gl.constexpr):
    """Grid (tiles, kv heads): tile ``t``'s rows ``(token, g)`` of one sequence (the tile table of
    ``launch.varlen_tiles``; program ``i`` takes tile ``tiles - 1 - i``), over the key blocks
    ``first .. last`` of the tile in increasing order, split by split (``SB`` blocks each), as
    ``portable_forward.rlk_attn_fwd`` does. The first key and value copies are issued before the tile's
    ``Q`` rows are loaded; ``first``, ``last`` and the unmasked run ``f0 .. f1`` come from the
    table's scalars (the tile's first and last valid rows), not from reductions over the rows.
    ``PDL``: launched under programmatic dependent launch, it waits on the device for the tile
    table's kernel (``tile_tables.rlk_attn_varlen_tiles``) before reading the table."""
    rlk_attn_wg_gdc_wait(PDL)
    BM: gl.constexpr = BLOCK_ROWS
    NW: gl.constexpr = BLOCK_ROWS // 16
    BN: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    row_io: gl.constexpr = gl.SliceLayout(1, io_layout)
    dtype: gl.constexpr = k_desc.dtype
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, HEAD_D], dtype)

    # the table's last tile first: a sequence's tiles are listed in increasing position, so under
    # causal masks the programs launch heaviest first and the grid's last wave is its lightest
    t = gl.num_programs(0) - 1 - gl.program_id(0)
    kvh = gl.program_id(1).to(gl.int64)
    t64 = t.to(gl.int64)
    seq = gl.load(tab_ptr + t64 * 4)
    u0 = gl.load(tab_ptr + t64 * 4 + 1)
    u1 = gl.load(tab_ptr + t64 * 4 + 2)
    pbase = gl.load(tab_ptr + t64 * 4 + 3)
    kbase = gl.load(pr_ptr + seq * pr_stride).to(gl.int64)
    tok0 = u0 // G

    # the valid rows' extremes from the table's scalars: positions (and window starts) do not
    # decrease along the rows, so the first valid row holds the least and row u1 - u0 - 1 the
    # greatest (the minima and maxima over the rows, without a reduction across the warps)
    p_lo = (tok0 - pbase).to(gl.int32)
    p_hi = ((u1 - 1) // G - pbase).to(gl.int32)
    if HAS_WINDOW:
        w_lo = gl.maximum(p_lo - W + 1, 0)
        w_hi = gl.maximum(p_hi - W + 1, 0)
    else:
        w_lo = 0
        w_hi = 0
    first = w_lo // 64
    last = gl.where(u1 > u0, p_hi // 64, -1)
    if last >= 0:
        # blocks every valid row sees entirely: f0 .. f1 (unmasked steps); the others masked
        f0 = (w_hi + 63) // 64
        f1 = (p_lo + 1) // 64 - 1

        # the first key and value copies are issued before the tile's Q rows are loaded, so that
        # both latencies overlap (a short sequence's tile is mostly its first copies' wait)
        k_smem, v_smem, k_bars, v_bars = rlk_attn_wg_ring(k_desc, v_desc, K_ST, V_ST, BN, HEAD_D, HEAD_D)
        col = (kvh * HEAD_D).to(gl.int32)
        nb = last - first + 1
        for i in gl.static_range(K_ST):
            rlk_attn_wg_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kbase, col, first, i, nb, K_ST, V_ST,
                             True)
        for i in gl.static_range(V_ST):
            rlk_attn_wg_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kbase, col, first, i, nb, K_ST, V_ST,
                             False)

        q_smem, offs_d = rlk_attn_wg_q_tile(q_ptr, u0, u1, tok0, kvh, G, HQ, HEAD_D, BM, io_layout, q_smem_layout)

        # the tile's rows in the score rows' layout: positions and window starts, for the masks
        rel_s = (u0 - tok0 * G).to(gl.int32) + gl.arange(0, BM, layout=row_s)
        valid_s = gl.arange(0, BM, layout=row_s).to(gl.int64) < u1 - u0
        tok_s = tok0 + rel_s // G
        pos = gl.where(valid_s, tok_s - pbase, 0).to(gl.int32)
        if HAS_WINDOW:
            wlo = gl.maximum(pos - W + 1, 0)
        else:
            wlo = gl.zeros_like(pos)
        kpos0 = gl.arange(0, BN, layout=col_s)
        if MULTI:
            # portable_forward.rlk_attn_fwd's order: each KV split walked on its own and merged into
            # (M, L, A) in increasing order, A waiting in this tile's fp32 scratch between splits
            # (the first merge from (-inf, 0, +0)); the last split merged into it once walked
            scr = scr_ptr + (t64 * HKV + kvh) * (BM * HEAD_D)
            M = gl.full([BM], float("-inf"), gl.float32, row_o)
            L = gl.zeros([BM], gl.float32, row_o)
            s_first = first // SB
            s_last = last // SB
            for sp in range(s_first, s_last):
                m, l, a = rlk_attn_wg_walk(q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, kbase, col, first,
                                           nb, gl.maximum(first, sp * SB) - first, sp * SB + SB - 1 - first, f0, f1,
                                           pos, wlo, kpos0, qk_scale, BM, BN, HEAD_D, K_ST, V_ST, s_layout, o_layout,
                                           p_layout, row_s, row_o)
                ptrs = rlk_attn_wg_scratch(scr, BM, HEAD_D, o_layout)
                if sp > s_first:
                    A = gl.load(ptrs)
                else:
                    A = gl.zeros([BM, HEAD_D], gl.float32, o_layout)
                M, L, A = rlk_attn_wg_merge(M, L, A, gl.convert_layout(m, row_o), gl.convert_layout(l, row_o), a)
                gl.store(ptrs, A)
            m, l, a = rlk_attn_wg_walk(q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, kbase, col, first, nb,
                                       gl.maximum(first, s_last * SB) - first, nb - 1, f0, f1, pos, wlo, kpos0,
                                       qk_scale, BM, BN, HEAD_D, K_ST, V_ST, s_layout, o_layout, p_layout, row_s,
                                       row_o)
            m_o = gl.convert_layout(m, row_o)
            l_o = gl.convert_layout(l, row_o)
            if s_last > s_first:
                M, L, A = rlk_attn_wg_merge(M, L, gl.load(rlk_attn_wg_scratch(scr, BM, HEAD_D, o_layout)), m_o, l_o, a)
            else:
                M = m_o
                L = l_o
                A = a
        else:
            # every block in one KV split: no merge (merging one split into the initial state is an
            # exact identity, portable_forward.rlk_attn_fwd)
            m, l, A = rlk_attn_wg_walk(q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, kbase, col, first, nb,
                                       0, nb - 1, f0, f1, pos, wlo, kpos0, qk_scale, BM, BN, HEAD_D, K_ST, V_ST,
                                       s_layout, o_layout, p_layout, row_s, row_o)
            M = gl.convert_layout(m, row_o)
            L = gl.convert_layout(l, row_o)
        rlk_attn_wg_ring_end(k_bars, v_bars, K_ST, V_ST)

        # device.rlk_attn_finish (stored through a blocked layout: storing from the accumulator's
        # registers is slower, 263 -> 301 us at 32 x 512 on the H200)
        r = gl.div_rn(gl.full([BM], 1.0, gl.float32, row_o), L)
        if STORE_F32:
            o = gl.convert_layout(A * gl.expand_dims(r, 1), io_layout)
        else:
            # rounded before the relayout (an elementwise rounding either way round): half the
            # bytes through shared memory when the fp32 rows are not stored
            o = gl.convert_layout((A * gl.expand_dims(r, 1)).to(out_ptr.dtype.element_ty), io_layout)
        # the rows again (nb >> 30 is 0: see rlk_attn_wg_rows_io)
        valid_io, tok_io, head_io, q_off = rlk_attn_wg_rows_io(u0, u1, tok0, kvh, nb >> 30, G, HQ, HEAD_D, BM, row_io)
        omask = gl.expand_dims(valid_io, 1)
        optr = gl.expand_dims(q_off, 1) + gl.expand_dims(offs_d, 0)
        gl.store(out_ptr + optr, o.to(out_ptr.dtype.element_ty), mask=omask)
        if STORE_F32:
            gl.store(out32_ptr + optr, o, mask=omask)
        if STORE_LSE:
            lse = gl.convert_layout((M + gl.log2(L)) * 0.6931471805599453, row_io)
            gl.store(lse_ptr + tok_io * HQ + head_io, lse, mask=valid_io)


@gluon.jit
def rlk_attn_wgd_first(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, pr_row, b0, nu, col, vcol,
                       ST: gl.constexpr, PS: gl.constexpr, PPB: gl.constexpr):
    """The copies of the unmasked run's first ``ST`` blocks (``b0 ..``, ``nu >= 1`` blocks): their
    page-table entries loaded together, then the copies issued (before the tile's ``Q`` rows are
    loaded, so that the latencies overlap)."""
    es = ()
    for i in gl.static_range(ST):
        es = es + (rlk_attn_wgd_entries(pr_row, b0 + gl.minimum(i, nu - 1), PPB), )
    for i in gl.static_range(ST):
        rlk_attn_wgd_copy(k_desc, k_smem, k_bars, es[i], col, i, nu, ST, PS, PPB)
        rlk_attn_wgd_copy(v_desc, v_smem, v_bars, es[i], vcol, i, nu, ST, PS, PPB)


@gluon.jit
def rlk_attn_wgd_walk(q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, pr_row, col, vcol, b0, nu, pos, kpos0,
                      qk_scale, BM: gl.constexpr, BN: gl.constexpr, DV: gl.constexpr, ST: gl.constexpr,
                      PS: gl.constexpr, PPB: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                      p_layout: gl.constexpr, row_s: gl.constexpr, row_o: gl.constexpr):
    """The unmasked run ``b0 .. b0 + nu - 1`` (``nu >= 1``; its first ``ST`` blocks' copies issued,
    ``rlk_attn_wgd_first``) of one KV split over a paged cache from ``(-inf, 0, +0)``:
    ``rlk_attn_wg_walk``'s pipelined order, each block's keys and values arriving as ``PPB`` page
    copies (values: columns ``vcol ..``, ``DV`` of them). A block's page-table entries are loaded
    one iteration before its copies are issued (the loads' latency hides behind that iteration)."""
    last = nu - 1
    # entries of block ST (its key copy before the loop, its value copy in iteration 0) and of
    # block ST + 1 (its key copy in iteration 0)
    ek = rlk_attn_wgd_entries(pr_row, b0 + gl.minimum(ST, last), PPB)
    en = rlk_attn_wgd_entries(pr_row, b0 + gl.minimum(ST + 1, last), PPB)
    zero_s = gl.zeros([BM, BN], gl.float32, s_layout)
    mbarrier.wait(k_bars.index(0), phase=0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    rlk_attn_wgd_copy(k_desc, k_smem, k_bars, ek, col, ST, nu, ST, PS, PPB)
    m, l, p, alpha = rlk_attn_wg_softmax(s, gl.full([BM], float("-inf"), gl.float32, row_s),
                                         gl.zeros([BM], gl.float32, row_s), 0, 0, last, pos, pos * 0, kpos0,
                                         qk_scale, BM, BN, row_s)
    acc = gl.zeros([BM, DV], gl.float32, o_layout)
    for j in range(0, last):
        jn = j + 1
        # block jn + ST + 1's entries: its key copy is next iteration's
        ef = rlk_attn_wgd_entries(pr_row, b0 + gl.minimum(jn + ST + 1, last), PPB)
        mbarrier.wait(k_bars.index(jn % ST), phase=(jn // ST) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(jn % ST).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc_tok = rlk_attn_wg_pv(p, alpha, acc, v_smem, v_bars, j, ST, p_layout, row_o)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        # block jn's key slot is free: it takes block jn + ST
        rlk_attn_wgd_copy(k_desc, k_smem, k_bars, en, col, jn + ST, nu, ST, PS, PPB)
        m, l, p, alpha = rlk_attn_wg_softmax(s, m, l, jn, 0, last, pos, pos * 0, kpos0, qk_scale, BM, BN, row_s)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        # block j's value slot is free: it takes block j + ST
        rlk_attn_wgd_copy(v_desc, v_smem, v_bars, ek, vcol, j + ST, nu, ST, PS, PPB)
        ek = en
        en = ef
    acc = warpgroup_mma_wait(0, deps=(rlk_attn_wg_pv(p, alpha, acc, v_smem, v_bars, last, ST, p_layout, row_o), ))
    return m, l, acc


@gluon.jit
def rlk_attn_wgd_masked(q_smem, k_buf, v_buf, k_ptr, v_ptr, pr_row, b, cap, kvh, v0, sk_row, sk_head, sv_row, sv_head,
                        m, l, acc, pos, kpos0, qk_scale, BM: gl.constexpr, BN: gl.constexpr, HEAD_D: gl.constexpr,
                        DV: gl.constexpr, PS: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
                        row_s: gl.constexpr, row_o: gl.constexpr, ld_layout: gl.constexpr):
    """Block ``b`` past the unmasked run (some row does not see all of it): its rows by pointer
    loads, positions clamped to ``cap`` (``device.rlk_attn_load``: every row read is a written
    one), through shared memory (``k_buf``, ``v_buf``: ring slots the walk left idle), then the
    masked step (``rlk_attn_wg_softmax``). Values: columns ``v0 .. v0 + DV - 1``."""
    rlk_attn_wgd_gather(k_buf, v_buf, k_ptr, v_ptr, pr_row, pr_row, b, cap, kvh, v0, sk_row, sk_head, sv_row, sv_head,
                        BN, HEAD_D, DV, PS, True, ld_layout)
    zero_s = gl.zeros([BM, BN], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_smem, k_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    m, l, p, alpha = rlk_attn_wg_softmax(s, m, l, b, 0, b - 1, pos, pos * 0, kpos0, qk_scale, BM, BN, row_s)
    pv = gl.convert_layout(p.to(v_buf.dtype), p_layout)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    acc = warpgroup_mma_wait(0, deps=(warpgroup_mma(pv, v_buf, acc, is_async=True), ))
    # the buffers are written again by the next masked block only after every warp's products
    gl.thread_barrier()
    return m, l, acc


@gluon.jit
def rlk_attn_split_wg(q_ptr, k_desc, v_desc, k_ptr, v_ptr, out_ptr, ws_m_ptr, ws_l_ptr, ws_a_ptr, tab_ptr, pr_ptr,
                      pr_stride, qk_scale, sk_row, sk_head, sv_row, sv_head, NS, HQ, HKV, PS: gl.constexpr,
                      G: gl.constexpr, HEAD_D: gl.constexpr, DV: gl.constexpr, WS_M: gl.constexpr, ONE: gl.constexpr,
                      ST: gl.constexpr, PDL: gl.constexpr, SB: gl.constexpr, ORDER: gl.constexpr,
                      FINISH: gl.constexpr):
    """``portable_forward.rlk_attn_fwd_split`` over a paged cache of ``PS``-key pages (``PS`` divides 64, at
    most four pages a block), no window, as a Hopper warpgroup kernel: grid (tiles, kv heads,
    splits · ``HEAD_D / DV``) in the axis order ``ORDER`` (``configs.split_grid_order``); program
    ``(t, h, j·VS + vs)`` walks split ``j`` of decode tile ``t`` (at most ``WS_M`` rows, in a 64-row
    ``wgmma`` tile) for value columns ``vs·DV ..`` (value slices, ``AttnConfig.v_slices``) and
    stores its ``(m, l, acc)`` where ``rlk_attn_combine`` reads them (``WS_M``-row workspace
    slots; the ``vs = 0`` program stores ``m``, ``l``, which every slice computes alike).
    ``FINISH`` (a step of one KV split, ``NS = 1``): the program finishes its rows instead, ``out =
    acc · (1 / l)`` in the output dtype (``device.rlk_attn_finish``; merging the one split into
    the initial state, as ``rlk_attn_fwd`` and the combine do, is an exact identity), so no
    workspace and no combine launch.

    A block of the unmasked run arrives as ``64 / PS`` TMA copies, one per page, into the
    ``PS``-row slices of one shared-memory block (``rlk_attn_wgd_walk``); the Triton kernel
    gathers such blocks by pointer loads, since Triton's descriptor loads take one box a block
    (and its ``gather`` form is ``tile::gather4``, sm_100+). The masked blocks after the run take
    pointer loads clamped to the tile's last position (``rlk_attn_wgd_masked``). The order of
    operations is ``rlk_attn_split``'s (unmasked run, then masked blocks, from ``(-inf, 0, +0)``)
    with the step of ``rlk_attn_fwd_wg``, so the same bits (GPU tests)."""
    rlk_attn_wg_gdc_wait(PDL)
    rlk_attn_wgd_gdc_launch(PDL)
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    PPB: gl.constexpr = 64 // PS
    VS: gl.constexpr = HEAD_D // DV
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    dtype: gl.constexpr = k_desc.dtype
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, HEAD_D], dtype)

    t64, kvh, j, vs, seq, u0, u1, pbase, tok0, p_lo, cap, last = rlk_attn_wgd_program(tab_ptr, G, VS, ONE, ORDER)
    if (last >= 0) & (j <= last // SB):
        b0, b1, nu = rlk_attn_wgd_blocks(j, last, p_lo, SB)
        pr_row = pr_ptr + seq * pr_stride
        col = (kvh * HEAD_D).to(gl.int32)
        v0 = (vs * DV).to(gl.int32)

        k_smem, v_smem, k_bars, v_bars = rlk_attn_wg_ring(k_desc, v_desc, ST, ST, BN, HEAD_D, DV)
        # the first blocks' copies are issued before the tile's Q rows are loaded
        if nu > 0:
            rlk_attn_wgd_first(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, pr_row, b0, nu, col, col + v0, ST, PS,
                               PPB)

        q_smem, offs_d = rlk_attn_wg_q_tile(q_ptr, u0, u1, tok0, kvh, G, HQ, HEAD_D, BM, io_layout, q_smem_layout)

        rel_s = (u0 - tok0 * G).to(gl.int32) + gl.arange(0, BM, layout=row_s)
        valid_s = gl.arange(0, BM, layout=row_s).to(gl.int64) < u1 - u0
        pos = gl.where(valid_s, tok0 + rel_s // G - pbase, 0).to(gl.int32)
        kpos0 = gl.arange(0, BN, layout=col_s)
        if nu > 0:
            m, l, acc = rlk_attn_wgd_walk(q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, pr_row, col,
                                          col + v0, b0, nu, pos, kpos0, qk_scale, BM, BN, DV, ST, PS, PPB, s_layout,
                                          o_layout, p_layout, row_s, row_o)
        else:
            m, l, acc = rlk_attn_wg_state0(BM, BM, DV, row_s, o_layout)
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        for b in range(b0 + nu, b1 + 1):
            m, l, acc = rlk_attn_wgd_masked(q_smem, k_smem.index(0), v_smem.index(0), k_ptr, v_ptr, pr_row, b, cap,
                                            kvh, v0, sk_row, sk_head, sv_row, sv_head, m, l, acc, pos, kpos0,
                                            qk_scale, BM, BN, HEAD_D, DV, PS, s_layout, p_layout, row_s, row_o,
                                            ld_layout)
        rlk_attn_wg_ring_end(k_bars, v_bars, ST, ST)

        rlk_attn_wgd_store(acc, m, l, valid_s, gl.arange(0, BM, layout=row_s), gl.arange(0, BM, layout=row_o),
                           v0 + gl.arange(0, DV, layout=col_o), out_ptr, ws_m_ptr, ws_l_ptr, ws_a_ptr, t64, kvh, j, vs,
                           u0, u1, tok0, NS, HQ, HKV, G, HEAD_D, WS_M, FINISH, 0, row_o)


# ----------------------------------------------------------------------------------------------
# Host side


def descriptors(k: torch.Tensor, v: torch.Tensor):
    """TMA descriptors of the ``[T, Hkv·D]`` views of keys and values: ``[64, D]`` boxes."""
    n, hkv, d = k.shape
    layout = smem_layout(BLOCK_N, d, k.dtype)
    return (TensorDescriptor(k, [n, hkv * d], [k.stride(0), 1], [BLOCK_N, d], layout),
            TensorDescriptor(v, [n, hkv * d], [v.stride(0), 1], [BLOCK_N, d], layout))


def launch(q, k, v, out, out32, lse, scr, tab, page_rows, G, window, qk_scale, *, store_f32, store_lse, multi,
           split_blocks, pdl: bool = False):
    """Launch ``rlk_attn_fwd_wg`` over tile table ``tab`` (``AttentionTuning.wg_forward_block_m``-row
    tiles) with ``AttentionTuning.wg_forward_rings[multi]`` (ring depths, register cap) as they are at
    the call. ``page_rows``: the storage row of each sequence's position 0 (int32 or int64, ``[B, 1]``
    with any row stride: ``cu_seqlens[:-1]`` as it is). ``split_blocks``: blocks a KV split.
    ``pdl``: programmatic dependent launch (``eligibility.use_pdl``)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    k_desc, v_desc = descriptors(k, v)
    nt = tab.shape[0]
    dummy = out
    tuning = current_tuning()
    k_st, v_st, regs = tuning.wg_forward_rings[bool(multi)]
    block_m = tuning.wg_forward_block_m
    cap = {} if regs is None else {"maxnreg": int(regs)}
    rlk_attn_fwd_wg[(nt, Hkv)](
        q, k_desc, v_desc, out, out32 if out32 is not None else dummy, lse if lse is not None else dummy, scr, tab,
        page_rows, page_rows.stride(0), G, 0 if window is None else int(window), qk_scale, Hq, Hkv, HEAD_D=D,
        HAS_WINDOW=window is not None, STORE_F32=store_f32, STORE_LSE=store_lse, MULTI=multi, SB=split_blocks,
        K_ST=k_st, V_ST=v_st, BLOCK_ROWS=block_m, PDL=bool(pdl), num_warps=block_m // 16, enable_fp_fusion=False,
        launch_pdl=bool(pdl), **cap,
    )


def launch_split(q, k, v, out, ws, tab, page_rows, page_size, G, qk_scale, splits, v_slices, *, tile_rows, one, order,
                 split_blocks, pdl):
    """Launch ``rlk_attn_split_wg`` with ``AttentionTuning.wg_decode_slots`` ring slots over decode tiles ``tab``
    (``tile_rows`` rows each, the table's ``BLOCK_M``; ``one``: ``tab`` is ``q_pos`` of a
    one-token-per-sequence step) and the paged cache ``k``, ``v`` (``[rows, Hkv, D]``,
    ``page_size``-key pages listed in ``page_rows``), ``v_slices`` programs a split; grid axis
    order ``order`` (``configs.split_grid_order``). ``ws``: the workspace ``(ws_m, ws_l, ws_a)``
    (``[tiles, Hkv, splits, tile_rows]``, ``[..., D]``) that ``split_kv_combine.rlk_attn_combine``
    folds, or ``None`` for a step of one split (``splits == 1``), whose programs write ``out``
    themselves. ``split_blocks``: blocks a KV split."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    finish = ws is None
    if finish != (splits == 1):
        raise ValueError(f"ws: expected a workspace exactly when splits > 1, got splits={splits}, ws={ws is not None}")
    nt = tab.shape[0]
    ws_m, ws_l, ws_a = (out, out, out) if finish else ws
    k_desc, v_desc = page_descriptors(k, v, page_size, D // v_slices)
    sp = splits * v_slices
    grid = ((nt, Hkv, sp), (Hkv, nt, sp), (sp, nt, Hkv))[order]
    rlk_attn_split_wg[grid](
        q, k_desc, v_desc, k, v, out, ws_m, ws_l, ws_a, tab, page_rows, page_rows.stride(0), qk_scale, k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), splits, Hq, Hkv, PS=int(page_size), G=G, HEAD_D=D, DV=D // v_slices,
        WS_M=int(tile_rows), ONE=bool(one), ST=current_tuning().wg_decode_slots, PDL=bool(pdl), SB=split_blocks,
        ORDER=order,
        FINISH=finish, num_warps=4, enable_fp_fusion=False, launch_pdl=bool(pdl),
    )
