"""Align rollout and train log-probs by ``(sample_id, position)`` and compare raw bits.

Only *active* tokens are compared: positions whose train loss mask is 1 (response tokens).
Alignment never uses tensor indices: the rollout records the log-prob of the token it sampled
at ``position = len(prompt) + k``; the train scorer reports, per sample, the log-prob of the
token at each position (taken from the logits one position earlier).

Equality is raw-bit (:mod:`rl_engine.utils.bits`); ``max_abs_diff``, K3-KL and mean ``|Δp|``
are diagnostics that say *how far* two non-equal runs are, never whether they pass.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rl_engine.utils.bits import same_bits

__all__ = ["AlignedTokens", "Mismatch", "Comparison", "align", "compare", "bits_digest"]


@dataclass(frozen=True)
class AlignedTokens:
    """Parallel lists over active tokens: keys ``(sample_id, position)`` and both values."""

    keys: list[tuple[int, int]]
    rollout: torch.Tensor  # [N] fp32
    train: torch.Tensor  # [N] fp32


@dataclass(frozen=True)
class Mismatch:
    sample_id: int
    position: int
    rollout: float
    train: float


@dataclass(frozen=True)
class Comparison:
    """Outcome of one comparison (one train layout against the rollout)."""

    compared_tokens: int
    mismatched_tokens: int
    max_abs_diff: float
    first_mismatch: Mismatch | None
    k3_kl: float
    mean_abs_prob_diff: float

    @property
    def passed(self) -> bool:
        return self.compared_tokens > 0 and self.mismatched_tokens == 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def bits_digest(parts: Sequence[tuple[str, AlignedTokens]]) -> str:
    """sha256 of the raw bits of both sides' log-probs, in a fixed order: the parity digest.

    For each ``(name, aligned)`` in the given order: the name (UTF-8), then every aligned token
    in ``(sample_id, position)`` order as ``sample_id`` and ``position`` (int64 little-endian)
    followed by the rollout's and the train side's fp32 log-prob bits (uint32 little-endian).
    Two hosts that run the same ``rlk check`` command report the same digest exactly when every
    token, every position and every log-prob bit agree — so comparing one hex string compares
    a trainer host with a rollout host.
    """
    h = hashlib.sha256()
    for name, a in parts:
        h.update(name.encode())
        order = sorted(range(len(a.keys)), key=a.keys.__getitem__)
        keys = torch.tensor([a.keys[i] for i in order], dtype=torch.int64).reshape(-1, 2)
        idx = torch.tensor(order, dtype=torch.int64)
        r = a.rollout.detach().float().cpu()[idx].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        t = a.train.detach().float().cpu()[idx].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        rows = torch.cat([keys, r[:, None], t[:, None]], dim=1)
        for row in rows.tolist():
            h.update(struct.pack("<qqII", *row))
    return h.hexdigest()


def align(rollout: Mapping[int, Any], train: Mapping[int, Any]) -> AlignedTokens:
    """Pair each active train token with the rollout's recorded log-prob of the same token.

    Args:
        rollout: ``{sample_id: RolloutSample}`` (prompt, response, per-token log-probs).
        train: ``{sample_id: ScoredSequence}`` (per-position log-probs and active mask).

    Raises:
        ValueError: a sample is missing on one side, or an active train position has no
            rollout log-prob (it is not a sampled token).
    """
    missing = sorted(set(rollout) ^ set(train))
    if missing:
        raise ValueError(f"train: samples {missing[:5]} are present on only one side")
    keys, rv, tv = [], [], []
    for sid in sorted(train):
        r, t = rollout[sid], train[sid]
        n_prompt = len(r.prompt)
        rl = r.logprob_tensor()
        for pos in torch.nonzero(t.mask).flatten().tolist():
            k = pos - n_prompt
            if not 0 <= k < len(r.response):
                raise ValueError(f"train: active position {pos} of sample {sid} is not a sampled token")
            keys.append((sid, pos))
            rv.append(rl[k])
            tv.append(t.logprobs[pos].detach())
    empty = torch.empty(0, dtype=torch.float32)
    return AlignedTokens(keys, torch.stack(rv) if rv else empty, torch.stack(tv) if tv else empty)


def compare(aligned: AlignedTokens) -> Comparison:
    """Raw-bit comparison of aligned log-probs, plus K3-KL and mean ``|Δp|`` diagnostics.

    ``K3 = mean(exp(r) - 1 - r)`` with ``r = logp_train - logp_rollout`` (an unbiased estimate
    of KL(rollout ‖ train) from rollout samples); ``|Δp| = |exp(logp_rollout) - exp(logp_train)|``.
    """
    n = len(aligned.keys)
    if n == 0:
        return Comparison(0, 0, 0.0, None, 0.0, 0.0)
    r, t = aligned.rollout.cpu(), aligned.train.cpu()
    d = same_bits(r, t)
    first = None
    if not d.equal and d.first_index is not None:
        i = d.first_index[0]
        sid, pos = aligned.keys[i]
        first = Mismatch(sid, pos, float(r[i]), float(t[i]))
    rd, td = r.double(), t.double()
    lr = td - rd
    k3 = float((torch.exp(lr) - 1 - lr).mean())
    dp = float((torch.exp(rd) - torch.exp(td)).abs().mean())
    max_abs = d.max_abs_diff
    return Comparison(n, d.mismatched, float(max_abs) if math.isfinite(max_abs) else float("inf"), first, k3, dp)
