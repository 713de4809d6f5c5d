"""Shared building blocks of the invariant CPU backend: the exact-sum GEMM and the fixed-order sum.

Shapes use ``M`` rows (tokens), ``K`` the reduced dimension and ``N`` output features.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator

import torch

from rl_engine.utils.portable import pow2

__all__ = ["TILE_N", "exact_matmul", "exact_bmm", "exact_beta", "row_exponents", "exact_partial_sums", "exact_finish",
           "frozen_weights"]

#: Output-feature block of the vocabulary-chunked paths (the canonical log-sum-exp's block):
#: the fused LM head splits the vocabulary at multiples of it.
TILE_N = 1024
_F64_BITS = 53
# Row and reduction blocks of exact_matmul's float64 work (memory only: blocking changes no bit).
_ROW_BLOCK = 512
_K_BLOCK = 256


# ----------------------------------------------------------------------------- frozen weights
#
# Splitting a weight into its exact slices is most of a decode-sized exact GEMM (a float64 copy of
# every weight element, scaled and truncated). Inside ``frozen_weights()`` a weight's slices are
# kept and reused while the weight is unchanged: the same tensor object, data pointer, shape,
# strides and version counter. Reuse changes no bit (the slices are the same function of the same
# values); it is scoped because a weight's storage can be swapped under the same object (``p.data =
# ...``, ZeRO-3 gathers) without a version bump, which only a scope with frozen weights rules out.

_FROZEN: contextvars.ContextVar[_SliceCache | None] = contextvars.ContextVar("rlk_frozen_weights", default=None)


class _SliceCache:
    """Weight slices by tensor identity, at most ``budget`` bytes (least recently used first out)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.bytes = 0
        self.entries: dict[int, tuple] = {}  # id(w) -> (ref, meta, ew, blocks, nbytes); insertion = LRU order
        self.lock = threading.RLock()  # re-entrant: a weight collected while the lock is held calls discard

    @staticmethod
    def meta(w: torch.Tensor, beta: int) -> tuple | None:
        # a view (a transposed weight, a vocabulary chunk) is a new object at every call: it never hits
        if (type(w) not in (torch.Tensor, torch.nn.Parameter) or w.device.type != "cpu" or w.is_inference()
                or w._base is not None):
            return None
        try:
            version = w._version
        except RuntimeError:  # tensors without a version counter (functorch wrappers)
            return None
        return (w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, version, beta)

    def get(self, w: torch.Tensor, meta: tuple):
        with self.lock:
            hit = self.entries.get(id(w))
            if hit is None or hit[0]() is not w or hit[1] != meta:
                return None
            self.entries[id(w)] = self.entries.pop(id(w))  # most recently used
            return hit[2], hit[3]

    def put(self, w: torch.Tensor, meta: tuple, ew: torch.Tensor, blocks: list[list[torch.Tensor]]) -> None:
        nbytes = sum(t.numel() * t.element_size() for b in blocks for t in b)
        if nbytes > self.budget:
            return
        key = id(w)
        with self.lock:
            self._drop(key)
            while self.entries and self.bytes + nbytes > self.budget:
                self._drop(next(iter(self.entries)))
            self.entries[key] = (weakref.ref(w, lambda _r, k=key: self.discard(k, _r)), meta, ew, blocks, nbytes)
            self.bytes += nbytes

    def discard(self, key: int, ref: weakref.ref) -> None:
        with self.lock:
            hit = self.entries.get(key)
            if hit is not None and hit[0] is ref:
                self._drop(key)

    def _drop(self, key: int) -> None:
        hit = self.entries.pop(key, None)
        if hit is not None:
            self.bytes -= hit[4]


@contextlib.contextmanager
def frozen_weights(budget_bytes: int = 1 << 30) -> Iterator[None]:
    """Within the block, the CPU exact GEMM reuses each weight's exact slices across calls.

    For loops whose weights do not change, such as a rollout's decode steps: a decode-sized
    ``gemm.linear`` then skips the float64 split of its weight, most of its cost. Entries are
    keyed by the weight tensor itself and checked against its data pointer, shape, strides and
    version counter; ``budget_bytes`` bounds the cache (float64 slices: 8 bytes per element of a
    16-bit weight, 16 of a float32 one), least recently used first out. The bits are the same
    with and without it. Do not replace a weight's storage inside the block (``p.data = t``,
    sharded parameters being gathered): that is what the scope promises not to happen. Nested
    blocks share the outermost cache; everything is released on leaving it.
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes: expected a size >= 0, got {budget_bytes}")
    if _FROZEN.get() is not None:
        yield
        return
    token = _FROZEN.set(_SliceCache(budget_bytes))
    try:
        yield
    finally:
        _FROZEN.reset(token)


def _block_slices(t: torch.Tensor, e: torch.Tensor, beta: int, k0: int) -> list[torch.Tensor]:
    """The exact slices of columns ``k0 .. k0 + _K_BLOCK`` of ``t`` ``[..., R, K]`` (row exponents ``e``)."""
    return _split(t[..., k0:k0 + _K_BLOCK].to(torch.float64), e, _slices_of(t.dtype), beta)


def _weight_blocks(w: torch.Tensor, ew: torch.Tensor, beta: int) -> list[list[torch.Tensor]]:
    """:func:`_block_slices` of ``w`` for every ``_K_BLOCK`` columns, as :func:`exact_partial_sums` uses them."""
    return [_block_slices(w, ew, beta, k0) for k0 in range(0, w.shape[-1], _K_BLOCK)]


def _slices_of(dtype: torch.dtype) -> int:
    """Integer slices an operand of ``dtype`` is cut into: one for 8/11-bit significands, two for float32."""
    if dtype in (torch.bfloat16, torch.float16):
        return 1
    if dtype == torch.float32:
        return 2
    raise TypeError(f"exact_matmul: expected float32, bfloat16 or float16 operands, got {dtype}")


def _row_exponents(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Per row of ``t`` ``[..., R, K]``: the smallest ``e`` with ``max_k |t[r, k]| < 2^e`` (0 for a zero row).

    Read from the float64 exponent field of the row maximum (exact); int64 ``[..., R, 1]``.
    A row holding ``±inf`` or nan gets ``e = 1025`` or garbage: callers replace non-finite
    values before splitting.
    """
    lo, hi = torch.aminmax(t, dim=dim, keepdim=True)  # (min, max)
    amax = torch.maximum(hi.to(torch.float64), lo.to(torch.float64).neg_())
    e = ((amax.view(torch.int64) >> 52) & 0x7FF) - 1022
    return torch.where(amax == 0, 0, e)


def _split(t: torch.Tensor, e: torch.Tensor, slices: int, beta: int) -> list[torch.Tensor]:
    """Cut each row of float64 ``t`` ``[..., R, K]`` into ``slices`` integer-valued float64 tensors.

    With ``e`` from :func:`_row_exponents`, ``s = t · 2^(β - e)`` has ``|s| < 2^β``;
    ``hi = trunc(s)`` and ``lo = trunc((s - hi) · 2^β)``, so ``t ≈ (hi + lo · 2^-β) · 2^(e - β)``
    with every step exact (power-of-two scalings, ``trunc`` and the subtraction of a value's
    integer part).
    """
    s = t.mul_(pow2(beta - e))  # t is a fresh float64 copy owned by the caller
    if slices == 1:
        return [s.trunc_()]
    hi = torch.trunc(s)
    lo = s.sub_(hi).mul_(float(2**beta)).trunc_()
    return [hi, lo]


def _nonfinite(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Apply IEEE semantics for non-finite operands to the finite result ``out`` ``[..., M, N]``.

    A dot product is nan when a product is nan (a nan operand, ``0 · ±inf``) or the products
    hold both ``+inf`` and ``-inf``; otherwise ``±inf`` when a product is ``±inf``. Each condition
    is counted exactly by float64 matmuls of 0/1 indicators.
    """
    f = torch.float64

    def ind(t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "nan": t.isnan().to(f),
            "pinf": (t == torch.inf).to(f),
            "ninf": (t == -torch.inf).to(f),
            "zero": (t == 0).to(f),
            "pos": (t > 0).to(f),
            "neg": (t < 0).to(f),
        }

    a, b = ind(x), ind(w)

    def mm(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return p @ q.transpose(-1, -2)

    inf_a = a["pinf"] + a["ninf"]
    inf_b = b["pinf"] + b["ninf"]
    nan = (a["nan"].amax(-1, keepdim=True) + b["nan"].amax(-1, keepdim=True).transpose(-1, -2)) + (
        mm(inf_a, b["zero"]) + mm(a["zero"], inf_b)
    )
    pos = mm(a["pinf"], b["pos"]) + mm(a["ninf"], b["neg"]) + mm(a["pos"], b["pinf"]) + mm(a["neg"], b["ninf"])
    neg = mm(a["pinf"], b["neg"]) + mm(a["ninf"], b["pos"]) + mm(a["pos"], b["ninf"]) + mm(a["neg"], b["pinf"])
    bad = (nan > 0) | ((pos > 0) & (neg > 0))
    inf = torch.where(pos > 0, torch.inf, -torch.inf).to(out.dtype)
    return torch.where(bad, torch.nan, torch.where((pos > 0) | (neg > 0), inf, out))


def exact_matmul(
    x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None, scale_by: str = "rows"
) -> torch.Tensor:
    """``x @ w.T`` whose bits depend only on each output element's own row and column.

    Args:
        x: ``[..., M, K]`` float32, bfloat16 or float16.
        w: ``[..., N, K]`` (the same leading dims, or none) float32, bfloat16 or float16.
        out_dtype: the result's dtype (default ``x.dtype``).
        scale_by: where ``w``'s power-of-two scales come from. ``"rows"``: each row ``w[n]``
            (its maximum over ``k``). ``"k"``: each reduction index ``k`` (the maximum of
            ``w[:, k]``), folded into ``x`` (``x[:, k] · 2^{e_k}``, ``w[:, k] · 2^{-e_k}``, exact)
            — for products whose ``K`` runs over slots some rows must not see (keys of an
            attention block, queries of a tile): a slot's scale then touches only the terms that
            use it, and a term whose ``x`` is zero contributes exactly zero.

    Returns:
        ``[..., M, N]``: ``y[m, n] = round(Σ_k x[m, k] · w[n, k])``.

    **Why the bits cannot change.** Each row of ``x`` and of ``w`` is scaled by a power of two
    (from its own maximum) and cut into integer-valued slices of ``β`` bits (:func:`_split`; one
    slice for bfloat16/float16, two for float32). A float64 GEMM of integer slices is **exact**
    when every partial sum is an integer below ``2^53`` — guaranteed by ``2β + ⌈log2 K'⌉ ≤ 53`` for
    a ``K'``-term dot product — so its result does not depend on the order in which the BLAS adds,
    on how many threads split ``K``, or on the instruction set (MKL's AVX2 / AVX-512 / AMX or
    oneDNN code paths, Intel or AMD). The slice products are combined elementwise in one fixed
    order (``hi·hi + 2^-β · (hi·lo + lo·hi)``, the ``lo·lo`` term below ``2^-2β`` of the row
    scales dropped), rescaled exactly and rounded once to float32, then to ``out_dtype``; an
    exactly zero sum is ``+0``.
    Element ``(m, n)`` is therefore a function of ``x[m]`` and ``w[n]`` alone: row (batch)
    invariant, column (chunk) invariant, thread-count and instruction-set invariant.

    **Accuracy.** Slices keep every bit of an operand within ``2^(slices·β - p)`` of its row
    maximum (``p`` its significand width); smaller elements are truncated at ``2^-slices·β``
    of the row maximum. With ``β ≥ 19`` (``K' ≤ 2^15``) that is below float32 rounding for
    float32 and exact for all bfloat16 values within ``2^-11`` of the row maximum.

    Non-finite operands follow IEEE semantics (:func:`_nonfinite`).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    sx, sw = _slices_of(x.dtype), _slices_of(w.dtype)
    K = x.shape[-1]
    lead = x.shape[:-2]
    M, N = x.shape[-2], w.shape[-2]
    if M == 0 or N == 0 or K == 0:
        return torch.zeros((*lead, M, N), dtype=out_dtype, device=x.device)
    terms = K if sx == sw == 1 else 2 * K
    beta = (_F64_BITS - (terms - 1).bit_length()) // 2
    if scale_by not in ("rows", "k"):
        raise ValueError(f"scale_by: expected 'rows' or 'k', got {scale_by!r}")
    # A row holding ±inf or nan reads an exponent of 1025 or more (finite float32/16 rows: ≤ 129).
    # Inside frozen_weights(), an unchanged finite weight's exponents and slices are reused.
    cache, meta, hit = _FROZEN.get(), None, None
    if cache is not None and scale_by == "rows":
        meta = cache.meta(w, beta)
        hit = None if meta is None else cache.get(w, meta)
    ex, ew = _row_exponents(x), (hit[0] if hit is not None else _row_exponents(w))
    finite = bool((ex <= 129).all()) and bool((ew <= 129).all())
    xf, wf = x, w
    if not finite:
        xf = torch.where(torch.isfinite(x), x, 0.0).to(x.dtype)
        wf = torch.where(torch.isfinite(w), w, 0.0).to(w.dtype)
        ex, ew = _row_exponents(xf), _row_exponents(wf)
    if scale_by == "k":
        # Per-k scales folded into x; attention tiles are small, so one block.
        ek = _row_exponents(wf, dim=-2)  # [..., 1, K]
        # A slot whose w column is all zero contributes exactly zero; its x column is zeroed too, so
        # that its x values stay out of x's row scales (they would coarsen the other terms' slices):
        # an attention query with a zero upstream gradient (a right pad) then changes no bit of dK/dV.
        xd = xf.to(torch.float64).mul_(pow2(ek)).masked_fill_((wf == 0).all(dim=-2, keepdim=True), 0.0)
        wd = wf.to(torch.float64).mul_(pow2(-ek))
        ex = _row_exponents(xd)
        ew = torch.zeros((*w.shape[:-1], 1), dtype=torch.int64)
        acc = _products(_split(xd, ex, sx, beta), _split(wd, ew, sw, beta), beta)
        return _finish(acc, ex, ew, beta, x, w, finite, out_dtype)
    out = torch.empty((*lead, M, N), dtype=out_dtype, device=x.device)
    w_blocks = None
    if hit is not None:
        w_blocks = hit[1]
    elif meta is not None and finite:
        w_blocks = _weight_blocks(wf, ew, beta)
        cache.put(w, meta, ew, w_blocks)
    # Blocks of rows bound the float64 temporaries (exact_partial_sums blocks K as well).
    for r0 in range(0, M, _ROW_BLOCK):
        r1 = min(M, r0 + _ROW_BLOCK)
        acc = exact_partial_sums(xf[..., r0:r1, :], wf, ex[..., r0:r1, :], ew, beta, w_blocks=w_blocks)
        out[..., r0:r1, :] = _finish(_combine(acc, beta), ex[..., r0:r1, :], ew, beta, x[..., r0:r1, :], w, finite, out_dtype)
    return out


def exact_beta(k_terms: int, x_dtype: torch.dtype, w_dtype: torch.dtype) -> int:
    """Slice width ``β`` of :func:`exact_matmul` for a ``k_terms``-term dot product.

    ``β = ⌊(53 - ⌈log2 K'⌉) / 2⌋`` with ``K' = K`` (both operands 16-bit, one slice each) or
    ``2K`` (a float32 operand, two slices): every partial sum of slice products is then an
    integer below ``2^53``, so float64 adds them exactly in any order and any grouping.
    """
    if k_terms < 1:
        raise ValueError(f"k_terms: expected a reduction length >= 1, got {k_terms}")
    terms = k_terms if _slices_of(x_dtype) == _slices_of(w_dtype) == 1 else 2 * k_terms
    return (_F64_BITS - (terms - 1).bit_length()) // 2


def row_exponents(t: torch.Tensor, dim: int = -1, *, zero: int = 0) -> torch.Tensor:
    """Per row of ``t``: the smallest ``e`` with ``max |t| < 2^e`` along ``dim`` (``zero`` for an all-zero row).

    int64, ``dim`` kept with size 1. These are :func:`exact_matmul`'s power-of-two row scales.
    The exponent is monotone in the row maximum, so the exponent of a row split into pieces is
    the maximum of the pieces' exponents — provided an all-zero piece reports a value below
    every real exponent (``zero=-2**20``), which the caller maps back to 0 after the maximum.
    """
    e = _row_exponents(t, dim)
    if zero != 0:
        lo, hi = torch.aminmax(t, dim=dim, keepdim=True)
        e = torch.where((hi == 0) & (lo == 0), zero, e)
    return e


def exact_partial_sums(x: torch.Tensor, w: torch.Tensor, ex: torch.Tensor, ew: torch.Tensor, beta: int,
                       w_blocks: list[list[torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """The integer slice-product sums of ``x @ w.T`` over this ``K`` range, as float64 ``[..., M, N]``.

    Args:
        x: ``[..., M, K]`` finite float32/bfloat16/float16; w: ``[..., N, K]`` finite.
        ex: ``[..., M, 1]`` and ew: ``[..., N, 1]`` int64 row exponents (:func:`row_exponents`)
            of the **whole** rows (over every K range that is summed).
        beta: :func:`exact_beta` of the whole reduction length.
        w_blocks: ``w``'s slices per ``_K_BLOCK`` columns, already cut (:func:`frozen_weights`).

    Returns:
        ``[hh]`` (both operands 16-bit) or ``[hh, cross]``: integer-valued float64 tensors. Sums
        of these over disjoint K ranges that cover ``K`` — in any order, e.g. by an all-reduce
        across ranks holding K shards — are exact, and :func:`exact_finish` of the total is
        bit-identical to :func:`exact_matmul` of the whole operands.
    """
    sx, sw = _slices_of(x.dtype), _slices_of(w.dtype)
    K = x.shape[-1]
    acc = None
    # Blocks of K bound the float64 temporaries; the sums over K blocks are exact integer
    # additions, so blocking changes no bit.
    for k0 in range(0, K, _K_BLOCK):
        px = _block_slices(x, ex, beta, k0)
        pw = w_blocks[k0 // _K_BLOCK] if w_blocks is not None else _block_slices(w, ew, beta, k0)
        part = _products(px, pw, beta, split_sum=True)
        acc = part if acc is None else [a_.add_(p_) for a_, p_ in zip(acc, part)]
    if acc is None:  # an empty K range contributes exact zeros
        n = 1 if sx == sw == 1 else 2
        shape = (*x.shape[:-1], w.shape[-2])
        acc = [torch.zeros(shape, dtype=torch.float64, device=x.device) for _ in range(n)]
    return acc


def exact_finish(parts: list[torch.Tensor], ex: torch.Tensor, ew: torch.Tensor, beta: int,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Round the summed :func:`exact_partial_sums` ``parts`` to ``out_dtype`` exactly as
    :func:`exact_matmul` does (combine, rescale by powers of two, one rounding to float32, cast).

    Finite operands only (the caller checks the exponents: a finite float32 row has ``e <= 129``).
    The first part is updated in place.
    """
    acc = _combine(list(parts), beta)
    acc.add_(0.0).mul_(pow2(ex - beta)).mul_(pow2(ew - beta).transpose(-1, -2))
    return acc.to(torch.float32).to(out_dtype)


def _products(px: list[torch.Tensor], pw: list[torch.Tensor], beta: int, split_sum: bool = False):
    """``hi·hi`` and ``hi·lo + lo·hi`` of the slices (each an exact integer GEMM); combined unless ``split_sum``."""
    wt = [p.transpose(-1, -2) for p in pw]
    parts = [px[0] @ wt[0]]
    if len(px) == 2 or len(pw) == 2:
        # hi·lo + lo·hi: each product and their sum are integers below 2^53, so exact.
        cross = px[0] @ wt[1] if len(pw) == 2 else None
        if len(px) == 2:
            cross = px[1] @ wt[0] if cross is None else cross.add_(px[1] @ wt[0])
        parts.append(cross)
    return parts if split_sum else _combine(parts, beta)


def _combine(parts: list[torch.Tensor], beta: int) -> torch.Tensor:
    """``hh + 2^-β · cross`` (one float64 rounding)."""
    acc = parts[0]
    if len(parts) == 2:
        acc.add_(parts[1].mul_(2.0**-beta))
    return acc


def _finish(acc, ex, ew, beta, x, w, finite, out_dtype) -> torch.Tensor:
    """Rescale the integer sums exactly, round once to float32, apply IEEE non-finite rules, cast."""
    # An exactly zero sum is +0 whatever the BLAS's accumulator started from (-0 + 0 = +0).
    acc.add_(0.0).mul_(pow2(ex - beta)).mul_(pow2(ew - beta).transpose(-1, -2))
    out = acc.to(torch.float32)
    if not finite:
        out = _nonfinite(x, w, out)
    return out.to(out_dtype)


def exact_bmm(a: torch.Tensor, b: torch.Tensor, scale_by: str = "rows") -> torch.Tensor:
    """``torch.bmm(a, b)`` (``[B, M, K] @ [B, K, N]``) with :func:`exact_matmul`'s guarantees.

    ``scale_by="rows"`` scales each column ``b[:, :, n]``; ``"k"`` each row ``b[:, k, :]``.
    """
    return exact_matmul(a, b.transpose(-1, -2), scale_by=scale_by)
