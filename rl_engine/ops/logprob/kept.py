r"""Top-k / top-p kept sets: the canonical filter and the per-token record the trainer replays.

**The record** (:class:`KeptSet`, semantics in :mod:`rl_engine.utils.kept`): per sampled token
the scaled logit ``threshold`` and the id ``boundary`` of the last kept token in the canonical
order (``z`` descending, ties by ascending id); token ``j`` is kept iff
``z_j > threshold or (z_j == threshold and j <= boundary)``. Eight bytes per token, exact.

**The canonical filter** (:func:`canonical_prefix`), one definition for every rollout engine
rl_engine drives (the reference executor, HF ``generate``, the vLLM plugin). For a row of scaled
logits ``z = fl32(logits) / fl32(τ)`` (``[V]``, fp32), top-k ``k`` (``0`` or ``≥ V``: off) and
top-p ``p`` (``≥ 1``: off):

1. the canonical order ``π``: ``z`` sorted descending, stable (ties by ascending id);
2. weights ``w_i = exp(z_{π_i} − z_{π_1})`` in float64 (:func:`rl_engine.utils.portable.exp`:
   the same bits on every CPU), ``c_i = w_1 + … + w_i`` summed sequentially in float64;
3. ``n_k = k`` (``V`` when off); ``n = n_k`` when top-p is off, else the shortest prefix whose
   mass reaches ``p`` of the top-k mass: ``n = 1 + #{i < n_k : c_i < p · c_{n_k}}`` — top-p is
   applied to the top-k-renormalised distribution, as vLLM and HF ``generate`` apply it;
4. kept = the first ``n`` tokens of ``π``; the record is ``(z_{π_n}, π_n)``, or the keep-all
   record when ``n = V``.

Top-k keeps exactly ``k`` tokens (a tie at the ``k``-th value is broken by id), where vLLM and
HF keep every tied token; the prefix rule is what makes an 8-byte record exact. Every step is
an IEEE operation on one row in a fixed order, so a row's kept set depends on that row, ``k``
and ``p`` only — not on the batch, the device, the thread count or the instruction set (the
float64 arithmetic runs on the CPU).

The log-prob of a sampled token under the distribution it was drawn from (the *processed*
log-prob) is ``z_t − log Σ_{j kept} e^{z_j}``: ``rl_engine.ops.logprob.token_logprobs(logits,
t, τ, kept=record)`` computes it with the canonical log-sum-exp over the kept entries, as do
``linear_token_logprobs`` (fused, chunked), ``log_softmax`` and ``entropy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rl_engine.utils import portable
from rl_engine.utils.kept import KEEP_ALL_BOUNDARY, keep_mask

__all__ = ["KeptSet", "KeptPrefix", "KEEP_ALL_BOUNDARY", "scale_logits", "canonical_prefix", "kept_set"]


@dataclass(frozen=True)
class KeptSet:
    """Kept-set records of a batch of sampled tokens (any leading shape ``[...]``).

    Attributes:
        threshold: ``[...]`` float32, the scaled logit of each token's boundary token.
        boundary: ``[...]`` int32 or int64, the boundary token's id (:data:`KEEP_ALL_BOUNDARY`
            with ``threshold = -inf``: the whole vocabulary is kept).
    """

    threshold: torch.Tensor
    boundary: torch.Tensor

    @classmethod
    def everything(cls, shape: Sequence[int] | torch.Size = (), device: torch.device | str = "cpu") -> "KeptSet":
        """Records that keep the whole vocabulary (the full distribution), of shape ``shape``."""
        return cls(torch.full(tuple(shape), float("-inf"), dtype=torch.float32, device=device),
                   torch.full(tuple(shape), KEEP_ALL_BOUNDARY, dtype=torch.int32, device=device))

    @classmethod
    def stack(cls, parts: Sequence["KeptSet"], dim: int = 0) -> "KeptSet":
        """Stack records of equal shape (e.g. one 0-d record per step → ``[steps]``)."""
        if not parts:
            raise ValueError("parts: expected at least one KeptSet to stack")
        return cls(torch.stack([p.threshold for p in parts], dim), torch.stack([p.boundary.to(torch.int32) for p in parts], dim))

    @classmethod
    def cat(cls, parts: Sequence["KeptSet"], dim: int = 0) -> "KeptSet":
        if not parts:
            raise ValueError("parts: expected at least one KeptSet to concatenate")
        return cls(torch.cat([p.threshold for p in parts], dim), torch.cat([p.boundary.to(torch.int32) for p in parts], dim))

    @property
    def shape(self) -> torch.Size:
        return self.threshold.shape

    def __getitem__(self, index) -> "KeptSet":
        return KeptSet(self.threshold[index], self.boundary[index])

    def reshape(self, *shape: int) -> "KeptSet":
        return KeptSet(self.threshold.reshape(*shape), self.boundary.reshape(*shape))

    def contiguous(self) -> "KeptSet":
        return KeptSet(self.threshold.contiguous(), self.boundary.contiguous())

    def to(self, device: torch.device | str) -> "KeptSet":
        return KeptSet(self.threshold.to(device), self.boundary.to(device))

    def keeps_everything(self) -> torch.Tensor:
        """``[...]`` bool: which records are the keep-all record."""
        return torch.isneginf(self.threshold) & (self.boundary.to(torch.int64) == KEEP_ALL_BOUNDARY)

    def mask(self, z: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``[..., L]`` bool: the kept entries of scaled logits ``z`` ``[..., L]`` (columns
        ``start ..``), with ``self`` of shape ``z.shape[:-1]``."""
        lead = z.shape[:-1]
        if tuple(self.shape) != tuple(lead):
            raise ValueError(f"kept: expected records of shape {tuple(lead)} (the leading dims of z), got {tuple(self.shape)}")
        m = keep_mask(z.reshape(-1, z.shape[-1]), start, self.threshold.reshape(-1).to(z.device),
                      self.boundary.reshape(-1).to(z.device))
        return m.reshape(z.shape)


class KeptPrefix(NamedTuple):
    """The canonical filter of ``R`` rows (:func:`canonical_prefix`), on the CPU.

    Attributes:
        order: ``[R, V]`` int64, the canonical order (token ids).
        cumulative: ``[R, V]`` float64, the sequential running sums ``c`` of the weights in that order.
        count: ``[R]`` int64, the kept prefix length ``n``.
        kept: the records ``[R]``.
    """

    order: torch.Tensor
    cumulative: torch.Tensor
    count: torch.Tensor
    kept: KeptSet


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``z = fl32(logits) / fl32(τ)``: fp32, one correctly rounded division (none when ``τ = 1``)
    — the values every rl_engine log-prob and the canonical filter read (the Triton kernels'
    ``div_rn``, the CPU backend's division).

    On the CPU, ``tensor / float`` divides by the float rounded to fp32, correctly rounded. On a
    GPU, torch divides by a host scalar through its reciprocal (``x · fl(1/τ)``, not correctly
    rounded), so the divisor is a device tensor there: an IEEE division per element. It is made by
    a fill on the device (``torch.tensor(τ, device=...)`` would copy from pageable host memory and
    wait for the device).
    """
    z = logits.float()
    t = float(temperature)
    if t == 1.0:
        return z
    if z.device.type == "cpu":
        return z / t
    return z / torch.full((), t, dtype=torch.float32, device=z.device)


def _per_row(name: str, value, rows: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu", dtype).reshape(-1)
        if t.numel() == 1:
            t = t.expand(rows)
        if t.numel() != rows:
            raise ValueError(f"{name}: expected a number or {rows} values (one per row), got shape {tuple(value.shape)}")
        return t
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number or a tensor, got {type(value).__name__}")
    return torch.full((rows,), value, dtype=dtype)


def canonical_prefix(z: torch.Tensor, top_k: int | torch.Tensor = 0, top_p: float | torch.Tensor = 1.0) -> KeptPrefix:
    """The canonical top-k / top-p filter of scaled logits ``z`` ``[R, V]`` (module docstring).

    Args:
        z: scaled logits (``scale_logits``), float32, any device (copied to the CPU).
        top_k: an int or ``[R]`` ints; ``<= 0`` or ``>= V`` turns top-k off.
        top_p: a float or ``[R]`` floats in ``(0, 1]``; ``>= 1`` turns top-p off.

    Raises:
        ValueError: ``z`` is not 2-d float32 with ``V >= 1``, holds NaN or ``+inf``, a row has
            no finite entry, or a ``top_p`` is not in ``(0, 1]``.
    """
    if not isinstance(z, torch.Tensor) or z.dim() != 2 or z.dtype != torch.float32 or z.shape[1] == 0:
        raise ValueError(f"z: expected float32 scaled logits [R, V] with V >= 1, got "
                         f"{getattr(z, 'dtype', type(z).__name__)} {tuple(getattr(z, 'shape', ()))}")
    zc = z.detach().to("cpu")
    R, V = zc.shape
    if bool(torch.isnan(zc).any()) or bool(torch.isposinf(zc).any()):
        raise ValueError("z: the scaled logits hold NaN or +inf; no distribution to filter")
    k = _per_row("top_k", top_k, R, torch.int64)
    p = _per_row("top_p", top_p, R, torch.float64)
    if bool(((p <= 0) | torch.isnan(p)).any()) or bool((p > 1).any()):
        raise ValueError(f"top_p: expected values in (0, 1], got {p[(p <= 0) | (p > 1) | torch.isnan(p)][:3].tolist()}")
    zs, order = torch.sort(zc, dim=1, descending=True, stable=True)
    z64 = zs.to(torch.float64)
    top = z64[:, :1]
    if bool(torch.isneginf(top).any()):
        raise ValueError(f"z: rows {torch.nonzero(torch.isneginf(top[:, 0]))[:8, 0].tolist()} have no finite entry")
    cum = torch.cumsum(portable.exp(z64 - top), dim=1)
    n_k = torch.where((k <= 0) | (k >= V), V, k)
    tot = cum.gather(1, (n_k - 1).unsqueeze(1))
    below = (cum < p.unsqueeze(1) * tot) & (torch.arange(V).unsqueeze(0) < n_k.unsqueeze(1))
    n = torch.where(p >= 1.0, n_k, below.sum(1) + 1)
    last = (n - 1).unsqueeze(1)
    thr = zs.gather(1, last).squeeze(1)
    bnd = order.gather(1, last).squeeze(1).to(torch.int32)
    full = n == V
    kept = KeptSet(torch.where(full, float("-inf"), thr), torch.where(full, KEEP_ALL_BOUNDARY, bnd).to(torch.int32))
    return KeptPrefix(order, cum, n, kept)


def kept_set(logits: torch.Tensor, temperature: float = 1.0, top_k: int | torch.Tensor = 0,
             top_p: float | torch.Tensor = 1.0) -> KeptSet:
    """The kept-set records of rows of ``logits`` ``[..., V]`` under the canonical filter at
    ``temperature`` (records ``[...]``, on ``logits``' device). ``top_k`` / ``top_p`` as in
    :func:`canonical_prefix` (per-row tensors of shape ``[...]`` flattened)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError(f"logits: expected a tensor [..., V], got {type(logits).__name__}")
    lead = logits.shape[:-1]
    rows = logits.detach().reshape(-1, logits.shape[-1]).to("cpu")
    pre = canonical_prefix(scale_logits(rows, temperature), top_k, top_p)
    return pre.kept.reshape(*lead).to(logits.device)
