"""Triton kernels of ``logprob.log_softmax`` / ``token_logprobs`` / ``entropy`` (imported on first call).

All forward quantities come from one kernel, ``rlk_logprob_fwd``, that runs the canonical
log-sum-exp of :mod:`rl_engine.backends.cpu.logprob.lse` on one row per program:
``z = fl32(x) / fl32(τ)`` (correctly rounded ``div_rn``; none when τ = 1), the vocabulary in
blocks of ``VOCAB_BLOCK`` = 1024 columns at absolute offsets, per block the exact max (``-0``
canonicalised to ``+0``), ``s_b = Σ exp(z − m_b)`` and ``t_b = Σ exp(d)·max(d, −FLT_MAX)``, then
merged **sequentially in block order** with the same ``(m, s, t)`` update; finally
``lse = m + log s``, ``H = log s − t / s``, ``lp = z_t − lse`` and (``WRITE_LS``) the log-softmax
row ``z − lse``. With targets it asserts ``0 <= t < V`` on the device where it reads the target
(compiled with ``debug=True``, launched with ``sanitize_overflow=False``: the assertion and
nothing else is added), so the entry point launches no separate range check. The in-block sum is ``tl.sum``'s fixed tree (a function of the block width and
warp count, both constant) instead of the CPU's ``fixed_order_sum`` — so GPU and CPU bits
differ, while each platform is **row invariant** (the row count is never a specialisation
key) and **chunk invariant** over rows.

Backward (one program per row, fp32, divided by ``fl32(τ)`` with ``div_rn`` unless τ = 1,
rounded once to the logits dtype):

* ``rlk_log_softmax_bwd``     ``dz = g − exp(out) · Σ g`` (``Σ g`` over fixed 1024-lane blocks);
* ``rlk_token_logprobs_bwd``  ``dz_j = (−p_j)·g``, ``dz_t = (1 − p_t)·g``, ``p = exp(z − lse)``;
* ``rlk_entropy_bwd``         ``dz = (p · (max(log p, −FLT_MAX) + H)) · (−g)``.

Kept sets (``KEPT``: one ``(threshold, boundary)`` record per row, ``rl_engine.utils.kept``):
:func:`rlk_keep` tests ``z > thr or (z == thr and id <= boundary)`` on each loaded block (the
target of a token log-prob counts as kept) and the dropped entries become ``-inf`` before the
merge (the log-sum-exp, log-prob and entropy of the renormalised distribution, same order of
operations); the backward kernels mask the same way and write ``+0`` at dropped entries
(``rlk_log_softmax_bwd`` with ``MASKED``: entries whose output is ``-inf`` are left out of
``Σ g`` and get ``+0``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.backends.triton import device_guard

__all__ = ["VOCAB_BLOCK", "forward", "log_softmax_backward", "token_logprobs_backward", "entropy_backward", "KERNEL_NAMES", "DEVICE_FUNCTIONS"]

KERNEL_NAMES = ("rlk_logprob_fwd", "rlk_log_softmax_bwd", "rlk_token_logprobs_bwd", "rlk_entropy_bwd")
#: ``@triton.jit`` device functions (inlined into the kernels above, never launched on their own).
DEVICE_FUNCTIONS = ("rlk_load_z", "rlk_keep", "rlk_load_kept", "rlk_lse_merge_block", "rlk_lse_finish")
#: The canonical vocabulary block (= ``rl_engine.ops.logprob.VOCAB_BLOCK``).
VOCAB_BLOCK = 1024
_WARPS = 4
_NEG_MAX = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX (a constexpr: read inside kernels)


@triton.jit
def rlk_load_z(x_ptr, offs, mask, temperature, HAS_TEMP: tl.constexpr):
    z = tl.load(x_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if HAS_TEMP:
        z = tl.div_rn(z, temperature)
    return z


@triton.jit
def rlk_keep(z, idx, thr, bnd):
    """The kept-set test of scaled logits ``z`` at absolute token ids ``idx`` (``rl_engine.utils.kept``)."""
    return (z > thr) | ((z == thr) & (idx <= bnd))


@triton.jit
def rlk_load_kept(kt_ptr, kb_ptr, row, KEPT: tl.constexpr):
    """Row ``row``'s record ``(threshold, boundary)``; without ``KEPT`` the keep-all record."""
    if KEPT:
        thr = tl.load(kt_ptr + row)
        bnd = tl.load(kb_ptr + row).to(tl.int64)
    else:
        thr = float("-inf")
        bnd = 2147483647
    return thr, bnd


@triton.jit
def rlk_lse_merge_block(z, m, s, t, ENTROPY: tl.constexpr):
    """Steps 1-2 of the canonical log-sum-exp for one ``VOCAB_BLOCK`` of fp32 values ``z``: the
    block's (m_b, s_b, t_b) folded into the running scalars ``(m, s, t)`` (``t`` only with
    ``ENTROPY``). The one copy of these expressions: ``rlk_logprob_fwd`` and the fused LM head's
    ``rlk_linear_logprob_fold`` both call it, so equal blocks in equal order give equal bits."""
    m_b = tl.max(z, axis=0) + 0.0  # + 0.0 turns a -0 maximum into +0
    shift = tl.where(m_b == float("-inf"), 0.0, m_b)
    d = z - shift
    e = tl.exp(d)
    s_b = tl.sum(e, axis=0)
    m_new = tl.maximum(m, m_b)
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    d_old = tl.maximum(m - ref, _NEG_MAX)
    d_b = tl.maximum(m_b - ref, _NEG_MAX)
    a_old = tl.exp(d_old)
    a_b = tl.exp(d_b)
    if ENTROPY:
        t_b = tl.sum(e * tl.maximum(d, _NEG_MAX), axis=0)
        t = (a_old * t + (a_old * d_old) * s) + (a_b * t_b + (a_b * d_b) * s_b)
    s = s * a_old + s_b * a_b
    return m_new, s, t


@triton.jit
def rlk_lse_finish(m, s, t):
    """Step 3: ``(lse, entropy) = (m + log s, log s − t / s)`` of the finished running state."""
    log_s = tl.log(s)
    return m + log_s, log_s - tl.div_rn(t, s)


@triton.jit(do_not_specialize=["R"], debug=True)
def rlk_logprob_fwd(x_ptr, tgt_ptr, ls_ptr, lp_ptr, lse_ptr, ent_ptr, kt_ptr, kb_ptr, R, V, temperature,
                    HAS_TEMP: tl.constexpr, HAS_TARGETS: tl.constexpr, ENTROPY: tl.constexpr,
                    WRITE_LS: tl.constexpr, KEPT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * V
    cols = tl.arange(0, BLOCK_V)
    thr, bnd = rlk_load_kept(kt_ptr, kb_ptr, row, KEPT)
    if HAS_TARGETS:
        tgt = tl.load(tgt_ptr + row).to(tl.int64)
        # the bound check of targets where they are read (compiled with debug=True so the
        # assertion is kept): an out-of-range target stops the launch instead of reading past the row
        tl.device_assert((tgt >= 0) & (tgt < V), "targets: expected token ids in [0, V)")
    else:
        tgt = -1
    m = tl.max(tl.full((BLOCK_V,), float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros((BLOCK_V,), tl.float32), axis=0)
    t = s
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        z = rlk_load_z(x_ptr, base + idx, idx < V, temperature, HAS_TEMP)
        if KEPT:  # the target of a token log-prob counts as kept
            z = tl.where(rlk_keep(z, idx, thr, bnd) | (idx == tgt), z, float("-inf"))
        m, s, t = rlk_lse_merge_block(z, m, s, t, ENTROPY)
    lse, ent = rlk_lse_finish(m, s, t)
    tl.store(lse_ptr + row, lse)
    if ENTROPY:
        tl.store(ent_ptr + row, ent)
    if HAS_TARGETS:
        z_t = tl.load(x_ptr + base + tgt).to(tl.float32)
        if HAS_TEMP:
            z_t = tl.div_rn(z_t, temperature)
        tl.store(lp_ptr + row, z_t - lse)
    if WRITE_LS:
        for v0 in range(0, V, BLOCK_V):
            idx = v0 + cols
            mask = idx < V
            z = rlk_load_z(x_ptr, base + idx, mask, temperature, HAS_TEMP)
            if KEPT:
                z = tl.where(rlk_keep(z, idx, thr, bnd) | (idx == tgt), z, float("-inf"))
            tl.store(ls_ptr + base + idx, z - lse, mask=mask)


@triton.jit(do_not_specialize=["R"])
def rlk_log_softmax_bwd(g_ptr, out_ptr, dx_ptr, R, V, temperature, HAS_TEMP: tl.constexpr, MASKED: tl.constexpr,
                        BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * V
    cols = tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        g = tl.load(g_ptr + base + idx, mask=idx < V, other=0.0)
        if MASKED:
            o = tl.load(out_ptr + base + idx, mask=idx < V, other=float("-inf"))
            g = tl.where(o == float("-inf"), 0.0, g)
        acc += g
    g_sum = tl.sum(acc, axis=0)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        mask = idx < V
        g = tl.load(g_ptr + base + idx, mask=mask, other=0.0)
        o = tl.load(out_ptr + base + idx, mask=mask, other=float("-inf"))
        if MASKED:
            g = tl.where(o == float("-inf"), 0.0, g)
        p = tl.exp(o)
        dz = g - p * g_sum
        if HAS_TEMP:
            dz = tl.div_rn(dz, temperature)
        tl.store(dx_ptr + base + idx, dz.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def rlk_token_logprobs_bwd(g_ptr, x_ptr, tgt_ptr, lse_ptr, dx_ptr, kt_ptr, kb_ptr, R, V, temperature,
                           HAS_TEMP: tl.constexpr, KEPT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * V
    cols = tl.arange(0, BLOCK_V)
    g = tl.load(g_ptr + row)
    lse = tl.load(lse_ptr + row)
    tgt = tl.load(tgt_ptr + row).to(tl.int64)
    thr, bnd = rlk_load_kept(kt_ptr, kb_ptr, row, KEPT)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        mask = idx < V
        z = rlk_load_z(x_ptr, base + idx, mask, temperature, HAS_TEMP)
        if KEPT:  # the target counts as kept
            keep = rlk_keep(z, idx, thr, bnd) | (idx == tgt)
            z = tl.where(keep, z, float("-inf"))
        p = tl.exp(z - lse)
        dz = tl.where(idx == tgt, (1.0 - p) * g, (-p) * g)
        if KEPT:
            dz = tl.where(keep, dz, 0.0)
        if HAS_TEMP:
            dz = tl.div_rn(dz, temperature)
        tl.store(dx_ptr + base + idx, dz.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def rlk_entropy_bwd(g_ptr, x_ptr, lse_ptr, ent_ptr, dx_ptr, kt_ptr, kb_ptr, R, V, temperature,
                    HAS_TEMP: tl.constexpr, KEPT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * V
    cols = tl.arange(0, BLOCK_V)
    neg_g = -tl.load(g_ptr + row)
    lse = tl.load(lse_ptr + row)
    ent = tl.load(ent_ptr + row)
    thr, bnd = rlk_load_kept(kt_ptr, kb_ptr, row, KEPT)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        mask = idx < V
        z = rlk_load_z(x_ptr, base + idx, mask, temperature, HAS_TEMP)
        if KEPT:
            keep = rlk_keep(z, idx, thr, bnd)
            z = tl.where(keep, z, float("-inf"))
        logp = z - lse
        p = tl.exp(logp)
        dz = (p * (tl.maximum(logp, _NEG_MAX) + ent)) * neg_g
        if KEPT:
            dz = tl.where(keep, dz, 0.0)
        if HAS_TEMP:
            dz = tl.div_rn(dz, temperature)
        tl.store(dx_ptr + base + idx, dz.to(dx_ptr.dtype.element_ty), mask=mask)


def _aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with a 16-byte aligned base (a copy if it is a view at an odd offset).

    Triton specialises pointer arguments on 16-byte alignment, and the specialisation may change
    the register layout and hence ``tl.sum``'s association order; with every base aligned, the
    compiled kernel (and a row's bits) depends only on ``V``, the dtype and the flags."""
    if t is not None and t.data_ptr() % 16:
        return t.clone()
    return t


def _f32(R: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(R, dtype=torch.float32, device=like.device)


def forward(logits2: torch.Tensor, temperature: float, *, targets: torch.Tensor | None = None,
            entropy: bool = False, log_softmax: bool = False, kept_threshold: torch.Tensor | None = None,
            kept_boundary: torch.Tensor | None = None):
    """``(log_softmax [R, V] | None, logprobs [R] | None, lse [R], entropy [R] | None)``, all fp32
    (``kept_threshold`` / ``kept_boundary`` ``[R]``: the rows' kept-set records)."""
    R, V = logits2.shape
    logits2, targets = _aligned(logits2), _aligned(targets)
    kept = kept_threshold is not None
    ls = torch.empty((R, V), dtype=torch.float32, device=logits2.device) if log_softmax else None
    lp = _f32(R, logits2) if targets is not None else None
    lse = _f32(R, logits2)
    ent = _f32(R, logits2) if entropy else None
    if R:
        dummy = lse
        with device_guard(logits2):
            rlk_logprob_fwd[(R,)](
                logits2, targets if targets is not None else lse, ls if ls is not None else dummy,
                lp if lp is not None else dummy, lse, ent if ent is not None else dummy,
                kept_threshold if kept else dummy, kept_boundary if kept else dummy, R, V, float(temperature),
                HAS_TEMP=temperature != 1.0, HAS_TARGETS=targets is not None, ENTROPY=entropy,
                WRITE_LS=log_softmax, KEPT=kept, BLOCK_V=VOCAB_BLOCK, num_warps=_WARPS, sanitize_overflow=False,
            )
    return ls, lp, lse, ent


def log_softmax_backward(grad2: torch.Tensor, out2: torch.Tensor, temperature: float, dtype: torch.dtype,
                         masked: bool = False) -> torch.Tensor:
    R, V = out2.shape
    grad2, out2 = _aligned(grad2), _aligned(out2)
    dx = torch.empty((R, V), dtype=dtype, device=out2.device)
    if R:
        with device_guard(out2):
            rlk_log_softmax_bwd[(R,)](grad2, out2, dx, R, V, float(temperature), HAS_TEMP=temperature != 1.0,
                                      MASKED=masked, BLOCK_V=VOCAB_BLOCK, num_warps=_WARPS)
    return dx


def token_logprobs_backward(grad: torch.Tensor, logits2: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                            temperature: float, kept_threshold: torch.Tensor | None = None,
                            kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    R, V = logits2.shape
    logits2 = _aligned(logits2)
    dx = torch.empty_like(logits2)
    kept = kept_threshold is not None
    if R:
        with device_guard(logits2):
            rlk_token_logprobs_bwd[(R,)](grad, logits2, targets, lse, dx, kept_threshold if kept else lse,
                                         kept_boundary if kept else lse, R, V, float(temperature),
                                         HAS_TEMP=temperature != 1.0, KEPT=kept, BLOCK_V=VOCAB_BLOCK, num_warps=_WARPS)
    return dx


def entropy_backward(grad: torch.Tensor, logits2: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                     temperature: float, kept_threshold: torch.Tensor | None = None,
                     kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    R, V = logits2.shape
    logits2 = _aligned(logits2)
    dx = torch.empty_like(logits2)
    kept = kept_threshold is not None
    if R:
        with device_guard(logits2):
            rlk_entropy_bwd[(R,)](grad, logits2, lse, ent, dx, kept_threshold if kept else lse,
                                  kept_boundary if kept else lse, R, V, float(temperature),
                                  HAS_TEMP=temperature != 1.0, KEPT=kept, BLOCK_V=VOCAB_BLOCK, num_warps=_WARPS)
    return dx
