"""The query-tile table kernels, one launch each and no host sync (the definition they build is
``launch.tile_table``, which the tests compare them with):

* ``rlk_attn_tiles``        the rollout path's table from ``q_seq`` / ``q_pos`` in one
  single-program launch (``launch.rollout_tiles``);
* ``rlk_attn_varlen_tiles`` the train path's table from ``cu_seqlens`` (``launch.varlen_tiles``).

On sm90+ the attention kernel that reads a table is launched with programmatic dependent launch:
these kernels let it launch at their own start (``rlk_attn_gdc_launch``) and it waits on the
device before reading the table.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rl_engine.backends.triton.attention.device import rlk_attn_gdc_launch

__all__ = ["KERNEL_NAMES", "DEVICE_FUNCTIONS", "rlk_attn_tiles", "rlk_attn_varlen_tiles"]

KERNEL_NAMES = ("rlk_attn_tiles", "rlk_attn_varlen_tiles")
#: ``@triton.jit`` device functions in this module's namespace (its own and the shared ones it
#: calls from ``device``), never launched on their own.
DEVICE_FUNCTIONS = ("rlk_attn_gdc_launch",)


@triton.jit
def rlk_attn_tiles(q_seq_ptr, q_pos_ptr, tab_ptr, T, B, NT, ROUNDS, STEP0, G, ROWS: tl.constexpr,
                   CHUNK: tl.constexpr, RADIX: tl.constexpr, JB: tl.constexpr, PDL: tl.constexpr):
    """The tile table of ``launch.tile_table(*cached_rows(q_seq, q_pos, B), G, ROWS, T)`` (same
    integers) in one single-program launch instead of ~30 small torch kernels.

    ``q_seq`` is non-decreasing (the rollout layout: a sequence's rows contiguous, in batch
    order), so sequence ``i`` owns rows ``lower_bound(q_seq, i) .. lower_bound(q_seq, i+1) - 1``.
    Each lower bound is a ``RADIX``-ary search (``ROUNDS`` rounds of ``RADIX`` independent loads,
    step ``STEP0 = RADIX^(ROUNDS-1)`` down to 1, ``RADIX^ROUNDS > T``): after a round, ``c`` counts
    the rows known to hold a smaller sequence id, and the next round probes ``c + step·(r+1) - 1``.
    With the tile counts' running sum, every sequence then writes its own tile rows
    (``JB`` at a time), and the rows past the last tile are written as ``tile_table`` writes them
    (the last sequence, ``unit0 == unit1``). No search per tile row (a binary search per tile
    row takes 5.0 / 21.7 µs for a decode step of 64 sequences / 32 × 512 prefill rows on the
    H200, this 3.8 / 11.3 µs)."""
    rlk_attn_gdc_launch(PDL)  # the attention kernel may launch (it waits for this kernel's end)
    offs = tl.arange(0, CHUNK)
    rad = tl.arange(0, RADIX).to(tl.int64)
    carry = tl.zeros([], tl.int64)
    last_start = tl.zeros([], tl.int64)
    last_beg = tl.zeros([], tl.int64)
    last_pbase = tl.zeros([], tl.int64)
    for c0 in range(0, B, CHUNK):
        i = c0 + offs.to(tl.int64)
        live = i < B
        ca = tl.zeros([CHUNK], tl.int64)  # rows with q_seq < i
        cb = tl.zeros([CHUNK], tl.int64)  # rows with q_seq < i + 1
        step = STEP0
        for _ in range(0, ROUNDS):
            pa = ca[:, None] + step * (rad[None, :] + 1) - 1
            pb = cb[:, None] + step * (rad[None, :] + 1) - 1
            va = tl.load(q_seq_ptr + tl.minimum(pa, T - 1), mask=live[:, None] & (pa < T), other=0)
            vb = tl.load(q_seq_ptr + tl.minimum(pb, T - 1), mask=live[:, None] & (pb < T), other=0)
            ca += step * tl.sum(((pa < T) & (va < i[:, None])).to(tl.int64), axis=1)
            cb += step * tl.sum(((pb < T) & (vb < i[:, None] + 1)).to(tl.int64), axis=1)
            step = step // RADIX
        start = ca
        count = tl.where(live, cb - ca, 0)
        p0 = tl.load(q_pos_ptr + tl.minimum(start, T - 1), mask=live, other=0)
        pbase = start - p0
        ntiles = (count * G + ROWS - 1) // ROWS
        beg = tl.cumsum(ntiles, 0) + carry - ntiles
        carry = carry + tl.sum(ntiles, 0)
        is_last = i == B - 1
        last_start += tl.sum(tl.where(is_last, start, 0), 0)
        last_beg += tl.sum(tl.where(is_last, beg, 0), 0)
        last_pbase += tl.sum(tl.where(is_last, pbase, 0), 0)
        for j0 in range(0, tl.max(ntiles, 0), JB):
            j = j0 + tl.arange(0, JB).to(tl.int64)
            w = live[:, None] & (j[None, :] < ntiles[:, None])
            t = beg[:, None] + j[None, :]
            u0 = start[:, None] * G + j[None, :] * ROWS
            u1 = tl.minimum(u0 + ROWS, (start + count)[:, None] * G)
            tl.store(tab_ptr + t * 4, i[:, None] + 0 * j[None, :], mask=w)
            tl.store(tab_ptr + t * 4 + 1, u0, mask=w)
            tl.store(tab_ptr + t * 4 + 2, u1, mask=w)
            tl.store(tab_ptr + t * 4 + 3, pbase[:, None] + 0 * j[None, :], mask=w)
    # rows past the last tile: tile_table's clamp gives them the last sequence, unit0 == unit1
    for t0 in range(carry, NT, CHUNK):
        t = t0 + offs.to(tl.int64)
        w = t < NT
        u0 = last_start * G + (t - last_beg) * ROWS
        tl.store(tab_ptr + t * 4, B - 1 + 0 * t, mask=w)
        tl.store(tab_ptr + t * 4 + 1, u0, mask=w)
        tl.store(tab_ptr + t * 4 + 2, u0, mask=w)
        tl.store(tab_ptr + t * 4 + 3, last_pbase + 0 * t, mask=w)


@triton.jit
def rlk_attn_varlen_tiles(cu_ptr, tab_ptr, B, NT, G, BLOCK_M: tl.constexpr, TBLOCK: tl.constexpr,
                          SBLOCK: tl.constexpr, PDL: tl.constexpr):
    """The tile table of ``launch.tile_table(*varlen_rows(cu_seqlens), G, BLOCK_M, T)`` (same integers)
    from ``cu_seqlens`` alone, ``TBLOCK`` table rows per program and no cross-program state.

    Each program walks all ``B`` sequences (``SBLOCK`` at a time: integer sums, exact): tile
    row ``t`` belongs to sequence ``seq = #{i : tile_end_i <= t}`` (clamped to ``B - 1``, as
    ``searchsorted(right=True)``), whose first tile row is the largest ``tile_end_i <= t`` —
    except for padding rows past the last tile, which take the last sequence like the torch
    table does. Sequence ``i`` has ``ceil((cu[i+1] - cu[i])·G / BLOCK_M)`` tiles."""
    rlk_attn_gdc_launch(PDL)  # the attention kernel may launch (it waits for this kernel's end)
    t = tl.program_id(0).to(tl.int64) * TBLOCK + tl.arange(0, TBLOCK).to(tl.int64)
    cnt = tl.zeros([TBLOCK], tl.int64)
    first = tl.zeros([TBLOCK], tl.int64)
    carry = tl.zeros([], tl.int64)
    offs = tl.arange(0, SBLOCK).to(tl.int64)
    for s0 in range(0, B, SBLOCK):
        i = s0 + offs
        live = i < B
        c0 = tl.load(cu_ptr + i, mask=live, other=0).to(tl.int64)
        c1 = tl.load(cu_ptr + i + 1, mask=live, other=0).to(tl.int64)
        ntiles = ((c1 - c0) * G + BLOCK_M - 1) // BLOCK_M
        end = tl.cumsum(ntiles, 0) + carry
        carry = carry + tl.sum(ntiles, 0)
        le = live[None, :] & (end[None, :] <= t[:, None])
        cnt += tl.sum(le.to(tl.int64), axis=1)
        first = tl.maximum(first, tl.max(tl.where(le, end[None, :], 0), axis=1))
    total = carry
    last_n = ((tl.load(cu_ptr + B).to(tl.int64) - tl.load(cu_ptr + B - 1).to(tl.int64)) * G + BLOCK_M - 1) // BLOCK_M
    seq = tl.minimum(cnt, B - 1)
    first = tl.where(t < total, first, total - last_n)
    c0 = tl.load(cu_ptr + seq).to(tl.int64)
    c1 = tl.load(cu_ptr + seq + 1).to(tl.int64)
    u0 = c0 * G + (t - first) * BLOCK_M
    u1 = tl.minimum(u0 + BLOCK_M, c1 * G)
    u1 = tl.where(t < total, u1, u0)
    live = t < NT
    tl.store(tab_ptr + t * 4, seq, mask=live)
    tl.store(tab_ptr + t * 4 + 1, u0, mask=live)
    tl.store(tab_ptr + t * 4 + 2, u1, mask=live)
    tl.store(tab_ptr + t * 4 + 3, c0, mask=live)
