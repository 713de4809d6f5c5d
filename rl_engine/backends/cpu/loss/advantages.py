"""Outcome-advantage estimators (no gradients): GRPO, GRPO without std, RLOO, REINFORCE++-baseline.

Group statistics use :func:`~rl_engine.utils.reductions.segment_canonical_sum` (each
group's members summed in ascending-value order), batch statistics use per-sequence
:func:`row_sum_active` then :func:`canonical_sum`. Hence every advantage depends only on the
multiset of (group id, score) pairs and on the active-token counts — never on the order of the
batch, its padding or its split — and is identical run to run.
"""

from __future__ import annotations

import torch

from rl_engine.utils.reductions import canonical_sum, row_count_active, row_sum_active, segment_canonical_sum
from rl_engine.utils import portable

__all__ = ["ESTIMATORS", "DEFAULT_EPS", "advantages_portable"]

ESTIMATORS = ("grpo", "grpo_no_std", "rloo", "reinforce_pp_baseline")
#: Default ``eps`` per estimator: added to the group std (GRPO) / to the batch variance (REINFORCE++).
DEFAULT_EPS = {"grpo": 1e-6, "grpo_no_std": 0.0, "rloo": 0.0, "reinforce_pp_baseline": 1e-8}


@torch.no_grad()
def advantages_portable(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, estimator: str, eps: float) -> torch.Tensor:
    """Token advantages ``[B, L]`` (fp32, ``+0.0`` off-mask) from sequence scores ``[B]``."""
    s = scores.float()
    sums, counts, inverse = segment_canonical_sum(s, group_ids)
    n = counts.to(torch.float32)
    mean = sums / n
    dev = s - mean[inverse]  # exactly 0 for a singleton group
    zero = torch.zeros((), dtype=torch.float32, device=s.device)
    if estimator == "grpo":
        sq, _, _ = segment_canonical_sum(dev * dev, group_ids)
        var = torch.where(n > 1, sq / torch.clamp(n - 1.0, min=1.0), zero)
        den = portable.sqrt(var)[inverse] + eps
        adv = torch.where(den > 0, dev / torch.where(den > 0, den, 1.0), zero)  # eps = 0 and a flat group: 0
    elif estimator == "grpo_no_std":
        adv = dev
    elif estimator == "rloo":
        adv = dev * (n / (n - 1.0))[inverse]
    elif estimator == "reinforce_pp_baseline":
        x = dev[:, None].expand(mask.shape)
        total = row_count_active(mask)
        N = canonical_sum(total)
        mu = torch.where(N > 0, canonical_sum(row_sum_active(x, mask)) / torch.clamp(N, min=1.0), zero)
        c = x - mu
        ss = canonical_sum(row_sum_active(c * c, mask))
        var = torch.where(N > 1, ss / torch.clamp(N - 1.0, min=1.0), zero)
        return torch.where(mask, c / portable.sqrt(var + eps), zero)
    else:  # validated by the operator layer
        raise ValueError(f"estimator: expected one of {ESTIMATORS}, got {estimator!r}")
    return torch.where(mask, adv[:, None], zero)
