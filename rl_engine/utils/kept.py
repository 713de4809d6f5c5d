"""The kept-set record of a top-k / top-p sampling step: its definition, shared by every layer.

A sampler that filters the distribution (top-k, top-p) samples from the tokens it *keeps*; the
log-prob of the sampled token under the distribution it was drawn from is renormalised over that
kept set. The trainer can replay that log-prob only if it knows the kept set exactly. The
record is two numbers per sampled token:

* ``threshold`` (float32): the scaled logit ``z_b`` of the **boundary token** ``b``, the last
  kept token in the canonical order;
* ``boundary`` (int32 or int64): that token's id ``b``.

The **canonical order** of a row of scaled logits ``z = fl32(logits) / fl32(τ)`` sorts the
vocabulary by ``z`` descending, ties by ascending token id. Every kept set of a top-k / top-p
filter is a prefix of it (``rl_engine.ops.logprob.kept``), so the prefix is given by its last
element, and token ``j`` is kept exactly when it sorts at or before ``b``:

.. math:: \\mathrm{keep}_j \\iff z_j > z_b \\;\\lor\\; (z_j = z_b \\land j \\le b)

— an elementwise test on ``(z_j, j)`` that any vocabulary chunk can apply on its own (absolute
column ids), so a fused, chunked LM head reproduces the same set. ``+0`` and ``-0`` compare
equal, as in the sort.

Why this record and not another: a packed bit mask costs ``V / 8`` bytes per token (19 KB at
``V = 151 936``); ``(k, logit threshold)`` alone cannot say which of several tokens tied at the
threshold were kept (bf16 logits tie often). ``(threshold, boundary)`` is 8 bytes and exact.

The record that keeps everything is ``threshold = -inf``, ``boundary =`` :data:`KEEP_ALL_BOUNDARY`
(every finite ``z`` is above ``-inf``; a ``-inf`` logit ties and its id is below the bound).

**The sampled token is always counted.** A token log-prob replays its record over the kept set
together with the target token itself (``targets`` of :func:`keep_mask`): the token was drawn
from the kept set, so on the rollout's own logits this adds nothing; on logits that drifted from
the rollout's (another engine, a planted fault) the boundary may move past the target, and the
log-prob stays that of a distribution holding it — finite, with the drift visible as a different
value, never an empty set.
"""

from __future__ import annotations

import torch

__all__ = ["KEEP_ALL_BOUNDARY", "keep_mask", "masked_scaled_logits"]

#: ``boundary`` of the record that keeps every token (the largest int32, above any token id).
KEEP_ALL_BOUNDARY = 2**31 - 1


def keep_mask(z: torch.Tensor, start: int, threshold: torch.Tensor, boundary: torch.Tensor,
              targets: torch.Tensor | None = None) -> torch.Tensor:
    """Which entries of ``z`` ``[R, L]`` (vocabulary columns ``start .. start + L - 1``) are kept.

    Args:
        z: scaled logits of ``R`` rows, any float dtype (compared exactly).
        start: the absolute token id of column 0.
        threshold: ``[R]`` float32, the boundary token's scaled logit.
        boundary: ``[R]`` int, the boundary token's id.
        targets: ``[R]`` token ids counted as kept whatever their logit (the sampled tokens of
            a token log-prob), or ``None``.

    Returns:
        ``[R, L]`` bool: ``z > threshold or (z == threshold and id <= boundary)`` (``or id ==
        target``).
    """
    ids = torch.arange(start, start + z.shape[-1], device=z.device, dtype=torch.int64)
    thr = threshold.to(z.dtype).unsqueeze(-1)
    keep = (z > thr) | ((z == thr) & (ids <= boundary.to(torch.int64).unsqueeze(-1)))
    if targets is not None:
        keep |= ids == targets.to(torch.int64).unsqueeze(-1)
    return keep


def masked_scaled_logits(z: torch.Tensor, start: int, threshold: torch.Tensor | None,
                         boundary: torch.Tensor | None, targets: torch.Tensor | None = None) -> torch.Tensor:
    """``z`` with the entries outside the kept set (and not a target) replaced by ``-inf`` (``z``
    itself when no record is given). The canonical log-sum-exp of the result is the
    log-normaliser of the distribution renormalised over the kept set."""
    if threshold is None:
        return z
    return z.masked_fill(~keep_mask(z, start, threshold, boundary, targets), float("-inf"))
