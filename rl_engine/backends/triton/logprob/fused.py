"""Triton kernels and host launchers of the fused LM head ``logprob.linear_token_logprobs``
(imported on the first call; importing this module imports triton, compiles nothing).

The contract is **raw-bit equality with the unfused GPU path** ``token_logprobs(gemm.linear(h,
W), t, τ)`` / ``entropy(gemm.linear(h, W), τ)`` — forward outputs and both gradients — for any
``token_chunk`` and any ``vocab_chunk`` that is a multiple of ``VOCAB_BLOCK`` = 1024, without
ever holding the ``[N, V]`` logits. Where the bits come from:

* **logits chunks** ``h[rows] W[cols]ᵀ`` are computed by the Triton ``gemm.linear`` forward
  (``gemm/kernels.py::forward``): every shipped tile configuration computes an element with the
  same K order and one rounding, so a ``[rows, cols]`` chunk holds exactly the bits of the same
  elements of ``gemm.linear(h, W)`` (row and column-chunk invariance, proved on the device by
  ``tests/backends/triton/test_gemm_triton.py`` for every configuration);
* **forward** ``rlk_linear_logprob_fold`` folds the chunk's 1024-column blocks (at absolute
  offsets, chunks in increasing order) into a per-row running ``(m, s, t)`` kept in fp32 memory
  between chunks, with the *same* device function :func:`rlk_lse_merge_block` as the unfused
  ``rlk_logprob_fwd``, and finishes with the same :func:`rlk_lse_finish`. Storing an fp32 scalar
  and loading it back is exact, so the sequence of operations on each row is the unfused one.
  The in-block ``tl.sum`` tree follows the register layout the compiler derives from the load's
  provable alignment, which in ``rlk_logprob_fwd`` depends on whether ``V`` is a multiple of 16
  (Triton's integer specialisation). The fold kernel therefore reads the chunk with a row
  stride and bound that are multiples of 16 exactly when ``V`` is (chunk widths are multiples of
  1024, the last one ``V − c0``), and when ``V`` is not, it runs the twin kernel
  ``rlk_linear_logprob_fold_ns`` whose stride and bound are not specialised — the same
  alignment facts as the unfused kernel, hence the same layout and tree;
* **backward** ``rlk_linear_logprob_dlogits`` overwrites a logits chunk with the gradient of the
  logits in the logits dtype, element by element with the expressions of
  ``rlk_token_logprobs_bwd`` and ``rlk_entropy_bwd`` (each rounded once to the dtype; when both
  outputs enter the loss the two rounded values are added in fp32 and rounded again — exactly
  what autograd's accumulation of the two unfused gradients does). Elementwise: no layout
  question; compiled with ``enable_fp_fusion=False`` so that no product is contracted into the
  following sum (fp32, τ = 1: ``(−p)·g + de`` would become one fma, a few ulp off the unfused bits;
  :func:`_dlogits_`). Then, each logits chunk recomputed and turned into its gradient in place:

  - ``dweight[cols]`` by ``gemm.grad_weight`` over ``K = N`` — the unfused dW kernel on the same
    output rows (fixed configuration, K from row 0 upwards), from chunks of **all** ``N``
    tokens ``[N, cols]``, written straight into ``dweight``;
  - ``dhidden[rows] += dlogits[rows, cols] @ W[cols]`` by ``gemm.grad_input`` **chained** over
    the vocabulary chunks: the unrounded fp32 accumulator ``[rows, H]`` is stored after each
    chunk and reloaded by the next, and the last chunk rounds once. The tiles consume K in
    ``BLOCK_K`` steps from each chunk's first column and every chunk but the last is a multiple
    of 1024 columns, so this is the unfused dx product over ``K = V`` operation for operation
    (``gemm.grad_input``), and the GEMM's row invariance makes any token chunking give the same
    rows.

  When the ``grad hidden`` pass takes all ``N`` tokens at once, each gradient chunk feeds both
  products (four ``2·N·H·V`` products in all with the forward; the unfused path has three and
  holds the ``[N, V]`` logits); otherwise ``grad weight`` has a pass of its own (five). The
  default chunks of a training call share the pass wherever it fits their memory bound, and
  split it where it does not (``_chunks``).

**Kept sets** (``KEPT``, top-k / top-p replay): the fold and the gradient kernels test each
loaded entry with :func:`rlk_keep` at its absolute token id (``c0 + column``) against the row's
record, the row's target counting as kept, as ``rlk_logprob_fwd`` / ``rlk_token_logprobs_bwd``
do on the whole row: dropped entries are ``-inf`` before the merge and get a ``+0`` gradient (the
entropy is that of the same set: equal to ``entropy(..., kept=)`` whenever the target lies in
its kept set, as it does on the logits the record was taken from). The test is
elementwise, so every chunking masks the same entries and the bits stay those of the unfused path.

**fp32 logits** (``fp32_logits``, bf16 inputs): the logits chunks come from ``gemm.linear``'s
fp32-output variant (the accumulator stored unrounded, pointer-load kernel), the fold reads them
as the unfused ops read the fp32 logits; ``rlk_linear_logprob_dlogits`` forms the gradient in
fp32 (both terms added in fp32: autograd's sum of the two unfused fp32 gradients) and writes it
rounded once to bf16 into a separate bf16 block, which the bf16 ``grad_weight`` / ``grad_input``
consume — the unfused fp32-output ``gemm.linear`` backward rounds its fp32 gradient to bf16 the
same way before the same products.

Memory beyond inputs and outputs: forward ``rows · vocab_chunk`` logits in the dtype plus four
fp32 values per row of a chunk; backward, one ``[N, dw_cols]`` gradient block in the ``grad
weight`` pass and one ``[dx_rows, dx_cols]`` block plus the fp32 ``[dx_rows, H]`` accumulator in
the ``grad hidden`` pass (an fp32-logits call also holds the fp32 logits of the block). The
forward and the backward may use different chunk sizes (none changes a bit); the defaults keep a
training call within the size of ``hidden`` (``rl_engine/backends/triton/logprob/__init__.py``:
``_chunks``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.backends.triton import device_guard
from rl_engine.backends.triton.gemm import kernels as gemm_kernels
from rl_engine.backends.triton.logprob.kernels import (
    _NEG_MAX,
    _WARPS,
    VOCAB_BLOCK,
    rlk_keep,
    rlk_load_kept,
    rlk_load_z,
    rlk_lse_finish,
    rlk_lse_merge_block,
)

__all__ = ["forward", "backward", "KERNEL_NAMES", "DEVICE_FUNCTIONS"]

KERNEL_NAMES = ("rlk_linear_logprob_fold", "rlk_linear_logprob_fold_ns", "rlk_linear_logprob_dlogits")
#: ``@triton.jit`` device functions used here (all but the last from ``kernels.py``; inlined, never launched).
DEVICE_FUNCTIONS = ("rlk_load_z", "rlk_keep", "rlk_load_kept", "rlk_lse_merge_block", "rlk_lse_finish",
                    "rlk_linear_logprob_fold_body")

@triton.jit
def rlk_linear_logprob_fold_body(x_ptr, ld, n_cols, c0, tgt_ptr, m_ptr, s_ptr, t_ptr, zt_ptr, lp_ptr, lse_ptr, ent_ptr,
               kt_ptr, kb_ptr, temperature, HAS_TEMP: tl.constexpr, ENTROPY: tl.constexpr,
               FIRST: tl.constexpr, FINISH: tl.constexpr, KEPT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * ld
    cols = tl.arange(0, BLOCK_V)
    thr, bnd = rlk_load_kept(kt_ptr, kb_ptr, row, KEPT)
    local = tl.load(tgt_ptr + row).to(tl.int64) - c0  # the target's column in this chunk
    if FIRST:  # the unfused kernel's initial state
        m = tl.max(tl.full((BLOCK_V,), float("-inf"), tl.float32), axis=0)
        s = tl.sum(tl.zeros((BLOCK_V,), tl.float32), axis=0)
        t = s
    else:
        m = tl.load(m_ptr + row)
        s = tl.load(s_ptr + row)
        t = tl.load(t_ptr + row)
    for j0 in range(0, n_cols, BLOCK_V):
        idx = j0 + cols
        z = rlk_load_z(x_ptr, base + idx, idx < n_cols, temperature, HAS_TEMP)
        if KEPT:  # absolute ids; the target counts as kept
            z = tl.where(rlk_keep(z, c0 + idx, thr, bnd) | (idx == local), z, float("-inf"))
        m, s, t = rlk_lse_merge_block(z, m, s, t, ENTROPY)
    # the target's scaled logit, as rlk_logprob_fwd forms it, kept until the last chunk
    hit = (local >= 0) & (local < n_cols)
    z_t = tl.load(x_ptr + base + tl.where(hit, local, 0)).to(tl.float32)
    if HAS_TEMP:
        z_t = tl.div_rn(z_t, temperature)
    if FINISH:
        if not FIRST:
            z_t = tl.where(hit, z_t, tl.load(zt_ptr + row))
    else:
        tl.store(zt_ptr + row, z_t, mask=hit)
    if FINISH:
        lse, ent = rlk_lse_finish(m, s, t)
        tl.store(lse_ptr + row, lse)
        if ENTROPY:
            tl.store(ent_ptr + row, ent)
        tl.store(lp_ptr + row, z_t - lse)
    else:
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(t_ptr + row, t)


@triton.jit(do_not_specialize=["R", "c0"])
def rlk_linear_logprob_fold(x_ptr, ld, n_cols, c0, tgt_ptr, m_ptr, s_ptr, t_ptr, zt_ptr, lp_ptr, lse_ptr,
                            ent_ptr, kt_ptr, kb_ptr, R, temperature, HAS_TEMP: tl.constexpr,
                            ENTROPY: tl.constexpr, FIRST: tl.constexpr, FINISH: tl.constexpr, KEPT: tl.constexpr,
                            BLOCK_V: tl.constexpr):
    """Fold logits ``x[r, :n_cols]`` (vocabulary columns ``c0 ..``; row stride ``ld``) into row
    ``r``'s running canonical state; ``FINISH``: write lse, entropy and the token log-prob.
    For ``V % 16 == 0`` (``ld`` and ``n_cols`` then specialise like ``V`` does)."""
    rlk_linear_logprob_fold_body(x_ptr, ld, n_cols, c0, tgt_ptr, m_ptr, s_ptr, t_ptr, zt_ptr, lp_ptr, lse_ptr, ent_ptr,
               kt_ptr, kb_ptr, temperature, HAS_TEMP, ENTROPY, FIRST, FINISH, KEPT, BLOCK_V)


@triton.jit(do_not_specialize=["R", "c0", "ld", "n_cols"])
def rlk_linear_logprob_fold_ns(x_ptr, ld, n_cols, c0, tgt_ptr, m_ptr, s_ptr, t_ptr, zt_ptr, lp_ptr, lse_ptr,
                               ent_ptr, kt_ptr, kb_ptr, R, temperature, HAS_TEMP: tl.constexpr,
                               ENTROPY: tl.constexpr, FIRST: tl.constexpr, FINISH: tl.constexpr, KEPT: tl.constexpr,
                               BLOCK_V: tl.constexpr):
    """``rlk_linear_logprob_fold`` for ``V % 16 != 0``: ``ld`` and ``n_cols`` are not specialised,
    so (like ``V`` in ``rlk_logprob_fwd``) nothing is known about their divisibility."""
    rlk_linear_logprob_fold_body(x_ptr, ld, n_cols, c0, tgt_ptr, m_ptr, s_ptr, t_ptr, zt_ptr, lp_ptr, lse_ptr, ent_ptr,
               kt_ptr, kb_ptr, temperature, HAS_TEMP, ENTROPY, FIRST, FINISH, KEPT, BLOCK_V)


@triton.jit(do_not_specialize=["R", "c0"])
def rlk_linear_logprob_dlogits(x_ptr, y_ptr, ld, n_cols, c0, tgt_ptr, lse_ptr, glp_ptr, ent_ptr, gent_ptr, kt_ptr, kb_ptr,
                               R, temperature, HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr, HAS_TEMP: tl.constexpr,
                               KEPT: tl.constexpr, BLOCK_V: tl.constexpr):
    """Logits ``x[r, :n_cols]`` (columns ``c0 ..``) → gradient of the logits, written to ``y``
    (same strides; ``y`` may be ``x``: in place).

    ``dz = (1 − p)·g`` at the target, ``(−p)·g`` elsewhere (``p = exp(z − lse)``), and/or
    ``(p·(max(log p, −FLT_MAX) + H))·(−g_H)``; each divided by ``fl32(τ)`` (``div_rn``; not for
    τ = 1) and rounded to the logits' dtype (what each unfused backward produces); both present:
    the two rounded values added in fp32 (autograd's accumulation, in the logits' dtype); the
    result rounded to ``y``'s dtype (a no-op unless ``y`` is the bf16 block of the fp32-logits
    variant). ``KEPT``: entries outside the row's kept set are masked to ``-inf`` first and get
    ``+0``. Program ``(r, b)`` handles row ``r``, columns ``b·BLOCK_V ..`` (elementwise: the grid
    shape changes no bit). Launched with ``enable_fp_fusion=False`` (see :func:`_dlogits_`)."""
    row = tl.program_id(0).to(tl.int64)
    base = row * ld
    idx = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = idx < n_cols
    lse = tl.load(lse_ptr + row)
    local = tl.load(tgt_ptr + row).to(tl.int64) - c0
    z = rlk_load_z(x_ptr, base + idx, mask, temperature, HAS_TEMP)
    if KEPT:  # absolute ids; the target counts as kept
        thr, bnd = rlk_load_kept(kt_ptr, kb_ptr, row, KEPT)
        keep = rlk_keep(z, c0 + idx, thr, bnd) | (idx == local)
        z = tl.where(keep, z, float("-inf"))
    logp = z - lse
    p = tl.exp(logp)
    if HAS_LP:
        g = tl.load(glp_ptr + row)
        dz = tl.where(idx == local, (1.0 - p) * g, (-p) * g)
        if KEPT:
            dz = tl.where(keep, dz, 0.0)
        if HAS_TEMP:
            dz = tl.div_rn(dz, temperature)
        out = dz.to(x_ptr.dtype.element_ty)
    if HAS_ENT:
        neg_g = -tl.load(gent_ptr + row)
        ent = tl.load(ent_ptr + row)
        de = (p * (tl.maximum(logp, _NEG_MAX) + ent)) * neg_g
        if KEPT:
            de = tl.where(keep, de, 0.0)
        if HAS_TEMP:
            de = tl.div_rn(de, temperature)
        de = de.to(x_ptr.dtype.element_ty)
        if HAS_LP:
            out = (out.to(tl.float32) + de.to(tl.float32)).to(x_ptr.dtype.element_ty)
        else:
            out = de
    tl.store(y_ptr + base + idx, out.to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# host side


def forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
            return_entropy: bool, token_chunk: int, vocab_chunk: int, kept_threshold: torch.Tensor | None = None,
            kept_boundary: torch.Tensor | None = None, fp32_logits: bool = False):
    """``(logprobs [N], entropy [N] | [0], lse [N])`` fp32 for ``hidden [N, H]``, ``weight [V, H]``
    (``kept_*``: the rows' kept-set records; ``fp32_logits``: the fp32 LM-head variant)."""
    N = hidden.shape[0]
    V = weight.shape[0]
    dev = hidden.device
    f32 = dict(dtype=torch.float32, device=dev)
    lp = torch.empty(N, **f32)
    lse = torch.empty(N, **f32)
    ent = torch.empty(N if return_entropy else 0, **f32)
    if N == 0:
        return lp, ent, lse
    state = torch.empty((4, min(token_chunk, N)), **f32)  # m, s, t, z_target of the rows of a chunk
    kernel = rlk_linear_logprob_fold if V % 16 == 0 else rlk_linear_logprob_fold_ns
    has_temp = temperature != 1.0
    kept = kept_threshold is not None
    out_dtype = torch.float32 if fp32_logits else None
    with device_guard(hidden):
        for r0 in range(0, N, token_chunk):
            r1 = min(N, r0 + token_chunk)
            R = r1 - r0
            h = hidden[r0:r1]
            kt, kb = (kept_threshold[r0:r1], kept_boundary[r0:r1]) if kept else (lse, lse)
            for c0 in range(0, V, vocab_chunk):
                logits = gemm_kernels.forward(h, weight[c0 : c0 + vocab_chunk], None, out_dtype=out_dtype)
                C = logits.shape[1]
                last = c0 + C >= V
                kernel[(R,)](
                    logits, C, C, c0, targets[r0:r1], state[0], state[1], state[2], state[3],
                    lp[r0:r1], lse[r0:r1], ent[r0:r1] if return_entropy else lse[r0:r1], kt, kb, R, float(temperature),
                    HAS_TEMP=has_temp, ENTROPY=return_entropy, FIRST=c0 == 0, FINISH=last, KEPT=kept,
                    BLOCK_V=VOCAB_BLOCK, num_warps=_WARPS,
                )
                del logits
    return lp, ent, lse


def _dlogits_(logits: torch.Tensor, c0: int, targets, lse, g_lp, ent, g_ent, temperature: float,
              kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The gradient of ``logits [R, C]`` (vocabulary columns ``c0 ..``): written over the logits,
    or, with an ``out_dtype`` other than theirs (the fp32-logits variant: bf16), into a new
    ``[R, C]`` block of that dtype.

    ``enable_fp_fusion=False``: with both outputs in the loss and τ = 1, fp32's ``.to(float32)``
    is the identity, so ``dz + de`` is ``(−p)·g + de`` and the compiler would contract it into one
    fma (one rounding) — while the unfused path rounds ``dz`` and ``de`` in two kernels and adds
    them in autograd's accumulation (two roundings). On the H200 that contraction moves fp32
    ``grad hidden`` / ``grad weight`` a few ulp off the unfused bits (bf16 rounds ``dz`` first,
    τ ≠ 1 divides first, so neither can contract). The unfused kernels ``rlk_token_logprobs_bwd`` /
    ``rlk_entropy_bwd`` have no multiply feeding an add, so fusion changes nothing there; here,
    off, every product and sum is rounded on its own, as there."""
    R, C = logits.shape
    out = logits if out_dtype in (None, logits.dtype) else torch.empty((R, C), dtype=out_dtype, device=logits.device)
    kept = kept_threshold is not None
    if R and C:
        grid = (R, triton.cdiv(C, VOCAB_BLOCK))
        rlk_linear_logprob_dlogits[grid](
            logits, out, C, C, c0, targets, lse, g_lp if g_lp is not None else lse, ent if g_ent is not None else lse,
            g_ent if g_ent is not None else lse, kept_threshold if kept else lse, kept_boundary if kept else lse,
            R, float(temperature),
            HAS_LP=g_lp is not None, HAS_ENT=g_ent is not None, HAS_TEMP=temperature != 1.0, KEPT=kept,
            BLOCK_V=VOCAB_BLOCK, num_warps=_WARPS, enable_fp_fusion=False,
        )
    return out


def _chain_dx(dl: torch.Tensor, w: torch.Tensor, acc: torch.Tensor | None, out: torch.Tensor, first: bool,
              last: bool) -> None:
    """One vocabulary chunk of ``grad hidden = dlogits · W`` chained over the chunks
    (``gemm.grad_input``): the chunk's products start from the unrounded fp32 sums in ``acc``
    (``+0`` for the first chunk) and are stored back unrounded, or, for the last chunk, rounded
    once into ``out``. Every chunk but the last has a multiple of 1024 columns, so the chained
    calls are the unfused ``dx`` product over ``K = V`` operation for operation."""
    gemm_kernels.grad_input(dl, w, acc=None if first else acc, out=out if last else acc, partial=not last)


def backward(g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, hidden: torch.Tensor, weight: torch.Tensor,
             targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, temperature: float, dx_rows: int,
             dx_cols: int, dw_cols: int, need_hidden: bool, need_weight: bool,
             kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None,
             fp32_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dhidden [N, H] | [0], dweight [V, H] | [0])`` in the inputs' dtype.

    Each logits chunk is recomputed (``gemm.linear``) and turned into its gradient in place
    (:func:`_dlogits_`); then

    * ``grad weight``: per ``dw_cols`` vocabulary rows, the gradient of all ``N`` tokens and
      ``dW[cols] = dlogitsᵀ h`` (``gemm.grad_weight`` over ``K = N``, the unfused ``dW`` kernel on
      the same output rows), written straight into ``dweight``;
    * ``grad hidden``: per ``dx_rows`` tokens, the vocabulary in chunks of ``dx_cols`` columns,
      ``dh[rows] += dlogits W[cols]`` chained through an fp32 ``[dx_rows, H]`` accumulator
      (:func:`_chain_dx`), rounded once into ``dhidden[rows]`` after the last chunk — the unfused
      ``dx`` product over ``K = V``, row by row (the GEMM is row invariant).

    When ``dx_rows`` covers all ``N`` tokens and ``dw_cols == dx_cols`` the two share one pass
    (each gradient chunk feeds both products: 4 products of ``2·N·H·V`` flops with the
    forward); otherwise each has its own (5). Same bits either way
    (``test_backward_strategies_give_the_same_bits``)."""
    N, H = hidden.shape
    V = weight.shape[0]
    if N == 0 or (g_lp is None and g_ent is None):
        return hidden.new_zeros((N, H) if need_hidden else (0,)), weight.new_zeros((V, H) if need_weight else (0,))
    if dx_rows < 1:
        raise ValueError(f"dx_rows: expected a positive int, got {dx_rows}")
    for name, cols in (("dx_cols", dx_cols), ("dw_cols", dw_cols)):
        if cols < 1 or cols % VOCAB_BLOCK:
            raise ValueError(f"{name}: expected a positive multiple of {VOCAB_BLOCK}, got {cols}")
    # every element of both is written below
    dhidden = hidden.new_empty((N, H) if need_hidden else (0,))
    dweight = weight.new_empty((V, H) if need_weight else (0,))
    kept = kept_threshold is not None
    out_dtype = torch.float32 if fp32_logits else None

    def dlogits(r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        logits = gemm_kernels.forward(hidden[r0:r1], weight[c0:c1], None, out_dtype=out_dtype)
        return _dlogits_(logits, c0, targets[r0:r1], lse[r0:r1], g_lp[r0:r1] if g_lp is not None else None,
                         ent[r0:r1] if g_ent is not None else None, g_ent[r0:r1] if g_ent is not None else None,
                         temperature, kept_threshold[r0:r1] if kept else None,
                         kept_boundary[r0:r1] if kept else None, hidden.dtype)

    def accumulator(rows: int, cols: int) -> torch.Tensor | None:  # the chained dx's fp32 partial sums
        return torch.empty((rows, H), dtype=torch.float32, device=hidden.device) if V > cols else None

    shared = need_weight and need_hidden and dx_rows >= N and dw_cols == dx_cols
    with device_guard(hidden):
        if need_weight:
            acc = accumulator(N, dw_cols) if shared else None
            for c0 in range(0, V, dw_cols):
                c1 = min(V, c0 + dw_cols)
                dl = dlogits(0, N, c0, c1)
                gemm_kernels.grad_weight(dl, hidden, out=dweight[c0:c1])
                if shared:
                    _chain_dx(dl, weight[c0:c1], acc, dhidden, c0 == 0, c1 >= V)
                del dl
        if need_hidden and not shared:
            acc = accumulator(min(dx_rows, N), dx_cols)
            for r0 in range(0, N, dx_rows):
                r1 = min(N, r0 + dx_rows)
                part = acc[: r1 - r0] if acc is not None else None
                for c0 in range(0, V, dx_cols):
                    c1 = min(V, c0 + dx_cols)
                    dl = dlogits(r0, r1, c0, c1)
                    _chain_dx(dl, weight[c0:c1], part, dhidden[r0:r1], c0 == 0, c1 >= V)
                    del dl
    return dhidden, dweight
