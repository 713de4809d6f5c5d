"""Triton kernels and host launchers of ``attention.varlen_attention`` / ``attention.cached_attention``.

Importing this module imports triton (nothing is compiled until a launcher runs); the
registration module imports it lazily, on the first call. The algorithm and the rules that make
every path give the same bits are in the package docstring (``__init__.py``) and
docs/design/attention.md ("GPU (Triton)").

Kernels (every launched name starts with ``rlk_``):

* ``rlk_attn_fwd``          one program per (query tile, kv head): the KV splits of the tile's
  range one after the other, each folded into the row state with ``rlk_attn_merge`` (prefill,
  varlen forward);
* ``rlk_attn_fwd_split``    one program per (query tile, kv head, KV split): one split's
  ``(m, l, acc)`` into an fp32 workspace (flash-decoding);
* ``rlk_attn_combine``      folds the workspace splits left to right with the same merge, then
  ``out = ACC / L`` (decode);
* ``rlk_attn_bwd_delta``    ``delta = Σ_d dO ⊙ O`` (fp32, fixed pairwise tree over ``D``);
* ``rlk_attn_bwd_dq``       each query tile over its KV blocks, increasing;
* ``rlk_attn_bwd_dkdv``     each 64-key block over the query blocks that see it, increasing,
  the GQA group rows in order ``g = 0 .. G-1``.

Device functions shared by the kernels (so one expression compiles one way): the row bookkeeping
``rlk_attn_rows``, the key/value row addresses ``rlk_attn_kv_rows``, the split body
``rlk_attn_split``, the merge ``rlk_attn_merge``, the final division ``rlk_attn_finish`` and the
fixed pairwise row sum ``rlk_attn_rowsum``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "KV_BLOCK",
    "SPLIT_BLOCKS",
    "AttnConfig",
    "PREFILL_CONFIGS",
    "DECODE_CONFIGS",
    "BWD_CONFIGS",
    "shipped_forward_configs",
    "select_prefill",
    "select_decode",
    "use_decode_path",
    "supported_head_dim",
    "tile_table",
    "attend",
    "varlen_forward",
    "cached_forward",
    "varlen_backward",
    "KERNEL_NAMES",
    "DEVICE_FUNCTIONS",
]

KERNEL_NAMES = ("rlk_attn_fwd", "rlk_attn_fwd_split", "rlk_attn_combine", "rlk_attn_bwd_delta", "rlk_attn_bwd_dq",
                "rlk_attn_bwd_dkdv")
#: ``@triton.jit`` device functions (inlined into the kernels above, never launched on their own).
DEVICE_FUNCTIONS = ("rlk_attn_rowsum", "rlk_attn_rows", "rlk_attn_kv_rows", "rlk_attn_split", "rlk_attn_merge",
                    "rlk_attn_finish")

#: Keys per block, at absolute positions 0, 64, 128, ... (the same on every path and kernel).
KV_BLOCK = 64
#: Blocks per KV split (1024 keys), splits at absolute positions 0, 1024, 2048, ...
SPLIT_BLOCKS = 16
_NO_PAGES = 1 << 62
_BIG = 1 << 40  # "no block" marker for padding rows (larger than any block index)


@dataclass(frozen=True)
class AttnConfig:
    """One launch configuration: query rows per tile, warps, software-pipeline depth.

    ``KV_BLOCK`` (64), the head dim and the dtypes are the same on every path; only the query
    tile may change, and the GPU tests prove that rows are raw-bit equal across every
    configuration listed here (``shipped_forward_configs``)."""

    block_m: int
    num_warps: int
    num_stages: int

    @property
    def key(self) -> str:
        return f"m{self.block_m}_w{self.num_warps}_s{self.num_stages}"


C = AttnConfig
# Prefill (one program per tile and kv head, splits in sequence): (dtype, head_dim) -> config.
PREFILL_CONFIGS: dict[tuple[torch.dtype, int], AttnConfig] = {
    (torch.bfloat16, 32): C(128, 4, 3),
    (torch.bfloat16, 64): C(128, 4, 3),
    (torch.bfloat16, 128): C(128, 8, 2),
    (torch.float16, 32): C(128, 4, 3),
    (torch.float16, 64): C(128, 4, 3),
    (torch.float16, 128): C(128, 8, 2),
    (torch.float32, 32): C(64, 4, 2),
    (torch.float32, 64): C(64, 4, 2),
    (torch.float32, 128): C(32, 4, 2),
}
# Decode (split-parallel): 16-row tiles (the smallest tl.dot M), every split its own program.
DECODE_CONFIGS: dict[tuple[torch.dtype, int], AttnConfig] = {
    (dt, d): C(16, 4, 3) for dt in (torch.bfloat16, torch.float16, torch.float32) for d in (32, 64, 128)
}
# Backward (dq tiles of 64 query rows; dk/dv blocks of 64 keys against 64-position query blocks).
BWD_CONFIGS: dict[tuple[torch.dtype, int], AttnConfig] = {
    (dt, d): C(64, 4 if d <= 64 or dt == torch.float32 else 8, 2)
    for dt in (torch.bfloat16, torch.float16, torch.float32) for d in (32, 64, 128)
}
_HEAD_DIMS = (32, 64, 128)


def supported_head_dim(d: int) -> bool:
    return d in _HEAD_DIMS


def select_prefill(dtype: torch.dtype, head_dim: int) -> AttnConfig:
    return PREFILL_CONFIGS[(dtype, head_dim)]


def select_decode(dtype: torch.dtype, head_dim: int) -> AttnConfig:
    return DECODE_CONFIGS[(dtype, head_dim)]


def shipped_forward_configs(dtype: torch.dtype, head_dim: int) -> list[AttnConfig]:
    """Every forward configuration a call can use for ``(dtype, head_dim)`` (the tests cover each)."""
    out = [select_prefill(dtype, head_dim)]
    if select_decode(dtype, head_dim) not in out:
        out.append(select_decode(dtype, head_dim))
    return out


def use_decode_path(num_tokens: int, num_seqs: int, group: int) -> bool:
    """The path rule of ``cached_attention``: the split-parallel (decode) kernels when the query
    rows average at most one 16-row tile per sequence. Both paths give the same bits (tested), so
    the rule only decides speed."""
    return num_tokens * group <= 16 * max(num_seqs, 1)


# ----------------------------------------------------------------------------------------------
# Device functions


@triton.jit
def rlk_attn_rowsum(x, BLOCK_M: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """``Σ_j x[:, j]`` by a fixed pairwise tree (adjacent pairs, ``LOG2N`` halvings): every step
    is an elementwise IEEE add, so a row's sum does not depend on the register layout."""
    for i in tl.static_range(LOG2N):
        x = tl.reshape(x, [BLOCK_M, N >> (i + 1), 2])
        a, b = tl.split(x)
        x = a + b
    return tl.reshape(x, [BLOCK_M])


@triton.jit
def rlk_attn_rows(tab_ptr, t, G, W, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of query tile ``t``: ``(seq, valid, tok, g, pos, wlo, lo, hi, first, last, cap)``.

    Tile table row ``[seq, unit0, unit1, pos_base]``: the tile holds units ``unit0 .. unit1-1``
    (unit = token·G + g, g fastest) of batch sequence ``seq``; token ``tok`` sits at position
    ``tok - pos_base``. Padding rows get ``lo = BIG``, ``hi = -1`` (never active)."""
    t64 = t.to(tl.int64)
    seq = tl.load(tab_ptr + t64 * 4)
    u0 = tl.load(tab_ptr + t64 * 4 + 1)
    u1 = tl.load(tab_ptr + t64 * 4 + 2)
    pbase = tl.load(tab_ptr + t64 * 4 + 3)
    unit = u0 + tl.arange(0, BLOCK_M).to(tl.int64)
    valid = unit < u1
    tok = unit // G
    g = unit - tok * G
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
def rlk_attn_kv_rows(pr_ptr, seq, pr_stride, page_size, kpos, PAGED: tl.constexpr):
    """Storage rows of key positions ``kpos`` of batch sequence ``seq``."""
    if PAGED:
        page = tl.load(pr_ptr + seq * pr_stride + kpos // page_size)
        return page + kpos % page_size
    else:
        return tl.load(pr_ptr + seq * pr_stride) + kpos


@triton.jit
def rlk_attn_split(q, k_ptr, v_ptr, pr_ptr, seq, pr_stride, page_size, cap, kvh, pos, wlo, lo, hi, b0, b1, qk_scale,
                   sk_row, sk_head, sv_row, sv_head, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, PAGED: tl.constexpr,
                   IEEE: tl.constexpr):
    """One KV split's online softmax over blocks ``b0 .. b1`` from the state ``(-inf, 0, 0)``;
    a row updates its state only in the blocks of its own range ``[lo, hi]``."""
    offs_n = tl.arange(0, 64)
    offs_d = tl.arange(0, HEAD_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    for b in range(b0, b1 + 1):
        kpos = b * 64 + offs_n
        rows = rlk_attn_kv_rows(pr_ptr, seq, pr_stride, page_size, tl.minimum(kpos, cap).to(tl.int64), PAGED)
        koff = rows * sk_row + kvh * sk_head
        voff = rows * sv_row + kvh * sv_head
        kt = tl.load(k_ptr + koff[None, :] + offs_d[:, None])  # [D, 64]
        v = tl.load(v_ptr + voff[:, None] + offs_d[None, :])  # [64, D]
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        vis = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] >= wlo[:, None])
        s = tl.where(vis, s * qk_scale, float("-inf"))
        act = (lo <= b) & (hi >= b)
        mn = tl.maximum(m, tl.max(s, axis=1) + 0.0)
        mn = tl.where(act, mn, 0.0)
        alpha = tl.where(act, tl.exp(m - mn), 1.0)
        p = tl.exp(s - mn[:, None])  # exactly +0 where s is -inf (all of an inactive row)
        l_new = tl.fma(l, alpha, rlk_attn_rowsum(p, BLOCK_M, 64, 6))
        if IEEE:
            acc_new = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc_new = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        # An inactive row has alpha = 1 and P = +0 exactly, so acc_new == acc (adding exact
        # zeros to a value that is never -0): only m and l need the select.
        m = tl.where(act, mn, m)
        l = tl.where(act, l_new, l)
        acc = acc_new
    return m, l, acc


@triton.jit
def rlk_attn_merge(M, L, A, m, l, a):
    """``merge((M, L, A), (m, l, a))``. A split a row does not reach has ``(m, l, a) = (-inf, 0, +0)``
    and merging it is an exact identity (``e^{M-M'} = 1``, ``e^{m-M'} = 0``, exact zeros added to
    values that are never ``-0``); while ``M`` is still ``-inf`` the state stays ``(-inf, 0, +0)``
    (the shift is taken as 0 to avoid ``-inf - -inf``). No select on the accumulator."""
    Mn = tl.maximum(M, m)
    Ms = tl.where(Mn == float("-inf"), 0.0, Mn)
    ea = tl.exp(M - Ms)
    ec = tl.exp(m - Ms)
    Ln = tl.fma(l, ec, L * ea)
    An = tl.fma(a, ec[:, None], A * ea[:, None])
    return Mn, Ln, An


@triton.jit
def rlk_attn_finish(M, L, A, out_ptr, out32_ptr, lse_ptr, q_off, lse_off, valid, offs_d,
                    STORE_F32: tl.constexpr, STORE_LSE: tl.constexpr):
    """``out = ACC / L`` rounded once to the output dtype (and the fp32 copy / lse if asked)."""
    o = tl.div_rn(A, L[:, None])
    mask = valid[:, None]
    tl.store(out_ptr + q_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_F32:
        tl.store(out32_ptr + q_off[:, None] + offs_d[None, :], o, mask=mask)
    if STORE_LSE:
        tl.store(lse_ptr + lse_off, M + tl.log(L), mask=valid)


# ----------------------------------------------------------------------------------------------
# Forward kernels


@triton.jit
def rlk_attn_fwd(q_ptr, k_ptr, v_ptr, out_ptr, out32_ptr, lse_ptr, scr_ptr, tab_ptr, pr_ptr, pr_stride, page_size, G, W,
                 qk_scale, sk_row, sk_head, sv_row, sv_head, HQ, HKV, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr, IEEE: tl.constexpr, STORE_F32: tl.constexpr,
                 STORE_LSE: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    seq, valid, tok, g, pos, wlo, lo, hi, first, last, cap = rlk_attn_rows(tab_ptr, t, G, W, HAS_WINDOW, BLOCK_M)
    if last >= 0:
        offs_d = tl.arange(0, HEAD_D)
        head = kvh * G + g
        q_off = (tok * HQ + head) * HEAD_D
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.zeros([BLOCK_M], tl.float32)
        s_first = first // 16
        s_last = last // 16
        scr = scr_ptr + q_off[:, None] + offs_d[None, :]
        # The merged accumulator waits in fp32 scratch between splits (one accumulator in
        # registers, not two; the store/reload is exact). The first split merges with the initial
        # (-inf, 0, +0) state, exactly as rlk_attn_combine does; the last one writes the output.
        for sp in range(s_first, s_last + 1):
            b0 = tl.maximum(first, sp * 16)
            b1 = tl.minimum(last, sp * 16 + 15)
            m, l, a = rlk_attn_split(q, k_ptr, v_ptr, pr_ptr, seq, pr_stride, page_size, cap, kvh, pos, wlo, lo, hi,
                                     b0, b1, qk_scale, sk_row, sk_head, sv_row, sv_head, HEAD_D, BLOCK_M, PAGED, IEEE)
            at = lo * 0 + sp
            A = tl.load(scr, mask=(valid & (at > s_first))[:, None], other=0.0)
            M, L, A = rlk_attn_merge(M, L, A, m, l, a)
            tl.store(scr, A, mask=(valid & (at < s_last))[:, None])
            rlk_attn_finish(M, L, A, out_ptr, out32_ptr, lse_ptr, q_off, tok * HQ + head, valid & (at == s_last),
                            offs_d, STORE_F32, STORE_LSE)


@triton.jit
def rlk_attn_fwd_split(q_ptr, k_ptr, v_ptr, ws_m_ptr, ws_l_ptr, ws_a_ptr, tab_ptr, pr_ptr, pr_stride, page_size, G, W,
                       qk_scale, sk_row, sk_head, sv_row, sv_head, NS, HQ, HKV, HEAD_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2)
    seq, valid, tok, g, pos, wlo, lo, hi, first, last, cap = rlk_attn_rows(tab_ptr, t, G, W, HAS_WINDOW, BLOCK_M)
    sp = first // 16 + j
    if (last >= 0) & (sp <= last // 16):
        offs_d = tl.arange(0, HEAD_D)
        q_off = (tok * HQ + kvh * G + g) * HEAD_D
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        b0 = tl.maximum(first, sp * 16)
        b1 = tl.minimum(last, sp * 16 + 15)
        m, l, a = rlk_attn_split(q, k_ptr, v_ptr, pr_ptr, seq, pr_stride, page_size, cap, kvh, pos, wlo, lo, hi,
                                 b0, b1, qk_scale, sk_row, sk_head, sv_row, sv_head, HEAD_D, BLOCK_M, PAGED, IEEE)
        slot = ((t.to(tl.int64) * HKV + kvh) * NS + j) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(ws_m_ptr + slot, m)
        tl.store(ws_l_ptr + slot, l)
        tl.store(ws_a_ptr + slot[:, None] * HEAD_D + offs_d[None, :], a)


@triton.jit
def rlk_attn_combine(out_ptr, out32_ptr, lse_ptr, ws_m_ptr, ws_l_ptr, ws_a_ptr, tab_ptr, G, W, NS,
                     HQ, HKV, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, STORE_F32: tl.constexpr, STORE_LSE: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    seq, valid, tok, g, pos, wlo, lo, hi, first, last, cap = rlk_attn_rows(tab_ptr, t, G, W, HAS_WINDOW, BLOCK_M)
    if last >= 0:
        offs_d = tl.arange(0, HEAD_D)
        head = kvh * G + g
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.zeros([BLOCK_M], tl.float32)
        A = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        for j in range(0, last // 16 - first // 16 + 1):
            slot = ((t.to(tl.int64) * HKV + kvh) * NS + j) * BLOCK_M + tl.arange(0, BLOCK_M)
            m = tl.load(ws_m_ptr + slot)
            l = tl.load(ws_l_ptr + slot)
            a = tl.load(ws_a_ptr + slot[:, None] * HEAD_D + offs_d[None, :])
            M, L, A = rlk_attn_merge(M, L, A, m, l, a)
        rlk_attn_finish(M, L, A, out_ptr, out32_ptr, lse_ptr, (tok * HQ + head) * HEAD_D, tok * HQ + head, valid,
                        offs_d, STORE_F32, STORE_LSE)


# ----------------------------------------------------------------------------------------------
# Backward kernels (varlen / train path; packed layout: key row of position p = cu[seq] + p)


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
def rlk_attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, tab_ptr, pr_ptr, G, W, qk_scale, scale,
                    HQ, HKV, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    seq, valid, tok, g, pos, wlo, lo, hi, first, last, cap = rlk_attn_rows(tab_ptr, t, G, W, HAS_WINDOW, BLOCK_M)
    if last >= 0:
        offs_d = tl.arange(0, HEAD_D)
        offs_n = tl.arange(0, 64)
        head = kvh * G + g
        r_off = tok * HQ + head
        q_off = r_off * HEAD_D
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        do = tl.load(do_ptr + q_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        lse = tl.load(lse_ptr + r_off, mask=valid, other=0.0)
        delta = tl.load(delta_ptr + r_off, mask=valid, other=0.0)
        base = tl.load(pr_ptr + seq)
        dq = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        for b in range(first, last + 1):
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
            vis = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] >= wlo[:, None]) & valid[:, None]
            s = tl.where(vis, s * qk_scale, float("-inf"))
            p = tl.exp(s - lse[:, None])
            ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
            if IEEE:
                dq = tl.dot(ds, tl.trans(kt), dq, input_precision="ieee")
            else:
                dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
        dq = dq * scale
        tl.store(dq_ptr + q_off[:, None] + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def rlk_attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, ktab_ptr, cu_ptr, G, W,
                      qk_scale, scale, HQ, HKV, HEAD_D: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):
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
        for qb in range(kb, qlast // 64 + 1):
            qpos = qb * 64 + offs
            qvalid = qpos < n
            vis = (qpos[:, None] >= kpos[None, :]) & qvalid[:, None] & kvalid[None, :]
            if HAS_WINDOW:
                vis = vis & (qpos[:, None] <= kpos[None, :] + W - 1)
            for g in range(0, G):
                r_off = (base + qpos) * HQ + kvh * G + g
                qo = r_off[:, None] * HEAD_D + offs_d[None, :]
                q = tl.load(q_ptr + qo, mask=qvalid[:, None], other=0.0)
                do = tl.load(do_ptr + qo, mask=qvalid[:, None], other=0.0)
                lse = tl.load(lse_ptr + r_off, mask=qvalid, other=0.0)
                delta = tl.load(delta_ptr + r_off, mask=qvalid, other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                    dp = tl.dot(do, tl.trans(v))
                s = tl.where(vis, s * qk_scale, float("-inf"))
                p = tl.exp(s - lse[:, None])
                ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
                if IEEE:
                    dv = tl.dot(tl.trans(p), do, dv, input_precision="ieee")
                    dk = tl.dot(tl.trans(ds), q, dk, input_precision="ieee")
                else:
                    dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv)
                    dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk)
        dk = dk * scale
        tl.store(dk_ptr + koff[:, None] + offs_d[None, :], dk.to(dk_ptr.dtype.element_ty), mask=kvalid[:, None])
        tl.store(dv_ptr + koff[:, None] + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kvalid[:, None])


# ----------------------------------------------------------------------------------------------
# Host side


def _guard(t: torch.Tensor):
    """The device guard of ``t``'s GPU (none for CPU tensors: the interpreter, TRITON_INTERPRET=1)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def tile_table(counts: torch.Tensor, tok_start: torch.Tensor, pos_base: torch.Tensor, group: int, block_m: int,
               num_tokens: int) -> torch.Tensor:
    """Query tiles as an int64 ``[NT_max, 4]`` table ``[seq, unit0, unit1, pos_base]`` (torch ops on
    the device, no host sync).

    Sequence ``i`` has ``counts[i]`` tokens from row ``tok_start[i]``; its units (token·G + g)
    are cut into tiles of ``block_m`` from its first unit, so a sequence's tiles never depend on
    the other sequences. ``NT_max = ceil(T·G / block_m) + B`` bounds the tile count; tiles past the
    real count have ``unit0 == unit1`` (their programs return at once)."""
    B = counts.shape[0]
    dev = counts.device
    nt_max = -(-num_tokens * group // block_m) + B
    units = counts * group
    ntiles = torch.div(units + (block_m - 1), block_m, rounding_mode="floor")
    tile_end = torch.cumsum(ntiles, 0)
    t = torch.arange(nt_max, device=dev, dtype=torch.int64)
    seq = torch.searchsorted(tile_end, t, right=True).clamp_(max=max(B - 1, 0))
    j = t - (tile_end - ntiles)[seq]
    start = tok_start[seq] * group
    u0 = start + j * block_m
    u1 = torch.minimum(u0 + block_m, start + units[seq])
    u1 = torch.where(t < tile_end[-1], u1, u0)
    return torch.stack([seq, u0, u1, pos_base[seq]], 1).contiguous()


def _key_table(lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """64-key blocks of each packed sequence: int64 ``[NB_max, 4]`` rows ``[seq, block, len, 0]``
    (``len = 0`` marks an unused row)."""
    B = lens.shape[0]
    nb_max = -(-num_tokens // 64) + B
    nblk = torch.div(lens + 63, 64, rounding_mode="floor")
    end = torch.cumsum(nblk, 0)
    t = torch.arange(nb_max, device=lens.device, dtype=torch.int64)
    seq = torch.searchsorted(end, t, right=True).clamp_(max=max(B - 1, 0))
    blk = t - (end - nblk)[seq]
    n = torch.where(t < end[-1], lens[seq], 0)
    return torch.stack([seq, blk, n, torch.zeros_like(n)], 1).contiguous()


def _varlen_rows(cu_seqlens: torch.Tensor):
    cu = cu_seqlens.to(torch.int64)
    counts = cu[1:] - cu[:-1]
    tok_start = cu[:-1].contiguous()
    return counts, tok_start, tok_start  # position of token t = t - cu[seq]


def attend(q, k_rows, v_rows, page_rows, page_size, counts, tok_start, pos_base, max_positions, scale, window, *,
           path: str, config: AttnConfig | None = None, want_lse: bool = False, want_f32: bool = False):
    """The forward for every query row (all entry points end here).

    Args:
        q: ``[T, Hq, D]``; k_rows, v_rows: ``[N, Hkv, D]`` storage rows.
        page_rows, page_size: storage row of position ``p`` of batch sequence ``i`` is
            ``page_rows[i, p // page_size] + p % page_size`` (one column: ``page_rows[i, 0] + p``).
        counts, tok_start, pos_base: ``[B]`` int64 on the device: sequence ``i`` owns query rows
            ``tok_start[i] .. + counts[i] - 1``, row ``t`` at position ``t - pos_base[i]``.
        max_positions: host bound on ``1 + `` the largest query position (sizes the split grid).
        path: ``"prefill"`` (splits in sequence inside one program) or ``"decode"`` (one program
            per split + ``rlk_attn_combine``); both give the same bits.
        config: force a tile configuration (tests); default from the config tables.

    Returns ``(out [T, Hq, D] in q.dtype, lse [T, Hq] fp32 | None, out_f32 | None)``.
    """
    T, Hq, D = q.shape
    Hkv = k_rows.shape[1]
    G = Hq // Hkv
    B = counts.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device) if want_lse else None
    out32 = torch.empty((T, Hq, D), dtype=torch.float32, device=q.device) if want_f32 else None
    if T == 0 or B == 0:
        return out, lse, out32
    cfg = config or (select_decode(q.dtype, D) if path == "decode" else select_prefill(q.dtype, D))
    tab = tile_table(counts, tok_start, pos_base, G, cfg.block_m, T)
    nt = tab.shape[0]
    paged = page_rows.shape[1] > 1
    ieee = q.dtype == torch.float32
    has_w = window is not None
    w = int(window) if has_w else 0
    dummy = out32 if out32 is not None else (lse if lse is not None else out)
    common = dict(HQ=Hq, HKV=Hkv, HEAD_D=D, BLOCK_M=cfg.block_m, HAS_WINDOW=has_w)
    # storage rows may be views with their own row / head strides (an engine's cache buffer);
    # the head dim must be unit-stride
    if k_rows.stride(2) != 1 or v_rows.stride(2) != 1:
        raise ValueError("k_cache: expected unit stride along head_dim")
    kv_strides = (k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1))
    with _guard(q):
        if path == "prefill":
            # fp32 scratch for the merged accumulator between KV splits (only written when a
            # tile spans several splits): the fp32 output itself when there is one
            if out32 is not None:
                scr = out32
            elif q.dtype == torch.float32:
                scr = out
            elif max_positions <= KV_BLOCK * SPLIT_BLOCKS:  # one split: never touched
                scr = torch.empty((1,), dtype=torch.float32, device=q.device)
            else:
                scr = torch.empty((T, Hq, D), dtype=torch.float32, device=q.device)
            rlk_attn_fwd[(nt, Hkv)](
                q, k_rows, v_rows, out, out32 if out32 is not None else dummy, lse if lse is not None else dummy, scr,
                tab, page_rows, page_rows.stride(0), page_size, G, w, float(scale), *kv_strides, **common, PAGED=paged,
                IEEE=ieee, STORE_F32=want_f32, STORE_LSE=want_lse, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        elif path == "decode":
            ns = max(1, -(-int(max_positions) // (KV_BLOCK * SPLIT_BLOCKS)))
            ws_m = torch.empty((nt, Hkv, ns, cfg.block_m), dtype=torch.float32, device=q.device)
            ws_l = torch.empty_like(ws_m)
            ws_a = torch.empty((nt, Hkv, ns, cfg.block_m, D), dtype=torch.float32, device=q.device)
            rlk_attn_fwd_split[(nt, Hkv, ns)](
                q, k_rows, v_rows, ws_m, ws_l, ws_a, tab, page_rows, page_rows.stride(0), page_size, G, w,
                float(scale), *kv_strides, ns, **common, PAGED=paged, IEEE=ieee, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
            rlk_attn_combine[(nt, Hkv)](
                out, out32 if out32 is not None else dummy, lse if lse is not None else dummy, ws_m, ws_l, ws_a,
                tab, G, w, ns, **common, STORE_F32=want_f32, STORE_LSE=want_lse, num_warps=cfg.num_warps,
            )
        else:
            raise ValueError(f"path: expected 'prefill' or 'decode', got {path!r}")
    return out, lse, out32


def varlen_forward(q, k, v, cu_seqlens, scale, window, *, path: str = "prefill", config: AttnConfig | None = None):
    """Train-path forward: ``(out, lse, out_f32)`` (``out_f32`` only for 16-bit inputs, else empty)."""
    counts, tok_start, pos_base = _varlen_rows(cu_seqlens)
    page_rows = tok_start[:, None].contiguous()
    want_f32 = q.dtype != torch.float32
    out, lse, out32 = attend(q, k, v, page_rows, _NO_PAGES, counts, tok_start, pos_base, q.shape[0], scale, window,
                             path=path, config=config, want_lse=True, want_f32=want_f32)
    if out32 is None:
        out32 = q.new_empty((0,), dtype=torch.float32)
    return out, lse, out32


def cached_rows(q_seq: torch.Tensor, q_pos: torch.Tensor, num_seqs: int):
    """``(counts, tok_start, pos_base)`` of the rollout layout (rows of a sequence contiguous, in
    batch order, consecutive positions: what ``rl_engine.ops.attention.cached_attention`` builds)."""
    T = q_seq.shape[0]
    # scatter_add, not bincount: no host sync (bincount sizes its output from the data), so the
    # launcher can be captured in a CUDA graph
    counts = torch.zeros(num_seqs, dtype=torch.int64, device=q_seq.device).scatter_add_(0, q_seq, torch.ones_like(q_seq))
    tok_start = torch.cumsum(counts, 0) - counts
    first = tok_start.clamp(max=max(T - 1, 0))
    pos_base = tok_start - q_pos[first] if T else tok_start
    return counts, tok_start, pos_base


def cached_forward(q, k_rows, v_rows, page_rows, page_size, q_seq, q_pos, scale, window, *, path: str | None = None,
                   config: AttnConfig | None = None):
    """Rollout-path forward over the cache rows (keys/values already written)."""
    T, Hq, _ = q.shape
    B = page_rows.shape[0]
    G = Hq // k_rows.shape[1]
    counts, tok_start, pos_base = cached_rows(q_seq, q_pos, B)
    P = page_rows.shape[1]
    bound = page_size if P == 1 else P * page_size
    if path is None:
        path = "decode" if use_decode_path(T, B, G) else "prefill"
    out, _, _ = attend(q, k_rows, v_rows, page_rows.contiguous(), page_size, counts, tok_start, pos_base,
                       min(bound, 1 << 40), scale, window, path=path, config=config)
    return out


def varlen_backward(grad, q, k, v, out, lse, cu_seqlens, scale, window):
    """``(dq, dk, dv)`` in the input dtype; ``out`` is the unrounded fp32 output for 16-bit inputs."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if T == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    counts, tok_start, pos_base = _varlen_rows(cu_seqlens)
    cfg = BWD_CONFIGS[(q.dtype, D)]
    grad = grad.contiguous()
    out = out.contiguous()
    ieee = q.dtype == torch.float32
    has_w = window is not None
    w = int(window) if has_w else 0
    delta = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
    R = T * Hq
    block_r = 64
    with _guard(q):
        rlk_attn_bwd_delta[(triton.cdiv(R, block_r),)](grad, out, delta, R, HEAD_D=D, LOG2D=int(math.log2(D)),
                                                       BLOCK_R=block_r, num_warps=4)
        tab = tile_table(counts, tok_start, pos_base, G, cfg.block_m, T)
        rlk_attn_bwd_dq[(tab.shape[0], Hkv)](
            q, k, v, grad, lse, delta, dq, tab, tok_start, G, w, float(scale), float(scale), HQ=Hq, HKV=Hkv,
            HEAD_D=D, BLOCK_M=cfg.block_m, HAS_WINDOW=has_w, IEEE=ieee, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        ktab = _key_table(counts, T)
        rlk_attn_bwd_dkdv[(ktab.shape[0], Hkv)](
            q, k, v, grad, lse, delta, dk, dv, ktab, tok_start, G, w, float(scale), float(scale), HQ=Hq, HKV=Hkv,
            HEAD_D=D, HAS_WINDOW=has_w, IEEE=ieee, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return dq, dk, dv
