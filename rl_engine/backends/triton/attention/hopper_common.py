"""Gluon device functions and host-side TMA layouts shared by the Hopper warpgroup kernels
(``hopper_warpgroup``: the train path's forward and the paged decode split kernel;
``hopper_transposed_decode``: the transposed decode split kernel).

The query tile's load into shared memory (``rlk_attn_wg_q_tile``), the TMA ring of key and value
slots (``rlk_attn_wg_ring`` / ``rlk_attn_wg_ring_end``), the initial softmax state, the
flush-to-zero ``ex2`` (``device.rlk_attn_exp2`` on CUDA) and the programmatic-dependent-launch
hooks; for the decode split kernels, a program's tile, kv head, KV split and value slice from the
grid (``rlk_attn_wgd_program``: ``device.rlk_attn_split_ids`` and ``device.rlk_attn_table_row``
inlined as they are), its split's blocks, the page copies of a block into one ring slot, the
clamped pointer gather of a masked block and the program's end (its rows finished or its split's
state stored for ``split_kv_combine.rlk_attn_combine``).

Import this module only to launch: it imports ``triton.experimental.gluon`` (Triton 3.6's Hopper
API), which ``import rl_engine`` never does.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rl_engine.backends.triton.attention import device

__all__ = ["BLOCK_N", "DEVICE_FUNCTIONS", "page_descriptors", "smem_layout", "rlk_attn_wg_exp2", "rlk_attn_wg_state0",
           "rlk_attn_wg_rows_io", "rlk_attn_wg_q_tile", "rlk_attn_wg_ring", "rlk_attn_wg_ring_end",
           "rlk_attn_wg_gdc_wait", "rlk_attn_wgd_gdc_launch", "rlk_attn_wgd_entries", "rlk_attn_wgd_copy",
           "rlk_attn_wgd_gather", "rlk_attn_wgd_program", "rlk_attn_wgd_blocks", "rlk_attn_wgd_store"]

#: ``@gluon.jit`` device functions (inlined into the kernels, never launched on their own).
DEVICE_FUNCTIONS = ("rlk_attn_wg_exp2", "rlk_attn_wg_state0", "rlk_attn_wg_rows_io", "rlk_attn_wg_q_tile",
                    "rlk_attn_wg_ring", "rlk_attn_wg_ring_end", "rlk_attn_wg_gdc_wait", "rlk_attn_wgd_gdc_launch",
                    "rlk_attn_wgd_entries", "rlk_attn_wgd_copy", "rlk_attn_wgd_gather", "rlk_attn_wgd_program",
                    "rlk_attn_wgd_blocks", "rlk_attn_wgd_store")

#: Key-block rows (``configs.KV_BLOCK``): the rows of a TMA key / value box and of a ring slot.
BLOCK_N = 64


@gluon.jit
def rlk_attn_wg_exp2(x):
    """``2^x`` as ``ex2.approx.ftz.f32`` (``device.rlk_attn_exp2`` on CUDA)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def rlk_attn_wg_state0(N: gl.constexpr, R: gl.constexpr, C: gl.constexpr, vec_layout: gl.constexpr,
                       acc_layout: gl.constexpr):
    """The online softmax's initial state ``(m, l, acc) = (-inf, 0, +0)``: ``N`` query rows (layout
    ``vec_layout``) and an ``[R, C]`` fp32 accumulator (``acc_layout``; ``[rows, DV]`` or, in the
    transposed kernel, ``[DV, rows]``). Merging a split into it is an exact identity
    (``device.rlk_attn_merge``)."""
    return (gl.full([N], float("-inf"), gl.float32, vec_layout), gl.zeros([N], gl.float32, vec_layout),
            gl.zeros([R, C], gl.float32, acc_layout))


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
def rlk_attn_wg_gdc_wait(PDL: gl.constexpr):
    """``device.rlk_attn_gdc_wait`` in Gluon: ``griddepcontrol.wait`` before the first load of
    data the step's preceding kernel writes (compiled in only for ``PDL``)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def rlk_attn_wgd_gdc_launch(PDL: gl.constexpr):
    """``device.rlk_attn_gdc_launch`` in Gluon: ``griddepcontrol.launch_dependents`` (the combine
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
def rlk_attn_wgd_gather(k_buf, v_buf, k_ptr, v_ptr, pr_row, kbase, b, cap, kvh, v0, sk_row, sk_head, sv_row, sv_head,
                        BN: gl.constexpr, HEAD_D: gl.constexpr, DV: gl.constexpr, PS: gl.constexpr, PAGED: gl.constexpr,
                        ld_layout: gl.constexpr):
    """Block ``b``'s key rows and value columns ``v0 .. v0 + DV - 1`` by pointer loads, positions
    clamped to ``cap`` (``device.rlk_attn_load``: every row read is a written one), through the
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
def rlk_attn_wgd_program(tab_ptr, G: gl.constexpr, VS: gl.constexpr, ONE: gl.constexpr, ORDER: gl.constexpr):
    """A decode split kernel's program: ``(t64, kvh, j, vs, seq, u0, u1, pbase, tok0, p_lo, cap,
    last)`` — its tile, kv head, KV split and value slice from the grid axes in the order
    ``ORDER`` (``device.rlk_attn_split_ids``), the tile's table row (``device.rlk_attn_table_row``;
    ``ONE``: formed from ``q_pos``), its first token, the least and greatest
    positions of its valid rows (positions do not decrease along the rows: the first valid row
    holds the least, the last the greatest, ``device.rlk_attn_rows``' minimum and maximum without
    reductions) and its last key block (-1 for an empty tile)."""
    t, kvh, js = device.rlk_attn_split_ids(ORDER)
    t64 = t.to(gl.int64)
    seq, u0, u1, pbase = device.rlk_attn_table_row(tab_ptr, t64, G, ONE)
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
    rows of this value slice, ``out = acc · (1 / l)`` in the output dtype (``device.rlk_attn_finish``;
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


@functools.lru_cache(maxsize=None)
def smem_layout(rows: int, cols: int, dtype: torch.dtype):
    """``NVMMASharedLayout.get_default_for([rows, cols], ·)`` of a 16-bit ``dtype``, built once per
    shape (host time on every launch otherwise; the same constexpr value either way)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def page_descriptors(k: torch.Tensor, v: torch.Tensor, page_size: int, dv: int):
    """TMA descriptors of the ``[rows, Hkv·D]`` views of paged keys and values: ``[page_size, D]``
    key and ``[page_size, dv]`` value boxes (one page of one head, a value slice), in the layouts
    of the kernel's 64-row ring slots."""
    n, hkv, d = k.shape
    return (TensorDescriptor(k, [n, hkv * d], [k.stride(0), 1], [page_size, d], smem_layout(BLOCK_N, d, k.dtype)),
            TensorDescriptor(v, [n, hkv * d], [v.stride(0), 1], [page_size, dv], smem_layout(BLOCK_N, dv, k.dtype)))
