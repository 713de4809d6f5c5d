"""Invariant CPU attention: one blocked online-softmax algorithm for every path.

The train path (:func:`varlen_attention_cpu`, packed sequences, autograd) and the rollout path
(:func:`cached_attention_cpu`, full or chunked prefill and decode against a contiguous or paged
KV cache) run the *same* per-row program (docs/design/attention.md). For a query row at
position ``p`` of its sequence (``W`` the window, ``W = ∞`` without one)::

    lo = max(0, p - W + 1) // KV_BLOCK,  hi = p // KV_BLOCK
    (M, L, ACC) = (m, l, acc) = (-inf, 0, 0)                # fp32
    for b in lo .. hi:                                      # KV blocks at absolute positions 64·b
        if b % SPLIT_BLOCKS == 0 and b > lo:                # a KV split (1024 keys) ends
            (M, L, ACC) = merge((M, L, ACC), (m, l, acc));  (m, l, acc) = (-inf, 0, 0)
        s   = (q · K_bᵀ) · scale,  -inf where key j is not visible (j > p or j < p - W + 1)
        m'  = max(m, max_j s_j) + 0;  α = exp(m - m');  P = exp(s - m')
        l   = l·α + fold_64(P)
        acc = acc·α + P · V_b
        m   = m'
    (M, L, ACC) = merge((M, L, ACC), (m, l, acc))
    out = round(ACC / L);  lse = M + log(L)

with ``merge((M, L, A), (m, l, a)) = (M', L·e^{M-M'} + l·e^{m-M'}, A·e^{M-M'} + a·e^{m-M'})``,
``M' = max(M, m)``, and :func:`fold_sum` a pairwise tree fixed by the reduced length.

Why the bits cannot depend on the path:

* ``q · K_bᵀ`` and ``P · V_b`` are exact-sum products (:func:`~rl_engine.backends.cpu.common.exact_bmm`:
  integer slices in float64 BLAS, one rounding) of **one fixed shape** per matrix
  (``[Q_TILE, D] @ [D, KV_BLOCK]`` and ``[Q_TILE, KV_BLOCK] @ [KV_BLOCK, D]``). Query rows are
  packed into tiles of ``Q_TILE`` rows (zero rows pad the last tile of a sequence), keys sit at
  column ``j mod 64`` of their absolute block. Every sum is exact, so a row's result depends only
  on that row and the block, whatever the batch, thread count or instruction set (guarded by
  :func:`blas_tile_check` and the invariance tests).
* Keys the row must not see are replaced by ``-inf`` scores (``exp`` → exactly ``+0``), so
  whatever sits in their slots (a future token in training, stale data in a reused cache slot,
  a padded block) contributes ``±0`` to ``P · V``: every partial sum has the magnitude it would
  have with the visible keys alone, only the sign of a zero can differ — and a zero is then
  added to the ``+0``-initialised accumulator, which makes it ``+0``. Inputs must be finite
  (checked under every NaN policy but ``"propagate"``), so ``0 · v`` is never NaN.
* Everything else is elementwise IEEE arithmetic (``+ - * /``, ``max``, ``where``) or
  ``exp``/``log`` (measured to give the same bits in the vector body and the scalar tail), and
  a row's state is updated only in the blocks of its own range (rows are selected by index;
  padding rows of a decode tile are never computed), so vectorising over rows, tiles, heads and
  sequences changes nothing.

Backward (flash style, train path only) recomputes ``P = exp(s - lse)`` with the same tiles,
so ``P`` and ``dS = P ⊙ (dO·Vᵀ - Σ dO⊙O)`` are the same bits in both passes: ``dq`` streams each
query tile over its KV blocks in increasing order; ``dk``/``dv`` stream each 64-key block of a
sequence over the query blocks (absolute positions) that see it, in increasing order, and fold
the GQA group with :func:`fold_sum`. No atomics: deterministic, and for every sequence
independent of the rest of the pack.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_varlen_attention
from rl_engine.backends.cpu.common import exact_bmm
from rl_engine.runtime.custom_ops import call_op
from rl_engine.runtime.registry import Implementation, register
from rl_engine.utils import portable

__all__ = [
    "KV_BLOCK",
    "Q_TILE",
    "SPLIT_BLOCKS",
    "KV_SPLIT",
    "fold_sum",
    "blas_tile_check",
    "attend_rows",
    "varlen_attention_cpu",
    "cached_attention_cpu",
]

#: Keys per block, at absolute positions 0, 64, 128, ... of every sequence.
KV_BLOCK = 64
#: Query rows per tile: every BLAS call sees exactly this many rows. Equal to ``KV_BLOCK``: the
#: backward's ``dk``/``dv`` pass multiplies 64-position query blocks with the same shape.
Q_TILE = KV_BLOCK
#: Blocks per KV split; splits start at absolute positions 0, 1024, 2048, ...
SPLIT_BLOCKS = 16
#: Keys per KV split.
KV_SPLIT = KV_BLOCK * SPLIT_BLOCKS
#: Bytes of one ``[tiles, heads, 64, 64]`` fp32 temporary: sets how many tiles are processed
#: together (tiles are independent, so this bounds memory without touching the bits).
_GROUP_BYTES = 1 << 19
_NO_PAGES = 1 << 62  # page size of the packed (varlen) layout: one page per sequence
_BIG = 1 << 62

_DTYPES = (torch.float32, torch.bfloat16)
_NEG_INF = float("-inf")


def fold_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` by a fixed pairwise fold whose shape depends only on ``x.shape[dim]``.

    With width ``w``: ``h`` = the largest power of two below ``w``; elements ``h .. w-1`` are
    added onto elements ``0 .. w-h-1`` (``w = 2h``: ``x[:h] + x[h:]``); repeat with ``w = h``
    until one element is left. Each step is one elementwise IEEE addition, so every output
    element depends only on its own slice along ``dim``, never on the other dimensions.
    """
    dim = dim % x.dim()
    w = x.shape[dim]
    if w == 0:
        return x.new_zeros(x.shape[:dim] + x.shape[dim + 1 :])
    while w > 1:
        h = 1 << ((w - 1).bit_length() - 1)
        lo = x.narrow(dim, 0, h)
        hi = x.narrow(dim, h, w - h)
        if w == 2 * h:
            x = lo + hi
        else:
            x = lo.clone()
            x.narrow(dim, 0, w - h).add_(hi)
        w = h
    return x.select(dim, 0)


def blas_tile_check(head_dims: tuple[int, ...] = (32, 64, 128), seed: int = 0) -> list[str]:
    """Problems with the fixed-tile assumption the backend rests on (empty: none found).

    For each head dim, fp32 :func:`~rl_engine.backends.cpu.common.exact_bmm` with the two fixed tile shapes must give the same
    bits for a tile (a) alone, (b) inside batches of other tiles of any count, and (c) with its
    rows moved to other positions of the tile among other rows.
    """
    g = torch.Generator().manual_seed(seed)
    problems = []
    for D in head_dims:
        for name, ash, bsh in (("q·kᵀ", (Q_TILE, D), (D, KV_BLOCK)), ("p·v", (Q_TILE, KV_BLOCK), (KV_BLOCK, D))):
            a = torch.randn((40, *ash), generator=g)
            b = torch.randn((40, *bsh), generator=g)
            ref = exact_bmm(a, b)
            for count in (1, 3, 17, 40):
                got = exact_bmm(a[:count], b[:count])
                if not torch.equal(got.view(torch.int32), ref[:count].view(torch.int32)):
                    problems.append(f"{name} D={D}: a tile's bits change with the batch count ({count})")
            perm = torch.randperm(Q_TILE, generator=g)
            got = exact_bmm(a[:, perm], b)
            if not torch.equal(got.view(torch.int32), ref[:, perm].view(torch.int32)):
                problems.append(f"{name} D={D}: a row's bits change with its position in the tile")
    return problems


def _window_lo(pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """First visible key position of a query at ``pos``."""
    if window is None:
        return torch.zeros_like(pos)
    return (pos - (window - 1)).clamp_(min=0)


def _floor64(x: torch.Tensor) -> torch.Tensor:
    return torch.div(x, KV_BLOCK, rounding_mode="floor")


def _row_index(page_rows: torch.Tensor, page_size: int, seq: torch.Tensor, pos: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """Storage rows of positions ``pos`` ``[A, n]`` of batch sequences ``seq`` ``[A]``, after
    clamping the positions to ``cap`` ``[A]`` (a position the sequence has)."""
    p = torch.minimum(pos, cap[:, None])
    if page_size >= _NO_PAGES:
        return page_rows[seq, 0][:, None] + p
    return page_rows[seq[:, None], torch.div(p, page_size, rounding_mode="floor")] + torch.remainder(p, page_size)


def _tiles_per_group(heads: int) -> int:
    return max(1, _GROUP_BYTES // (heads * Q_TILE * KV_BLOCK * 4))


def _merge(M, L, ACC, m, l, acc):
    Mn = torch.maximum(M, m)
    a = portable.exp(M - Mn)
    c = portable.exp(m - Mn)
    return Mn, L * a + l * c, ACC * a[..., None] + acc * c[..., None]


def _query_tiles(q_seq: torch.Tensor, num_seqs: int, G: int):
    """Pack the query rows ``(token, g)`` of each batch sequence into tiles of ``Q_TILE`` rows.

    Rows of one sequence are in token order, ``g`` fastest; a sequence's last tile is padded.
    Returns ``tok, g, valid`` (``[NT, Q_TILE]``) and ``tile_seq`` (``[NT]``).
    """
    T = q_seq.shape[0]
    order = torch.argsort(q_seq, stable=True)
    c = torch.bincount(q_seq, minlength=num_seqs) * G
    tiles = torch.div(c + (Q_TILE - 1), Q_TILE, rounding_mode="floor")
    unit_start = torch.cumsum(c, 0) - c
    tile_start = torch.cumsum(tiles, 0) - tiles
    NT = int(tiles.sum())
    u = torch.arange(T * G, dtype=torch.int64)
    tok = order[torch.div(u, G, rounding_mode="floor")]
    seq = q_seq[tok]
    local = u - unit_start[seq]
    tile = tile_start[seq] + torch.div(local, Q_TILE, rounding_mode="floor")
    slot = torch.remainder(local, Q_TILE)
    unit_tok = torch.zeros((NT, Q_TILE), dtype=torch.int64)
    unit_g = torch.zeros((NT, Q_TILE), dtype=torch.int64)
    valid = torch.zeros((NT, Q_TILE), dtype=torch.bool)
    unit_tok[tile, slot] = tok
    unit_g[tile, slot] = torch.remainder(u, G)
    valid[tile, slot] = True
    tile_seq = torch.repeat_interleave(torch.arange(num_seqs, dtype=torch.int64), tiles, output_size=NT)
    return unit_tok, unit_g, valid, tile_seq


class _Tiles:
    """One group of query tiles: row positions/ranges and the tiles' queries ``[n, Hkv, 64, D]``."""

    def __init__(self, q_pos, tok, g, valid, tseq, window):
        self.tok, self.g, self.valid, self.seq = tok, g, valid, tseq
        self.pos = torch.where(valid, q_pos[tok], -1)  # padding rows: position -1, never active
        self.wlo = _window_lo(self.pos, window)
        self.hi = _floor64(self.pos)
        self.lo = _floor64(self.wlo)
        self.first = torch.where(valid, self.lo, _BIG).amin(1)
        self.last = self.hi.amax(1)
        self.cap = self.pos.amax(1)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row data ``x`` ``[T, Hkv, G, ...]`` as ``[n, Hkv, Q_TILE, ...]`` (padding rows 0)."""
        r = x[self.tok, :, self.g]  # [n, 64, Hkv, ...]
        mask = self.valid.reshape(self.valid.shape + (1,) * (r.dim() - 2))
        r = torch.where(mask, r, 0.0)
        return r.transpose(1, 2).contiguous()

    def scatter(self, dst: torch.Tensor, x: torch.Tensor) -> None:
        """Write per-row results ``x`` ``[n, Hkv, Q_TILE, ...]`` into ``dst`` ``[T, Hkv, G, ...]``."""
        x = x.transpose(1, 2)
        dst[self.tok[self.valid], :, self.g[self.valid]] = x[self.valid]


def _kv_blocks(k_rows, v_rows, page_rows, page_size, seq, b: int, cap) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ``b`` (positions ``64b .. 64b+63``) of each tile's sequence, keys and values:
    ``[A·Hkv, 64, D]`` fp32 each."""
    A = seq.shape[0]
    kpos = (torch.arange(KV_BLOCK, dtype=torch.int64) + b * KV_BLOCK).expand(A, -1)
    idx = _row_index(page_rows, page_size, seq, kpos, cap)
    out = []
    for rows in (k_rows, v_rows):
        blk = rows[idx].transpose(1, 2).to(torch.float32).contiguous()  # [A, Hkv, 64, D]
        out.append(blk.view(-1, KV_BLOCK, blk.shape[-1]))
    return out[0], out[1]


def _scores(qt: torch.Tensor, kb: torch.Tensor, scale: float, vis: torch.Tensor) -> torch.Tensor:
    """``(q · kᵀ) · scale`` per tile ``[A, Hkv, 64, 64]``, ``-inf`` where ``vis`` ``[A, 64, 64]`` is False."""
    A, H = qt.shape[0], qt.shape[1]
    s = exact_bmm(qt.view(A * H, Q_TILE, -1), kb.transpose(1, 2)).view(A, H, Q_TILE, KV_BLOCK)
    return torch.where(vis[:, None], s * scale, _NEG_INF)


def _visible(pos: torch.Tensor, wlo: torch.Tensor, b: int) -> torch.Tensor:
    kpos = torch.arange(KV_BLOCK, dtype=torch.int64) + b * KV_BLOCK
    return (kpos <= pos[..., None]) & (kpos >= wlo[..., None])  # [A, 64 rows, 64 keys]


def attend_rows(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    page_rows: torch.Tensor,
    page_size: int,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward program (module docstring) for every query row; the core of all paths.

    Args:
        q: ``[T, Hq, D]`` queries (fp32 or bf16).
        k_rows, v_rows: ``[N, Hkv, D]`` key/value storage rows.
        page_rows, page_size: position ``pos`` of batch sequence ``i`` lives in storage row
            ``page_rows[i, pos // page_size] + pos % page_size`` (``page_size >= 2**62``: the
            packed layout, row ``page_rows[i, 0] + pos``). Every position up to the largest
            query position of the sequence must be stored.
        q_seq, q_pos: ``[T]`` int64, batch sequence and position of each query row.

    Returns:
        ``(out, lse)``: fp32 ``[T, Hq, D]`` and fp32 ``[T, Hq]`` (log-sum-exp of the scaled scores).
    """
    T, Hq, D = q.shape
    Hkv = k_rows.shape[1]
    G = Hq // Hkv
    out = torch.empty((T, Hkv, G, D), dtype=torch.float32)
    lse = torch.empty((T, Hkv, G), dtype=torch.float32)
    if T == 0:
        return out.view(T, Hq, D), lse.view(T, Hq)
    unit_tok, unit_g, valid, tile_seq = _query_tiles(q_seq, page_rows.shape[0], G)
    qf = q.reshape(T, Hkv, G, D).to(torch.float32)
    C = _tiles_per_group(Hkv)
    slots = torch.arange(Q_TILE, dtype=torch.int64)
    for t0 in range(0, unit_tok.shape[0], C):
        sl = slice(t0, t0 + C)
        tl = _Tiles(q_pos, unit_tok[sl], unit_g[sl], valid[sl], tile_seq[sl], window)
        n = tl.tok.shape[0]
        qt = tl.rows(qf)  # [n, Hkv, 64, D], the BLAS operand
        # per-row state, rows tile-major then slot: row r = tile·Q_TILE + slot
        pos_r, wlo_r, lo_r, hi_r = (x.reshape(-1) for x in (tl.pos, tl.wlo, tl.lo, tl.hi))
        M = torch.full((n * Q_TILE, Hkv), _NEG_INF)
        L = torch.zeros((n * Q_TILE, Hkv))
        ACC = torch.zeros((n * Q_TILE, Hkv, D))
        m, l, acc = M.clone(), L.clone(), ACC.clone()
        b_first, b_last = int(tl.first.min()), int(tl.last.max())
        for b in range(b_first, b_last + 1):
            ta = (tl.first <= b) & (tl.last >= b)
            at = torch.arange(n) if bool(ta.all()) else ta.nonzero().squeeze(1)
            A = at.shape[0]
            if A == 0:
                continue  # no tile of the group has this block in range (a sliding-window gap)
            rows_at = (at[:, None] * Q_TILE + slots).reshape(-1)  # [A·64]
            act = (lo_r[rows_at] <= b) & (hi_r[rows_at] >= b)
            dense = bool(act.all())
            sel = None if dense else act.nonzero().squeeze(1)  # active rows among the A·64
            rid = rows_at if dense else rows_at[sel]
            if b % SPLIT_BLOCKS == 0 and b > b_first:  # a KV split ends for rows that began earlier
                mid = rid[lo_r[rid] < b]
                if mid.numel():
                    M[mid], L[mid], ACC[mid] = _merge(M[mid], L[mid], ACC[mid], m[mid], l[mid], acc[mid])
                    m[mid], l[mid], acc[mid] = _NEG_INF, 0.0, 0.0
            kb, vb = _kv_blocks(k_rows, v_rows, page_rows, page_size, tl.seq[at], b, tl.cap[at])
            qa = qt if A == n else qt[at]
            sc = exact_bmm(qa.view(A * Hkv, Q_TILE, D), kb.transpose(1, 2)).view(A, Hkv, Q_TILE, KV_BLOCK)
            sc = sc.transpose(1, 2).reshape(A * Q_TILE, Hkv, KV_BLOCK)
            if not dense:
                sc = sc[sel]  # elementwise work only for the active rows (decode tiles are mostly padding)
            kpos = slots + b * KV_BLOCK
            vis = ((kpos <= pos_r[rid, None]) & (kpos >= wlo_r[rid, None]))[:, None, :]  # [R, 1, 64]
            s = torch.where(vis, sc * scale, _NEG_INF)
            m_old = m[rid]
            mn = torch.maximum(m_old, s.amax(-1) + 0.0)  # + 0.0: a -0.0 maximum becomes +0.0
            alpha = portable.exp(m_old - mn)
            p = portable.exp(s - mn[..., None])  # [R, Hkv, 64]; exactly +0 where s is -inf
            if dense:
                pt = p.view(A, Q_TILE, Hkv, KV_BLOCK)
            else:
                pt = p.new_zeros((A * Q_TILE, Hkv, KV_BLOCK))
                pt[sel] = p
                pt = pt.view(A, Q_TILE, Hkv, KV_BLOCK)
            pt = pt.transpose(1, 2).contiguous().view(A * Hkv, Q_TILE, KV_BLOCK)
            pv = exact_bmm(pt, vb, scale_by="k").view(A, Hkv, Q_TILE, D).transpose(1, 2).reshape(A * Q_TILE, Hkv, D)
            if not dense:
                pv = pv[sel]
            m[rid] = mn
            l[rid] = l[rid] * alpha + fold_sum(p, -1)
            acc[rid] = acc[rid] * alpha[..., None] + pv
        vid = tl.valid.reshape(-1).nonzero().squeeze(1)
        Mv, Lv, ACCv = _merge(M[vid], L[vid], ACC[vid], m[vid], l[vid], acc[vid])
        tok_v, g_v = tl.tok.reshape(-1)[vid], tl.g.reshape(-1)[vid]
        out[tok_v, :, g_v] = ACCv / Lv[..., None]
        lse[tok_v, :, g_v] = Mv + portable.log(Lv)
    return out.view(T, Hq, D), lse.view(T, Hq)


# --------------------------------------------------------------------------- varlen (train path)


def _varlen_layout(cu_seqlens: torch.Tensor, T: int):
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    B = lens.shape[0]
    q_seq = torch.repeat_interleave(torch.arange(B, dtype=torch.int64), lens, output_size=T)
    q_pos = torch.arange(T, dtype=torch.int64) - cu[q_seq]
    return cu[:-1, None].contiguous(), q_seq, q_pos, lens


def _dq_pass(qf, gf, lse3, delta, kf, vf, page_rows, q_seq, q_pos, scale, window):
    """``dq`` (before ``· scale``): each query tile over its KV blocks, increasing."""
    T, Hkv, G, D = qf.shape
    dq = torch.empty((T, Hkv, G, D), dtype=torch.float32)
    unit_tok, unit_g, valid, tile_seq = _query_tiles(q_seq, page_rows.shape[0], G)
    C = _tiles_per_group(Hkv)
    for t0 in range(0, unit_tok.shape[0], C):
        sl = slice(t0, t0 + C)
        tl = _Tiles(q_pos, unit_tok[sl], unit_g[sl], valid[sl], tile_seq[sl], window)
        qt, gt = tl.rows(qf), tl.rows(gf)  # [n, Hkv, 64, D]
        lt, dt = tl.rows(lse3), tl.rows(delta)  # [n, Hkv, 64]
        acc = torch.zeros_like(qt)
        for b in range(int(tl.first.min()), int(tl.last.max()) + 1):
            ta = (tl.first <= b) & (tl.last >= b)
            at = None if bool(ta.all()) else ta.nonzero().squeeze(1)
            if at is not None and at.numel() == 0:
                continue  # no tile of the group has this block in range (a sliding-window gap)

            def sub(x, at=at):
                return x if at is None else x[at]

            pos, wlo, lo, hi, seq, cap = (sub(x) for x in (tl.pos, tl.wlo, tl.lo, tl.hi, tl.seq, tl.cap))
            row_act = ((lo <= b) & (hi >= b))[:, None, :, None]
            kb, vb = _kv_blocks(kf, vf, page_rows, _NO_PAGES, seq, b, cap)
            p, ds = _p_ds(sub(qt), sub(gt), sub(lt), sub(dt), kb, vb, scale, _visible(pos, wlo, b))
            A = p.shape[0]
            c = exact_bmm(ds.view(A * Hkv, Q_TILE, KV_BLOCK), kb, scale_by="k").view(A, Hkv, Q_TILE, D)
            acca = sub(acc)
            acca = torch.where(row_act, acca + c, acca)
            if at is None:
                acc = acca
            else:
                acc[at] = acca
        tl.scatter(dq, acc)
    return dq


def _p_ds(qt, gt, lt, dt, kb, vb, scale, vis):
    """``P = exp(s - lse)`` and ``dS = P ⊙ (dO·Vᵀ - delta)`` for query tiles ``[A, H, 64, ·]``."""
    A, H = qt.shape[0], qt.shape[1]
    s = _scores(qt, kb, scale, vis)
    p = portable.exp(s - lt[..., None])  # exactly +0 where s is -inf
    dp = exact_bmm(gt.view(A * H, Q_TILE, -1), vb.transpose(1, 2)).view(A, H, Q_TILE, KV_BLOCK)
    ds = torch.where(vis[:, None], p * (dp - dt[..., None]), 0.0)
    return p, ds


def _dkv_pass(qf, gf, lse3, delta, kf, vf, page_rows, lens, scale, window):
    """``dk`` (before ``· scale``) and ``dv``: each 64-key block of a sequence over the query
    blocks that see it, increasing, folding the GQA group."""
    T, Hkv, G, D = qf.shape
    dk = torch.empty((T, Hkv, D), dtype=torch.float32)
    dv = torch.empty((T, Hkv, D), dtype=torch.float32)
    nblk = torch.div(lens + (KV_BLOCK - 1), KV_BLOCK, rounding_mode="floor")
    B = lens.shape[0]
    tile_seq = torch.repeat_interleave(torch.arange(B, dtype=torch.int64), nblk)
    tile_blk = torch.arange(tile_seq.shape[0], dtype=torch.int64) - (torch.cumsum(nblk, 0) - nblk)[tile_seq]
    starts = page_rows[:, 0]
    C = max(1, _tiles_per_group(Hkv * G))
    offs = torch.arange(KV_BLOCK, dtype=torch.int64)
    for t0 in range(0, tile_seq.shape[0], C):
        seq, kblk = tile_seq[t0 : t0 + C], tile_blk[t0 : t0 + C]
        n = seq.shape[0]
        last = lens[seq] - 1
        kpos = kblk[:, None] * KV_BLOCK + offs  # [n, 64]
        kvalid = kpos <= last[:, None]
        qlast = last if window is None else torch.minimum(last, kblk * KV_BLOCK + (KV_BLOCK - 1) + (window - 1))
        qhi = _floor64(qlast)  # last query block that sees a key of the tile
        kidx = _row_index(page_rows, _NO_PAGES, seq, kpos, last)
        kt, vt = kf[kidx], vf[kidx]  # [n, 64, Hkv, D]
        kt = torch.where(kvalid[..., None, None], kt, 0.0).transpose(1, 2)  # [n, Hkv, 64, D]
        vt = torch.where(kvalid[..., None, None], vt, 0.0).transpose(1, 2)
        kt = kt[:, :, None].expand(n, Hkv, G, KV_BLOCK, D).reshape(n * Hkv * G, KV_BLOCK, D)
        vt = vt[:, :, None].expand(n, Hkv, G, KV_BLOCK, D).reshape(n * Hkv * G, KV_BLOCK, D)
        acc_k = torch.zeros((n, Hkv, KV_BLOCK, D))
        acc_v = torch.zeros((n, Hkv, KV_BLOCK, D))
        for d in range(int((qhi - kblk).max()) + 1):
            ta = kblk + d <= qhi
            at = None if bool(ta.all()) else ta.nonzero().squeeze(1)

            def sub(x, at=at):
                return x if at is None else x[at]

            sa, qb, la_ = sub(seq), sub(kblk) + d, sub(last)
            A = sa.shape[0]
            qpos = qb[:, None] * KV_BLOCK + offs  # [A, 64]
            qvalid = qpos <= la_[:, None]
            vis = (qpos[:, :, None] >= sub(kpos)[:, None, :]) & qvalid[:, :, None] & sub(kvalid)[:, None, :]
            if window is not None:
                vis &= qpos[:, :, None] <= sub(kpos)[:, None, :] + (window - 1)
            # query block rows per (kv head, g): [A, Hkv, G, 64, ...] → batch A·Hkv·G
            qidx = _row_index(page_rows, _NO_PAGES, sa, qpos, la_)

            def qrows(x, qidx=qidx, qvalid=qvalid):
                r = x[qidx]  # [A, 64, Hkv, G, ...]
                r = torch.where(qvalid.reshape(qvalid.shape + (1,) * (r.dim() - 2)), r, 0.0)
                return r.movedim(1, 3).contiguous()

            qb_, gb_ = qrows(qf), qrows(gf)  # [A, Hkv, G, 64, D]
            lb_, db_ = qrows(lse3), qrows(delta)  # [A, Hkv, G, 64]
            ka = sub(kt.view(n, Hkv * G, KV_BLOCK, D)).reshape(A * Hkv * G, KV_BLOCK, D)
            va = sub(vt.view(n, Hkv * G, KV_BLOCK, D)).reshape(A * Hkv * G, KV_BLOCK, D)
            visg = vis[:, None].expand(A, Hkv * G, Q_TILE, KV_BLOCK).reshape(A * Hkv * G, Q_TILE, KV_BLOCK)
            p, ds = _p_ds(
                qb_.view(A * Hkv * G, 1, Q_TILE, D), gb_.view(A * Hkv * G, 1, Q_TILE, D),
                lb_.view(A * Hkv * G, 1, Q_TILE), db_.view(A * Hkv * G, 1, Q_TILE), ka, va, scale, visg,
            )
            p = p.view(A * Hkv * G, Q_TILE, KV_BLOCK)
            ds = ds.view(A * Hkv * G, Q_TILE, KV_BLOCK)
            cv = exact_bmm(p.transpose(1, 2), gb_.view(A * Hkv * G, Q_TILE, D), scale_by="k")  # [·, 64 keys, D]
            ck = exact_bmm(ds.transpose(1, 2), qb_.view(A * Hkv * G, Q_TILE, D), scale_by="k")
            cv = fold_sum(cv.view(A, Hkv, G, KV_BLOCK, D), 2)
            ck = fold_sum(ck.view(A, Hkv, G, KV_BLOCK, D), 2)
            if at is None:
                acc_k, acc_v = acc_k + ck, acc_v + cv
            else:
                acc_k[at], acc_v[at] = acc_k[at] + ck, acc_v[at] + cv
        rows = (starts[seq][:, None] + kpos)[kvalid]
        dk[rows] = acc_k.transpose(1, 2)[kvalid]
        dv[rows] = acc_v.transpose(1, 2)[kvalid]
    return dk, dv


def _varlen_backward(grad, q, k, v, out, lse, cu_seqlens, scale, window):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if T == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    page_rows, q_seq, q_pos, lens = _varlen_layout(cu_seqlens, T)
    qf = q.reshape(T, Hkv, G, D).to(torch.float32)
    gf = grad.reshape(T, Hkv, G, D).to(torch.float32)
    kf, vf = k.to(torch.float32), v.to(torch.float32)
    delta = fold_sum(gf * out.reshape(T, Hkv, G, D).to(torch.float32), -1)  # [T, Hkv, G]
    lse3 = lse.reshape(T, Hkv, G)
    dq = _dq_pass(qf, gf, lse3, delta, kf, vf, page_rows, q_seq, q_pos, scale, window)
    dk, dv = _dkv_pass(qf, gf, lse3, delta, kf, vf, page_rows, lens, scale, window)
    return (dq * scale).view(T, Hq, D).to(q.dtype), (dk * scale).to(q.dtype), dv.to(q.dtype)


@torch.library.custom_op("rlk::varlen_attention_cpu", mutates_args=(), device_types="cpu")
def varlen_attention_fwd_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(out, lse, out_fp32)``; ``out_fp32`` (the unrounded output, kept for the
    backward's ``delta = Σ dO ⊙ O``) is empty when ``q`` is already fp32."""
    T = q.shape[0]
    page_rows, q_seq, q_pos, _ = _varlen_layout(cu_seqlens, T)
    out, lse = attend_rows(q, k, v, page_rows, _NO_PAGES, q_seq, q_pos, scale, window)
    if q.dtype == torch.float32:
        return out, lse, out.new_empty((0,))
    return out.to(q.dtype), lse, out


@torch.library.custom_op("rlk::varlen_attention_cpu_backward", mutates_args=(), device_types="cpu")
def varlen_attention_bwd_cpu(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _varlen_backward(grad, q, k, v, out, lse, cu_seqlens, scale, window)


wire_varlen_attention(varlen_attention_fwd_cpu, varlen_attention_bwd_cpu)


def varlen_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """Causal attention over a packed batch (arguments validated by ``rl_engine.ops.attention``;
    the op's body directly in a plain no-grad eager call: ``call_op``)."""
    return call_op(varlen_attention_fwd_cpu, q, k, v, cu_seqlens, scale, window)[0]


# --------------------------------------------------------------------------- cached (rollout path)


@torch.library.custom_op("rlk::cached_attention_cpu", mutates_args=("k_cache", "v_cache"), device_types="cpu")
def cached_attention_cpu(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_rows: torch.Tensor,
    page_size: int,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None,
    decode_only: bool = False,
) -> torch.Tensor:
    """Write ``k_new``/``v_new`` into storage rows ``slot_mapping`` of ``k_cache``/``v_cache``
    (``[N, Hkv, D]``), then run the forward program for every query row (arguments prepared and
    validated by ``rl_engine.ops.attention.cached_attention``). ``decode_only`` (one query token
    per sequence) is a scheduling hint of the GPU kernels; here it is only checked (``T == B``)."""
    if decode_only and q_seq.shape[0] != page_rows.shape[0]:
        raise ValueError(f"decode_only: expected one query token per sequence, got {q_seq.shape[0]} tokens "
                         f"for {page_rows.shape[0]} sequences")
    k_cache.index_copy_(0, slot_mapping, k_new)
    v_cache.index_copy_(0, slot_mapping, v_new)
    out, _ = attend_rows(q, k_cache, v_cache, page_rows, page_size, q_seq, q_pos, scale, window)
    return out.to(q.dtype)


@cached_attention_cpu.register_fake
def _(q, k_new, v_new, k_cache, v_cache, slot_mapping, page_rows, page_size, q_seq, q_pos, scale, window,
      decode_only=False):
    return q.new_empty(q.shape)


_GUARANTEES = frozenset({"row", "chunk", "prefill_decode", "layout", "run_to_run", "threads", "isa"})

register(
    Implementation(
        op="attention.varlen_attention",
        impl_id="cpu.blocked_online_softmax",
        version="3",
        fn=varlen_attention_cpu,
        families=("cpu",),
        dtypes=_DTYPES,
        guarantees=_GUARANTEES,
        priority=10,
    )
)
register(
    Implementation(
        op="attention.cached_attention",
        impl_id="cpu.blocked_online_softmax",
        version="3",
        fn=cached_attention_cpu,
        families=("cpu",),
        dtypes=_DTYPES,
        guarantees=_GUARANTEES,
        priority=10,
    )
)
