"""The canonical log-sum-exp: one algorithm, one order of operations, shared by every log-prob op.

Every rl-kernel log-prob quantity of a row of logits ``x ∈ R^V`` at temperature ``τ`` is computed
from the fp32 values

    ``z_j = fl32(fl32(x_j) / fl32(τ))``        (one correctly rounded division; none if τ = 1)

in the following fixed order (``B = VOCAB_BLOCK = 1024``, blocks at absolute vocabulary offsets
``0, B, 2B, ...``; the last block may be shorter):

1. per block ``b``: ``m_b = max_j z_j`` (exact; ``-0`` canonicalised to ``+0``), shifted values
   ``d_j = z_j - m_b`` (``m_b`` taken as 0 when the block is all ``-inf``), ``e_j = exp(d_j)``,
   ``s_b = fixed_order_sum(e)`` and, for the entropy, ``t_b = fixed_order_sum(e ⊙ max(d, -FLT_MAX))``
   (the clamp only turns ``0 · -inf`` into ``0``);
2. blocks are merged **sequentially in block order** into a running ``(m, s, t)`` that starts at
   ``(-inf, 0, 0)``: with ``m' = max(m, m_b)`` (0 if ``-inf``), ``δ = max(m - m', -FLT_MAX)``,
   ``δ_b = max(m_b - m', -FLT_MAX)``, ``a = exp(δ)``, ``a_b = exp(δ_b)``::

       s ← s·a + s_b·a_b
       t ← (a·t + (a·δ)·s_old) + (a_b·t_b + (a_b·δ_b)·s_b)
       m ← m'

   (``t = Σ_j e^{z_j - m} (z_j - m)``, re-referenced to the new maximum);
3. ``lse = m + log(s)``, ``log p_j = z_j - lse`` and the entropy ``H = log(s) - t/s`` (both
   terms are non-negative, so there is no cancellation).

Why it is invariant: every step is an elementwise IEEE operation (``+ - * /``), ``exp``/``log``
(same bits in vectorised and scalar code, guarded by a test), an exact ``max``, or
:func:`~rl_engine.utils.reductions.fixed_order_sum` over one block — so a row's result depends
only on that row and ``V``. Splitting the vocabulary into chunks whose boundaries are multiples
of ``B`` feeds exactly the same blocks in exactly the same order into step 2, so the fused
LM-head path (:mod:`rl_engine.backends.cpu.logprob`) reproduces the unfused path bit for bit.

Gradients (``g`` the upstream gradient of the fp32 output, ``p_j = exp(z_j - lse)``; the result
is divided by ``fl32(τ)`` in fp32 — skipped when τ = 1 — then rounded once to the logits dtype):

* token log-prob: ``dz_j = (−p_j)·g`` for ``j ≠ target``, ``dz_t = (1 − p_t)·g``;
* entropy: ``dz_j = (p_j · (max(log p_j, -FLT_MAX) + H)) · (−g)`` with ``p_j = exp(log p_j)``;
* log-softmax: ``dz_j = g_j − p_j · fixed_order_sum(g)``.

**Kept sets** (top-k / top-p records, :mod:`rl_engine.utils.kept`): the entries of ``z`` outside a
row's kept set are replaced by ``-inf`` before step 1 (:func:`mask_kept`; for a token log-prob
the row's target counts as kept), so every quantity above is that of the distribution
renormalised over the kept set, with the same order of operations; the gradient at a dropped
entry is ``+0`` (it cannot change any kept probability).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_engine.backends.cpu.common import TILE_N
from rl_engine.utils import portable
from rl_engine.utils.kept import keep_mask
from rl_engine.utils.reductions import fixed_order_sum

__all__ = [
    "VOCAB_BLOCK",
    "scale_logits",
    "mask_kept",
    "LseAccumulator",
    "block_stats",
    "LseResult",
    "grad_logprob",
    "grad_entropy",
    "grad_log_softmax",
    "finish_grad",
]

#: Vocabulary block of the canonical log-sum-exp (:data:`~rl_engine.backends.cpu.common.TILE_N`): a fused
#: LM head splits the vocabulary at multiples of it.
VOCAB_BLOCK = TILE_N
_NEG_MAX = -torch.finfo(torch.float32).max
_NEG_INF = float("-inf")


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``z = fl32(logits) / fl32(temperature)`` (fp32; no division when ``temperature == 1``).

    Dividing an fp32 tensor by a Python float divides by the float rounded to fp32, correctly
    rounded (tests check it against float64 division); ``x / 1`` is the identity, so skipping it
    changes no bit.
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return z


def mask_kept(z: torch.Tensor, start: int, threshold: torch.Tensor | None, boundary: torch.Tensor | None,
              targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(z', keep)``: ``z`` ``[R, L]`` (columns ``start ..``) with the entries outside each row's
    kept set set to ``-inf``, and the ``[R, L]`` keep mask — or ``(z, None)`` without a record.
    ``targets`` (token log-probs) are kept whatever their logit (:mod:`rl_engine.utils.kept`)."""
    if threshold is None:
        return z, None
    keep = keep_mask(z, start, threshold, boundary, targets)
    return z.masked_fill(~keep, float("-inf")), keep


def block_stats(z: torch.Tensor, *, entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Step 1 for every block of ``z`` ``[R, L]`` (columns starting at a block-aligned offset).

    Returns ``(m_b, s_b, t_b)``, each ``[R, ceil(L / VOCAB_BLOCK)]`` fp32 (``t_b`` ``None``
    without ``entropy``); a short last block is padded with ``-inf`` to :data:`VOCAB_BLOCK`
    columns. Each block's statistics depend only on that block of that row.
    """
    R, L = z.shape
    n_full = L // VOCAB_BLOCK
    parts = []
    if n_full:
        parts.append(z[:, : n_full * VOCAB_BLOCK].reshape(R, n_full, VOCAB_BLOCK))
    if L % VOCAB_BLOCK:
        tail = F.pad(z[:, n_full * VOCAB_BLOCK :], (0, VOCAB_BLOCK - L % VOCAB_BLOCK), value=_NEG_INF)
        parts.append(tail.reshape(R, 1, VOCAB_BLOCK))
    stats = [_block_stats(z3, entropy) for z3 in parts]
    if len(stats) == 1:
        return stats[0]
    if not stats:
        empty = z.new_empty((R, 0))
        return empty, empty, (empty if entropy else None)
    cat = lambda i: torch.cat([st[i] for st in stats], dim=1)  # noqa: E731
    return cat(0), cat(1), (cat(2) if entropy else None)


def _block_stats(z3: torch.Tensor, entropy: bool):
    # step 1 for all blocks at once (elementwise over rows and blocks)
    m_b = z3.amax(dim=-1) + 0.0  # + 0.0 turns a -0 maximum into +0
    shift = m_b.masked_fill(m_b == _NEG_INF, 0.0)
    d = z3 - shift.unsqueeze(-1)
    e = portable.exp(d)  # exp(-inf) = 0 for masked entries and padding
    s_b = fixed_order_sum(e)
    # clamp only for e·d (0 · -inf would be NaN); exp of -FLT_MAX is a slow path, so not before exp
    t_b = fixed_order_sum(e.mul_(d.clamp_min_(_NEG_MAX))) if entropy else None
    return m_b, s_b, t_b


class LseResult:
    """Finished statistics of a batch of rows: ``lse`` ``[R]`` and, if requested, ``entropy``."""

    __slots__ = ("lse", "entropy")

    def __init__(self, lse: torch.Tensor, entropy: torch.Tensor | None):
        self.lse = lse
        self.entropy = entropy


class LseAccumulator:
    """Running canonical (m, s, t) of ``rows`` rows, fed vocabulary chunks in order.

    ``update(z, start)`` takes fp32 scaled logits ``z`` ``[R, L]`` for vocabulary columns
    ``[start, start + L)``; ``start`` must be a multiple of :data:`VOCAB_BLOCK` and ``L`` a
    multiple of it unless the chunk ends the vocabulary. Chunks must arrive in increasing order.
    """

    def __init__(self, rows: int, *, entropy: bool, vocab_size: int):
        self.entropy = entropy
        self.vocab_size = vocab_size
        self._next = 0
        self.m = torch.full((rows,), _NEG_INF, dtype=torch.float32)
        self.s = torch.zeros(rows, dtype=torch.float32)
        self.t = torch.zeros(rows, dtype=torch.float32) if entropy else None

    def update(self, z: torch.Tensor, start: int) -> None:
        R, L = z.shape
        if start != self._next or start % VOCAB_BLOCK:
            raise ValueError(f"start: expected the next block-aligned offset {self._next}, got {start}")
        end = start + L
        if end != self.vocab_size and L % VOCAB_BLOCK:
            raise ValueError(f"z: a chunk that does not end the vocabulary must span whole blocks of {VOCAB_BLOCK}, got {L} columns")
        self._next = end
        self.merge_block_stats(*block_stats(z, entropy=self.entropy))

    def merge_block_stats(self, m_b: torch.Tensor, s_b: torch.Tensor, t_b: torch.Tensor | None) -> None:
        """Step 2: merge per-block statistics ``[R, nb]`` (from :func:`block_stats`) in block order.

        :meth:`update` is ``block_stats`` of the chunk followed by this; a caller that computed the
        statistics of the blocks elsewhere (e.g. on the ranks holding vocabulary shards) merges
        them here and accounts for the columns with :meth:`advance`.
        """
        for k in range(m_b.shape[1]):
            self._merge(m_b[:, k], s_b[:, k], t_b[:, k] if t_b is not None else None)

    def advance(self, columns: int) -> None:
        """Count ``columns`` vocabulary columns as merged (after :meth:`merge_block_stats`)."""
        self._next += columns

    def _merge(self, m_b: torch.Tensor, s_b: torch.Tensor, t_b: torch.Tensor | None) -> None:
        m, s = self.m, self.s
        m_new = torch.maximum(m, m_b)
        ref = m_new.masked_fill(m_new == _NEG_INF, 0.0)
        d_old = (m - ref).clamp_min_(_NEG_MAX)
        d_b = (m_b - ref).clamp_min_(_NEG_MAX)
        a_old = portable.exp(d_old)
        a_b = portable.exp(d_b)
        if self.t is not None:
            self.t = (a_old * self.t + (a_old * d_old) * s) + (a_b * t_b + (a_b * d_b) * s_b)
        self.s = s * a_old + s_b * a_b
        self.m = m_new

    def finish(self) -> LseResult:
        """Step 3: ``lse`` (and entropy). Rows with no finite logit get ``lse = -inf``."""
        if self._next != self.vocab_size:
            raise ValueError(f"vocabulary: accumulated {self._next} of {self.vocab_size} columns")
        log_s = portable.log(self.s)
        lse = self.m + log_s
        ent = log_s - self.t / self.s if self.t is not None else None
        return LseResult(lse, ent)


def grad_logprob(z: torch.Tensor, start: int, lse: torch.Tensor, targets: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``d logprob / d z`` times ``g`` for columns ``[start, start + L)`` of ``z`` ``[R, L]`` (fp32)."""
    R, L = z.shape
    p = portable.exp(z - lse.unsqueeze(1))
    dz = p.mul_(-g.unsqueeze(1))  # (-p)·g, the same bits as -(p·g)
    local = targets - start
    hit = (local >= 0) & (local < L)
    if bool(hit.any()):
        rows = torch.nonzero(hit).squeeze(1)
        cols = local[rows]
        p_t = portable.exp(z[rows, cols] - lse[rows])
        dz[rows, cols] = (1.0 - p_t) * g[rows]
    return dz


def grad_entropy(z: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``d H / d z`` times ``g`` for ``z`` ``[R, L]`` (any block of columns; fp32)."""
    logp = z - lse.unsqueeze(1)
    p = portable.exp(logp)
    logp.clamp_min_(_NEG_MAX)  # p = 0 where logp = -inf: keep p · (logp + H) at 0, not NaN
    return (p * logp.add_(entropy.unsqueeze(1))).mul_(-g.unsqueeze(1))


def grad_log_softmax(out: torch.Tensor, g: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """``d log_softmax / d z`` applied to ``g`` ``[R, V]``, with ``out`` the log-softmax (fp32).

    ``masked`` (a kept-set record was applied): an entry whose output is ``-inf`` (dropped, or a
    ``-inf`` logit) is a constant, so its upstream gradient is left out of ``Σ g`` and its own
    gradient is ``+0``."""
    if masked:
        g = g.float().masked_fill(torch.isneginf(out), 0.0)
    p = portable.exp(out)
    return g - p.mul_(fixed_order_sum(g.float()).unsqueeze(1))


def finish_grad(dz: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """``dz / fl32(τ)`` in fp32 (skipped for τ = 1), rounded once to ``dtype``."""
    if temperature != 1.0:
        dz = dz.div_(temperature)
    return dz.to(dtype)
