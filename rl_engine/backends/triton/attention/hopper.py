"""Hopper warpgroup kernels (Gluon): the train path's forward ``rlk_attn_fwd_wg`` and the paged
decode split kernel ``rlk_attn_split_wg`` (after the forward's notes below).

The same computation as ``kernels.rlk_attn_fwd`` on the train path's packed rows with TMA copies
(``kernels.tma_eligible``: 16-bit rows, one value slice, no pages), written with explicit
asynchronous warpgroup MMAs so that the tensor cores and the softmax overlap inside one program:
block ``j + 1``'s score product runs while block ``j``'s ``P`` is converted and the accumulator
rescaled, and block ``j``'s ``P·V`` runs while block ``j + 1``'s online-softmax step runs on the
CUDA cores (FlashAttention-3's intra-warpgroup pipelining). Triton 3.6 issues every ``tl.dot`` of
the Triton kernel and waits for it with nothing pending (offline compile), so there the two units
take turns.

Only the order in which independent work is issued changes. Every value is the Triton kernel's
(``kernels.rlk_attn_step``, ``rlk_attn_merge``, ``rlk_attn_finish``):

* ``s = q·kᵀ``: ``wgmma`` over the head dim in 16-column steps, increasing, from zero;
* ``m' = max(m, rowmax(s)·c + 0)``, the ``-inf`` guard on the shift for masked blocks,
  ``α = 2^(m − shift)``, ``P = 2^fma(s, c, −shift)`` (``ex2.approx.ftz``);
* ``l' = fma(l, α, Σ P)`` with the fixed pairwise row sum (``kernels.rlk_attn_rowsum``);
* ``acc' = P·V + acc·α`` with ``acc·α`` as the ``wgmma`` accumulator, ``P`` rounded to the
  input dtype;
* each KV split of ``SB`` blocks walked from ``(-inf, 0, +0)``, the splits merged in increasing
  order through the fp32 scratch tile (``kernels.rlk_attn_fwd``'s structure);
* ``out = acc · (1 / L)``, ``lse = (M + log2 L) · ln 2``.

A block whose mask hides nothing gives the unmasked step's bits (the guard and the select are
identities there), so each block takes the masked step exactly when some valid row of the tile
does not see all of it. The GPU tests compare every row, lse and fp32 row raw-bit with the Triton
kernel (``test_attention_triton.py``, ``hopper``).

The paged decode split kernel (``rlk_attn_split_wg``, ``kernels.wg_decode_eligible`` and
``kernels.wg_decode_programs``) is ``kernels.rlk_attn_fwd_split`` over a cache of 16- or 32-key
pages with this kernel's step: a 64-key block spans four (two) pages, and each page arrives as
one TMA copy into its 16-row (32-row) slice of the block's shared-memory ring slot, all under
the block's one barrier. Triton 3.6 cannot express this (its descriptor loads copy one box into
a block of their own, and its many-row ``gather`` is ``tile::gather4``, sm_100+), so the Triton
kernel gathers such blocks by pointer loads. The decode tile's at most 16 valid rows sit in a
64-row ``wgmma`` tile (the smallest); the masked blocks past a split's unmasked run take pointer
loads clamped to the tile's last position, stored into an idle ring slot. A step of one KV
split finishes its rows in the kernel. The GPU tests compare every row raw-bit with the Triton
kernels (``test_attention_triton.py``, ``warpgroup_paged_decode``).

Import this module only to launch (``kernels.attend``): it imports ``triton.experimental.gluon``
(Triton 3.6's Hopper API), which ``import rl_engine`` never does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rl_engine.backends.triton.attention import kernels as _kernels  # its @triton.jit scalar helpers

KERNEL_NAMES = ("rlk_attn_fwd_wg", "rlk_attn_split_wg", "rlk_attn_split_wgt")
#: ``@gluon.jit`` device functions (inlined into the kernel, never launched on their own).
DEVICE_FUNCTIONS = ("rlk_attn_wg_gdc_wait", "rlk_attn_wg_exp2", "rlk_attn_wg_rowsum", "rlk_attn_wg_merge",
                    "rlk_attn_wg_state0",
                    "rlk_attn_wg_softmax", "rlk_attn_wg_scratch", "rlk_attn_wg_rows_io", "rlk_attn_wg_q_tile",
                    "rlk_attn_wg_ring", "rlk_attn_wg_ring_end", "rlk_attn_wg_pv", "rlk_attn_wg_walk",
                    "rlk_attn_wg_load", "rlk_attn_wgd_gdc_launch", "rlk_attn_wgd_entries", "rlk_attn_wgd_copy",
                    "rlk_attn_wgd_first", "rlk_attn_wgd_walk", "rlk_attn_wgd_masked", "rlk_attn_wgd_program",
                    "rlk_attn_wgd_blocks", "rlk_attn_wgd_store", "rlk_attn_wgd_gather", "rlk_attn_wgt_softmax",
                    "rlk_attn_wgt_stage", "rlk_attn_wgt_pv", "rlk_attn_wgt_entries", "rlk_attn_wgt_walk",
                    "rlk_attn_wgt_masked", "rlk_attn_wgt_block", "rlk_attn_wgt_copy4", "rlk_attn_wgt_entries4",
                    "rlk_attn_wgt_scores4", "rlk_attn_wgt_max4", "rlk_attn_wgt_fold", "rlk_attn_wgt_pv_fold",
                    "rlk_attn_wgt_quad", "rlk_attn_wgt_quads", "rlk_attn_wgt_quads_ws", "rlk_attn_wgt_loader")

#: key-block rows (``kernels.KV_BLOCK``) and the tile's query rows (one warpgroup, 16 rows a warp;
#: 128-row tiles of two warpgroups are slower on the H200)
BLOCK_N = 64
BLOCK_M = 64
#: The launch configuration by whether the launch merges KV splits (``MULTI``: some sequence is
#: longer than one split): TMA ring slots for key and value blocks (16 KiB each, ``Q`` 16 KiB) and
#: the register cap per thread (``maxnreg``; ``None``: the compiler's choice). One key and two value
#: slots (64 KiB) at 160 or 168 registers let three programs share an SM instead of two (3 × 128 ×
#: 168 = 64 512 of 65 536); the walks' loops do not spill at the shipped caps, except one reloaded
#: loop invariant a trip with a window and merges (the merges between walks spill a few bytes,
#: outside the loops; offline sm_90 compile, ``benchmarks/profiling/attention_resources_sm90.py``).
#: H200 (the probe, three programs against two uncapped slots each): 0.69 -> 0.83 of SDPA at
#: 32 x 512, 0.69 -> 0.77 at 4 x 4096; two key slots and one value slot give 0.79 at 32 x 512.
#: Every entry gives the same bits (the order of operations does not depend on it; the
#: GPU test runs the shipped entries and two uncapped slots each); the probe tool
#: ``tools/benchmarking/attention_wg_gpu.py`` checks and times others. Launches without merges take
#: 168 (round-robin: 0.887 at 160 -> 0.910 of SDPA at 32 x 512); launches with merges take 160
#: (0.853 at 160 against 0.818 at 168, 4 x 4096).
CONFIGS: dict[bool, tuple[int, int, int | None]] = {False: (1, 2, 168), True: (1, 2, 160)}


@contextlib.contextmanager
def configured(k_slots: int, v_slots: int, max_registers: int | None, block_m: int | None = None) -> Iterator[None]:
    """Every launch inside the block with ``k_slots`` key and ``v_slots`` value ring slots, the
    register cap ``max_registers`` (``None``: the compiler's choice) and, if given, ``block_m``-row
    tiles; ``CONFIGS`` and ``BLOCK_M`` restored in ``finally``. For tests and the probe tool: every
    configuration gives the same bits."""
    global BLOCK_M
    saved = dict(CONFIGS), BLOCK_M
    CONFIGS.update({False: (k_slots, v_slots, max_registers), True: (k_slots, v_slots, max_registers)})
    if block_m is not None:
        BLOCK_M = block_m
    try:
        yield
    finally:
        CONFIGS.clear()
        CONFIGS.update(saved[0])
        BLOCK_M = saved[1]


@gluon.jit
def rlk_attn_wg_exp2(x):
    """``2^x`` as ``ex2.approx.ftz.f32`` (``kernels.rlk_attn_exp2`` on CUDA)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def rlk_attn_wg_rowsum(x, BM: gl.constexpr, N: gl.constexpr, LOG2N: gl.constexpr, layout: gl.constexpr):
    """The fixed pairwise fold of ``kernels.rlk_attn_rowsum``: columns ``j`` and ``j + N/2`` added,
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
    """``kernels.rlk_attn_merge``."""
    Mn = gl.maximum(M, m)
    Ms = gl.where(Mn == float("-inf"), 0.0, Mn)
    ea = rlk_attn_wg_exp2(M - Ms)
    ec = rlk_attn_wg_exp2(m - Ms)
    Ln = gl.fma(l, ec, L * ea)
    An = gl.fma(a, gl.expand_dims(ec, 1), A * gl.expand_dims(ea, 1))
    return Mn, Ln, An


@gluon.jit
def rlk_attn_wg_state0(N: gl.constexpr, R: gl.constexpr, C: gl.constexpr, vec_layout: gl.constexpr,
                       acc_layout: gl.constexpr):
    """The online softmax's initial state ``(m, l, acc) = (-inf, 0, +0)``: ``N`` query rows (layout
    ``vec_layout``) and an ``[R, C]`` fp32 accumulator (``acc_layout``; ``[rows, DV]`` or, in the
    transposed kernel, ``[DV, rows]``). Merging a split into it is an exact identity
    (``kernels.rlk_attn_merge``)."""
    return (gl.full([N], float("-inf"), gl.float32, vec_layout), gl.zeros([N], gl.float32, vec_layout),
            gl.zeros([R, C], gl.float32, acc_layout))


@gluon.jit
def rlk_attn_wg_softmax(s, m, l, b, f0, f1, pos, wlo, kpos0, qk_scale, BM: gl.constexpr, BN: gl.constexpr,
                        row_s: gl.constexpr):
    """Block ``b``'s online-softmax step on its scores ``s`` (``kernels.rlk_attn_step``, without the
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
def rlk_attn_wg_rows_io(u0, u1, tok0, kvh, zero, G: gl.constexpr, HQ, HEAD_D: gl.constexpr, BM: gl.constexpr,
                        row_io: gl.constexpr):
    """The tile's rows ``(token, g)`` in the load/store layout: ``(valid, token, head, q offset)``.
    Formed once for the ``Q`` load and again for the stores, ``zero`` (a runtime 0) keeping the
    compiler from reusing the first (it would hold them across the whole walk)."""
    rel_io = (u0 - tok0 * G).to(gl.int32) + gl.arange(0, BM, layout=row_io) + zero
    valid_io = gl.arange(0, BM, layout=row_io).to(gl.int64) < u1 - u0
    tq_io = rel_io // G
    head_io = kvh * G + (rel_io - tq_io * G)
    tok_io = tok0 + tq_io
    q_off = (tok_io * HQ + head_io) * HEAD_D
    return valid_io, tok_io, head_io, q_off


@gluon.jit
def rlk_attn_wg_q_tile(q_ptr, u0, u1, tok0, kvh, G: gl.constexpr, HQ, HEAD_D: gl.constexpr, BM: gl.constexpr,
                       io_layout: gl.constexpr, q_smem_layout: gl.constexpr):
    """The tile's ``Q`` rows (``BM`` rows ``(token, g)`` from unit ``u0``, zeros past ``u1``) loaded
    through ``io_layout`` into shared memory (``q_smem_layout``, the products' operand), visible to
    the tensor cores; returns it and the head-dim offsets in ``io_layout``'s column slice."""
    valid_io, tok_io, head_io, q_off = rlk_attn_wg_rows_io(u0, u1, tok0, kvh, 0, G, HQ, HEAD_D, BM,
                                                           gl.SliceLayout(1, io_layout))
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, io_layout))
    q = gl.load(q_ptr + gl.expand_dims(q_off, 1) + gl.expand_dims(offs_d, 0), mask=gl.expand_dims(valid_io, 1),
                other=0.0)
    q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BM, HEAD_D], q_smem_layout, q)
    fence_async_shared()
    return q_smem, offs_d


@gluon.jit
def rlk_attn_wg_ring(k_desc, v_desc, K_ST: gl.constexpr, V_ST: gl.constexpr, BN: gl.constexpr, KD: gl.constexpr,
                     VD: gl.constexpr, BLOCKS: gl.constexpr = 1):
    """A program's TMA ring: ``K_ST`` key and ``V_ST`` value slots of ``BLOCKS`` ``BN``-row blocks
    each (``KD`` key and ``VD`` value columns, in the layouts of the copies ``k_desc``, ``v_desc``)
    and one barrier a slot, initialised and visible to the copies. Returns ``(k_smem, v_smem,
    k_bars, v_bars)``; the slots index blocks (slot ``s``'s at ``BLOCKS·s ..``)."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [K_ST * BLOCKS, BN, KD], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [V_ST * BLOCKS, BN, VD], v_desc.layout)
    k_bars = gl.allocate_shared_memory(gl.int64, [K_ST, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [V_ST, 1], mbarrier.MBarrierLayout())
    if K_ST == V_ST:  # slot by slot (the decode kernels' order; the barriers the compiler inserts follow it)
        for i in gl.static_range(K_ST):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
    else:
        for i in gl.static_range(K_ST):
            mbarrier.init(k_bars.index(i), count=1)
        for i in gl.static_range(V_ST):
            mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()
    return k_smem, v_smem, k_bars, v_bars


@gluon.jit
def rlk_attn_wg_ring_end(k_bars, v_bars, K_ST: gl.constexpr, V_ST: gl.constexpr):
    """The ring's barriers invalidated once its last copies have been waited on."""
    if K_ST == V_ST:
        for i in gl.static_range(K_ST):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))
    else:
        for i in gl.static_range(K_ST):
            mbarrier.invalidate(k_bars.index(i))
        for i in gl.static_range(V_ST):
            mbarrier.invalidate(v_bars.index(i))


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
    in flight across the back edge made ``ptxas`` serialise every ``wgmma``, warning C7514). The
    split's merge runs between walks, with nothing in flight: inside the pipelined order the
    accumulator, the scratch tile and the next block's scores were live at once (254 registers)."""
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
def rlk_attn_wg_gdc_wait(PDL: gl.constexpr):
    """``kernels.rlk_attn_gdc_wait`` in Gluon: ``griddepcontrol.wait`` before the first load of
    data the step's preceding kernel writes (compiled in only for ``PDL``)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def rlk_attn_fwd_wg(q_ptr, k_desc, v_desc, out_ptr, out32_ptr, lse_ptr, scr_ptr, tab_ptr, pr_ptr, pr_stride,
                    G: gl.constexpr, W, qk_scale, HQ, HKV, HEAD_D: gl.constexpr, HAS_WINDOW: gl.constexpr,
                    STORE_F32: gl.constexpr, STORE_LSE: gl.constexpr, MULTI: gl.constexpr, SB: gl.constexpr,
                    K_ST: gl.constexpr, V_ST: gl.constexpr, BLOCK_ROWS: gl.constexpr, PDL: gl.constexpr):
    """Grid (tiles, kv heads): tile ``t``'s rows ``(token, g)`` of one sequence (the tile table of
    ``kernels.varlen_tiles``; program ``i`` takes tile ``tiles - 1 - i``), over the key blocks
    ``first .. last`` of the tile in increasing order, split by split (``SB`` blocks each), as
    ``kernels.rlk_attn_fwd`` does. The first key and value copies are issued before the tile's
    ``Q`` rows are loaded; ``first``, ``last`` and the unmasked run ``f0 .. f1`` come from the
    table's scalars (the tile's first and last valid rows), not from reductions over the rows.
    ``PDL``: launched under programmatic dependent launch, it waits on the device for the tile
    table's kernel (``kernels.rlk_attn_varlen_tiles``) before reading the table."""
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
            # kernels.rlk_attn_fwd's order: each KV split walked on its own and merged into
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
            # exact identity, kernels.rlk_attn_fwd)
            m, l, A = rlk_attn_wg_walk(q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, kbase, col, first, nb,
                                       0, nb - 1, f0, f1, pos, wlo, kpos0, qk_scale, BM, BN, HEAD_D, K_ST, V_ST,
                                       s_layout, o_layout, p_layout, row_s, row_o)
            M = gl.convert_layout(m, row_o)
            L = gl.convert_layout(l, row_o)
        rlk_attn_wg_ring_end(k_bars, v_bars, K_ST, V_ST)

        # kernels.rlk_attn_finish (stored through a blocked layout: storing from the accumulator's
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
def rlk_attn_wgd_gdc_launch(PDL: gl.constexpr):
    """``kernels.rlk_attn_gdc_launch`` in Gluon: ``griddepcontrol.launch_dependents`` (the combine
    may launch; it waits on the device for this kernel's end)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def rlk_attn_wgd_entries(pr_row, b, PPB: gl.constexpr):
    """The page-table entries (int32 storage rows of each page's first key) of block ``b``'s
    ``PPB`` pages: a tuple of four scalars (the unused ones 0)."""
    base = pr_row + b * PPB
    e0 = gl.load(base).to(gl.int32)
    e1 = e0 * 0
    e2 = e0 * 0
    e3 = e0 * 0
    if PPB >= 2:
        e1 = gl.load(base + 1).to(gl.int32)
    if PPB >= 4:
        e2 = gl.load(base + 2).to(gl.int32)
        e3 = gl.load(base + 3).to(gl.int32)
    return (e0, e1, e2, e3)


@gluon.jit
def rlk_attn_wgd_copy(desc, smem, bars, e, col, j, nb, ST: gl.constexpr, PS: gl.constexpr, PPB: gl.constexpr):
    """Issue the TMA copies of block ``j``'s ``PPB`` pages (``PS`` rows each, storage rows ``e``)
    into the ``PS``-row slices of its ring slot ``j % ST``, one barrier for the block; if
    ``j < nb``."""
    pred = j < nb
    slot = j % ST
    bar = bars.index(slot)
    buf = smem.index(slot)
    mbarrier.expect(bar, desc.block_type.nbytes * PPB, pred=pred)
    for i in gl.static_range(PPB):
        tma.async_copy_global_to_shared(desc, [e[i], col], bar, buf.slice(i * PS, PS), pred=pred)


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
def rlk_attn_wgd_gather(k_buf, v_buf, k_ptr, v_ptr, pr_row, kbase, b, cap, kvh, v0, sk_row, sk_head, sv_row, sv_head,
                        BN: gl.constexpr, HEAD_D: gl.constexpr, DV: gl.constexpr, PS: gl.constexpr, PAGED: gl.constexpr,
                        ld_layout: gl.constexpr):
    """Block ``b``'s key rows and value columns ``v0 .. v0 + DV - 1`` by pointer loads, positions
    clamped to ``cap`` (``kernels.rlk_attn_load``: every row read is a written one), through the
    page table (``PAGED``) or from ``kbase``, into ``k_buf`` and ``v_buf``, visible to the tensor
    cores once every warp has written."""
    kp = gl.minimum(b * 64 + gl.arange(0, BN, layout=gl.SliceLayout(1, ld_layout)), cap)
    if PAGED:
        rows = gl.load(pr_row + kp // PS).to(gl.int64) + (kp % PS).to(gl.int64)
    else:
        rows = kbase + kp.to(gl.int64)
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ld_layout))
    offs_v = v0 + gl.arange(0, DV, layout=gl.SliceLayout(0, ld_layout))
    kt = gl.load(k_ptr + gl.expand_dims(rows * sk_row + kvh * sk_head, 1) + gl.expand_dims(offs_d, 0))
    vt = gl.load(v_ptr + gl.expand_dims(rows * sv_row + kvh * sv_head, 1) + gl.expand_dims(offs_v, 0))
    k_buf.store(kt)
    v_buf.store(vt)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def rlk_attn_wgd_masked(q_smem, k_buf, v_buf, k_ptr, v_ptr, pr_row, b, cap, kvh, v0, sk_row, sk_head, sv_row, sv_head,
                        m, l, acc, pos, kpos0, qk_scale, BM: gl.constexpr, BN: gl.constexpr, HEAD_D: gl.constexpr,
                        DV: gl.constexpr, PS: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
                        row_s: gl.constexpr, row_o: gl.constexpr, ld_layout: gl.constexpr):
    """Block ``b`` past the unmasked run (some row does not see all of it): its rows by pointer
    loads, positions clamped to ``cap`` (``kernels.rlk_attn_load``: every row read is a written
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
def rlk_attn_wgd_program(tab_ptr, G: gl.constexpr, VS: gl.constexpr, ONE: gl.constexpr, ORDER: gl.constexpr):
    """A decode split kernel's program: ``(t64, kvh, j, vs, seq, u0, u1, pbase, tok0, p_lo, cap,
    last)`` — its tile, kv head, KV split and value slice from the grid axes in the order
    ``ORDER`` (``kernels.rlk_attn_split_ids``), the tile's table row (``kernels.rlk_attn_table_row``;
    ``ONE``: formed from ``q_pos``), its first token, the least and greatest
    positions of its valid rows (positions do not decrease along the rows: the first valid row
    holds the least, the last the greatest, ``kernels.rlk_attn_rows``' minimum and maximum without
    reductions) and its last key block (-1 for an empty tile)."""
    t, kvh, js = _kernels.rlk_attn_split_ids(ORDER)
    t64 = t.to(gl.int64)
    seq, u0, u1, pbase = _kernels.rlk_attn_table_row(tab_ptr, t64, G, ONE)
    tok0 = u0 // G
    p_lo = (tok0 - pbase).to(gl.int32)
    cap = ((u1 - 1) // G - pbase).to(gl.int32)
    last = gl.where(u1 > u0, cap // 64, -1)
    return t64, kvh, js // VS, js % VS, seq, u0, u1, pbase, tok0, p_lo, cap, last


@gluon.jit
def rlk_attn_wgd_blocks(j, last, p_lo, SB: gl.constexpr):
    """KV split ``j``'s blocks ``b0 .. b1`` (``SB`` a split, the tile's last block ``last``) and the
    length ``nu`` of its unmasked run: the blocks from ``b0`` that every valid row sees entirely
    (through ``(p_lo + 1) // 64 - 1``, ``p_lo`` the least position of the tile's valid rows)."""
    b0 = j * SB
    b1 = gl.minimum(last, b0 + SB - 1)
    f1 = (p_lo + 1) // 64 - 1
    return b0, b1, gl.maximum(gl.minimum(b1, f1) - b0 + 1, 0)


@gluon.jit
def rlk_attn_wgd_store(acc, m, l, valid_s, r_s, r_o, c_o, out_ptr, ws_m_ptr, ws_l_ptr, ws_a_ptr, t64, kvh, j, vs, u0,
                       u1, tok0, NS, HQ, HKV, G: gl.constexpr, HEAD_D: gl.constexpr, WS_M: gl.constexpr,
                       FINISH: gl.constexpr, RA: gl.constexpr, r_layout: gl.constexpr):
    """A decode split program's end: the tile's valid rows of ``acc`` (query rows along axis ``RA``,
    index vector ``r_o``; value columns ``c_o``). ``FINISH`` (a step of one KV split): the output
    rows of this value slice, ``out = acc · (1 / l)`` in the output dtype (``kernels.rlk_attn_finish``;
    merging the one split into the initial state is an exact identity); else the split's
    ``(m, l, acc)`` into the workspace slots that ``rlk_attn_combine`` folds (``m``, ``l`` at rows
    ``r_s``, stored by the first value slice only, which every slice computes alike)."""
    valid_o = r_o.to(gl.int64) < u1 - u0
    if FINISH:
        r = gl.div_rn(gl.full(r_o.shape, 1.0, gl.float32, r_layout), gl.convert_layout(l, r_layout))
        o = (acc * gl.expand_dims(r, 1 - RA)).to(out_ptr.dtype.element_ty)
        rel_o = (u0 - tok0 * G).to(gl.int32) + r_o
        tq_o = rel_o // G
        q_off_o = ((tok0 + tq_o) * HQ + kvh * G + (rel_o - tq_o * G)) * HEAD_D
        gl.store(out_ptr + gl.expand_dims(q_off_o, 1 - RA) + gl.expand_dims(c_o, RA), o,
                 mask=gl.expand_dims(valid_o, 1 - RA))
    else:
        slot0 = ((t64 * HKV + kvh) * NS + j) * WS_M
        state = valid_s & (r_s * 0 + vs == 0)  # one slice stores the state
        gl.store(ws_m_ptr + slot0 + r_s, m, mask=state)
        gl.store(ws_l_ptr + slot0 + r_s, l, mask=state)
        gl.store(ws_a_ptr + (slot0 + gl.expand_dims(r_o, 1 - RA)) * HEAD_D + gl.expand_dims(c_o, RA), acc,
                 mask=gl.expand_dims(valid_o, 1 - RA))


@gluon.jit
def rlk_attn_split_wg(q_ptr, k_desc, v_desc, k_ptr, v_ptr, out_ptr, ws_m_ptr, ws_l_ptr, ws_a_ptr, tab_ptr, pr_ptr,
                      pr_stride, qk_scale, sk_row, sk_head, sv_row, sv_head, NS, HQ, HKV, PS: gl.constexpr,
                      G: gl.constexpr, HEAD_D: gl.constexpr, DV: gl.constexpr, WS_M: gl.constexpr, ONE: gl.constexpr,
                      ST: gl.constexpr, PDL: gl.constexpr, SB: gl.constexpr, ORDER: gl.constexpr,
                      FINISH: gl.constexpr):
    """``kernels.rlk_attn_fwd_split`` over a paged cache of ``PS``-key pages (``PS`` divides 64, at
    most four pages a block), no window, as a Hopper warpgroup kernel: grid (tiles, kv heads,
    splits · ``HEAD_D / DV``) in the axis order ``ORDER`` (``kernels.split_grid_order``); program
    ``(t, h, j·VS + vs)`` walks split ``j`` of decode tile ``t`` (at most ``WS_M`` rows, in a 64-row
    ``wgmma`` tile) for value columns ``vs·DV ..`` (value slices, ``AttnConfig.v_slices``) and
    stores its ``(m, l, acc)`` where ``rlk_attn_combine`` reads them (``WS_M``-row workspace
    slots; the ``vs = 0`` program stores ``m``, ``l``, which every slice computes alike).
    ``FINISH`` (a step of one KV split, ``NS = 1``): the program finishes its rows instead, ``out =
    acc · (1 / l)`` in the output dtype (``kernels.rlk_attn_finish``; merging the one split into
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


@functools.lru_cache(maxsize=None)
def _wgt_exchange_layouts(nq: int):
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
    every warp's probabilities at its own position and folds them by ``kernels.rlk_attn_rowsum``'s
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
    """Four-block step ``qi`` of the unmasked run (``kernels.rlk_attn_quad``'s values with the
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
    bits). ``X_LAYOUT``, ``F_LAYOUT``: the exchange read-back layouts of ``_wgt_exchange_layouts(NQ)``."""
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


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int, dtype: torch.dtype):
    """``NVMMASharedLayout.get_default_for([rows, cols], ·)`` of a 16-bit ``dtype``, built once per
    shape (host time on every launch otherwise; the same constexpr value either way)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def descriptors(k: torch.Tensor, v: torch.Tensor):
    """TMA descriptors of the ``[T, Hkv·D]`` views of keys and values: ``[64, D]`` boxes."""
    n, hkv, d = k.shape
    layout = _smem_layout(BLOCK_N, d, k.dtype)
    return (TensorDescriptor(k, [n, hkv * d], [k.stride(0), 1], [BLOCK_N, d], layout),
            TensorDescriptor(v, [n, hkv * d], [v.stride(0), 1], [BLOCK_N, d], layout))


def launch(q, k, v, out, out32, lse, scr, tab, page_rows, G, window, qk_scale, *, store_f32, store_lse, multi,
           split_blocks, pdl: bool = False):
    """Launch ``rlk_attn_fwd_wg`` over tile table ``tab`` (``BLOCK_M``-row tiles) with
    ``CONFIGS[multi]`` (ring depths, register cap) as they are at the call. ``page_rows``: the
    storage row of each sequence's position 0 (int32 or int64, ``[B, 1]`` with any row stride:
    ``cu_seqlens[:-1]`` as it is). ``pdl``: programmatic dependent launch (``kernels.use_pdl``)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    k_desc, v_desc = descriptors(k, v)
    nt = tab.shape[0]
    dummy = out
    k_st, v_st, regs = CONFIGS[bool(multi)]
    cap = {} if regs is None else {"maxnreg": int(regs)}
    rlk_attn_fwd_wg[(nt, Hkv)](
        q, k_desc, v_desc, out, out32 if out32 is not None else dummy, lse if lse is not None else dummy, scr, tab,
        page_rows, page_rows.stride(0), G, 0 if window is None else int(window), qk_scale, Hq, Hkv, HEAD_D=D,
        HAS_WINDOW=window is not None, STORE_F32=store_f32, STORE_LSE=store_lse, MULTI=multi, SB=split_blocks,
        K_ST=k_st, V_ST=v_st, BLOCK_ROWS=BLOCK_M, PDL=bool(pdl), num_warps=BLOCK_M // 16, enable_fp_fusion=False,
        launch_pdl=bool(pdl), **cap,
    )


#: TMA ring slots of the paged decode split kernel (``rlk_attn_split_wg``): key and value blocks,
#: 16 KiB each at ``D = 128``, 16-bit. H200 (16-token pages, batch 1-64 at 4096
#: and 32768 keys): 2 slots fastest at every size (batch 1 x 32768 keys 43.1 µs against 45.3 / 50.1
#: / 52.3 with 3 / 4 / 6; batch 4 x 4096 23.8 against 25.0 / 25.0 / 37.3); every depth gives the
#: same bits (GPU test).
SPLIT_SLOTS = 2


@contextlib.contextmanager
def split_configured(slots: int) -> Iterator[None]:
    """Every ``rlk_attn_split_wg`` launch inside the block with ``slots`` ring slots;
    ``SPLIT_SLOTS`` restored in ``finally``. For tests and the probe tool: the same bits."""
    global SPLIT_SLOTS
    saved = SPLIT_SLOTS
    SPLIT_SLOTS = int(slots)
    try:
        yield
    finally:
        SPLIT_SLOTS = saved


def page_descriptors(k: torch.Tensor, v: torch.Tensor, page_size: int, dv: int):
    """TMA descriptors of the ``[rows, Hkv·D]`` views of paged keys and values: ``[page_size, D]``
    key and ``[page_size, dv]`` value boxes (one page of one head, a value slice), in the layouts
    of the kernel's 64-row ring slots."""
    n, hkv, d = k.shape
    return (TensorDescriptor(k, [n, hkv * d], [k.stride(0), 1], [page_size, d], _smem_layout(BLOCK_N, d, k.dtype)),
            TensorDescriptor(v, [n, hkv * d], [v.stride(0), 1], [page_size, dv], _smem_layout(BLOCK_N, dv, k.dtype)))


def launch_split(q, k, v, out, ws, tab, page_rows, page_size, G, qk_scale, splits, v_slices, *, tile_rows, one, order,
                 pdl):
    """Launch ``rlk_attn_split_wg`` with ``SPLIT_SLOTS`` ring slots over decode tiles ``tab``
    (``tile_rows`` rows each, the table's ``BLOCK_M``; ``one``: ``tab`` is ``q_pos`` of a
    one-token-per-sequence step) and the paged cache ``k``, ``v`` (``[rows, Hkv, D]``,
    ``page_size``-key pages listed in ``page_rows``), ``v_slices`` programs a split; grid axis
    order ``order`` (``kernels.split_grid_order``). ``ws``: the workspace ``(ws_m, ws_l, ws_a)``
    (``[tiles, Hkv, splits, tile_rows]``, ``[..., D]``) that ``kernels.rlk_attn_combine`` folds, or
    ``None`` for a step of one split (``splits == 1``), whose programs write ``out`` themselves."""
    from rl_engine.backends.triton.attention.kernels import SPLIT_BLOCKS

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
        WS_M=int(tile_rows), ONE=bool(one), ST=SPLIT_SLOTS, PDL=bool(pdl), SB=SPLIT_BLOCKS, ORDER=order,
        FINISH=finish, num_warps=4, enable_fp_fusion=False, launch_pdl=bool(pdl),
    )


#: TMA ring slots of the transposed decode split kernel (``rlk_attn_split_wgt``): key and value
#: blocks (16 KiB each at ``D = 128``, 16-bit; 8 KiB for 64 value columns); with four blocks a step,
#: slots of four blocks (``SPLIT_T_QUAD_SLOTS``; 2: 211 KiB at 64 value columns).
SPLIT_T_SLOTS = 2
SPLIT_T_QUAD_SLOTS = 2


@contextlib.contextmanager
def split_t_configured(slots: int, quad_slots: int | None = None) -> Iterator[None]:
    """Every ``rlk_attn_split_wgt`` launch inside the block with ``slots`` ring slots (and
    ``quad_slots`` four-block slots, if given); restored in ``finally``. For tests and the probe
    tool: the same bits."""
    global SPLIT_T_SLOTS, SPLIT_T_QUAD_SLOTS
    saved = SPLIT_T_SLOTS, SPLIT_T_QUAD_SLOTS
    SPLIT_T_SLOTS = int(slots)
    if quad_slots is not None:
        SPLIT_T_QUAD_SLOTS = int(quad_slots)
    try:
        yield
    finally:
        SPLIT_T_SLOTS, SPLIT_T_QUAD_SLOTS = saved


def launch_split_t(q, k, v, out, ws, tab, page_rows, page_size, G, qk_scale, splits, v_slices, *, paged, tile_rows, one,
                   order, pdl, quad=False):
    """Launch ``rlk_attn_split_wgt`` with ``SPLIT_T_SLOTS`` ring slots (of four blocks each with
    ``quad``: the unmasked run four blocks a step): ``launch_split``'s arguments over a paged
    (``paged``: ``page_size``-key pages listed in ``page_rows``) or contiguous cache
    (``page_rows[:, 0]``: each sequence's first storage row; 64-row block copies)."""
    from rl_engine.backends.triton.attention.kernels import SPLIT_BLOCKS, wgt_tile_rows

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
    x_layout, f_layout = _wgt_exchange_layouts(nq)
    sp = splits * v_slices
    grid = ((nt, Hkv, sp), (Hkv, nt, sp), (sp, nt, Hkv))[order]
    rlk_attn_split_wgt[grid](
        q, k_desc, v_desc, k, v, out, ws_m, ws_l, ws_a, tab, page_rows, page_rows.stride(0), qk_scale, k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), splits, Hq, Hkv, PS=ps, PAGED=bool(paged), G=G, HEAD_D=D,
        DV=D // v_slices, NQ=nq, WS_M=int(tile_rows), ONE=bool(one), ST=SPLIT_T_QUAD_SLOTS if quad else SPLIT_T_SLOTS,
        PDL=bool(pdl), SB=SPLIT_BLOCKS,
        ORDER=order, FINISH=finish, X_LAYOUT=x_layout, F_LAYOUT=f_layout, QUAD=bool(quad), num_warps=4,
        enable_fp_fusion=False,
        launch_pdl=bool(pdl),
    )


__all__ = ["BLOCK_M", "CONFIGS", "DEVICE_FUNCTIONS", "KERNEL_NAMES", "SPLIT_SLOTS", "SPLIT_T_SLOTS", "configured",
           "descriptors", "launch", "launch_split", "launch_split_t", "page_descriptors", "rlk_attn_fwd_wg",
           "rlk_attn_split_wg", "rlk_attn_split_wgt", "split_configured", "split_t_configured"]
