"""Rollout correction for users who cannot yet run bitwise: TIS weights, MIS rejection, veto,
and the mismatch metrics (verl's names) plus the exact ``mismatched_tokens`` count.

All token means are ``canonical_sum(row_sum_active(x, mask)) / N`` and all sequence means
``canonical_sum(v[active sequences]) / S``: functions of the multiset of sequences, independent
of batch order, padding and split. Token-level weights and masks are elementwise (row invariant);
sequence-level ones use :func:`row_sum_active` (row and padding invariant).
"""

from __future__ import annotations

import math

import torch

from rl_engine.utils.reductions import canonical_sum, row_count_active, row_sum_active
from rl_engine.backends.cpu.loss.token import LOG_RATIO_CLAMP
from rl_engine.utils.bits import int_view
from rl_engine.utils import portable

__all__ = ["IS_LEVELS", "RS_LEVELS", "SAFETY_EPS", "rollout_correction_portable"]

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
#: Added to the mean weight before normalising it for the effective sample size (as verl).
SAFETY_EPS = 1e-8


def _exp_clamped(x: torch.Tensor) -> torch.Tensor:
    return portable.exp(x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


@torch.no_grad()
def rollout_correction_portable(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    is_level: str | None,
    is_threshold: float,
    rs_level: str | None,
    rs_threshold: float | None,
    rs_threshold_lower: float | None,
    veto_threshold: float | None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """``(is_weights [B, L] fp32 or None, corrected mask [B, L] bool, metrics)``; see the operator."""
    dev = log_probs.device
    f32 = torch.float32
    nan = torch.full((), float("nan"), dtype=f32, device=dev)
    zero = torch.zeros((), dtype=f32, device=dev)
    lp, rl = log_probs.float(), rollout_log_probs.float()
    lr = lp - rl  # log(π_train / π_rollout)
    n_b = row_count_active(mask)
    seq_active = n_b > 0
    seq_lr = row_sum_active(lr, mask)
    N, S = canonical_sum(torch.stack([n_b, seq_active.to(f32)])).unbind()
    have = N > 0
    Nc, Sc = torch.clamp(N, min=1.0), torch.clamp(S, min=1.0)

    def tok_sums(*xs: torch.Tensor) -> list[torch.Tensor]:
        """Sums over active tokens of several ``[B, L]`` quantities, one batched fixed-order pass."""
        return list(canonical_sum(row_sum_active(torch.stack(xs), mask)).unbind())

    def tok_means(*xs: torch.Tensor) -> list[torch.Tensor]:
        return [torch.where(have, v / Nc, nan) for v in tok_sums(*xs)]

    def over_active(x: torch.Tensor, fill: float, reduce) -> torch.Tensor:
        if x.numel() == 0:
            return nan
        return torch.where(have, reduce(torch.where(mask, x, torch.full((), fill, dtype=f32, device=dev))), nan)

    m: dict[str, torch.Tensor] = {}
    m["active_tokens"] = mask.sum().to(torch.int64)
    # -- exact mismatch: raw bits of the two log-prob tensors on active tokens
    differ = int_view(log_probs) != int_view(rollout_log_probs)
    differ = differ | torch.isnan(log_probs) | torch.isnan(rollout_log_probs)
    m["mismatched_tokens"] = (differ & mask).sum().to(torch.int64)
    m["mismatched_token_fraction"] = torch.where(have, m["mismatched_tokens"].to(f32) / Nc, nan)
    # -- IS weights (before truncation), clamped copies for std / ESS
    rho = _exp_clamped(lr)
    level = is_level or "token"
    if level == "token":
        w = rho
        m["rollout_is_max"] = over_active(w, float("-inf"), torch.amax)
        m["rollout_is_min"] = over_active(w, float("inf"), torch.amin)
    else:
        w = _exp_clamped(seq_lr)[:, None].expand(lr.shape)
        if lr.shape[0]:
            lmax = torch.where(seq_active, seq_lr, torch.full((), float("-inf"), dtype=f32, device=dev)).amax()
            lmin = torch.where(seq_active, seq_lr, torch.full((), float("inf"), dtype=f32, device=dev)).amin()
            m["rollout_is_max"] = torch.where(have, portable.exp(torch.clamp(lmax, max=LOG_RATIO_CLAMP)), nan)
            m["rollout_is_min"] = torch.where(have, portable.exp(lmin), nan)
        else:
            m["rollout_is_max"] = m["rollout_is_min"] = nan
    wc = w.clamp(1.0 / is_threshold, is_threshold)
    p_diff = torch.abs(portable.exp(rl) - portable.exp(lp))
    kl, k3, rho2, pd_mean, w_mean, wc_mean, wc2_mean = tok_means(
        -lr, (portable.exp(lr) - lr) - 1.0, rho * rho, p_diff, w, wc, wc * wc
    )
    c = p_diff - pd_mean
    wn = wc / (wc_mean + SAFETY_EPS)
    ss, wn2_sum = tok_sums(c * c, wn * wn)
    # -- off-policy metrics
    m["kl"] = kl
    m["k3_kl"] = k3
    m["chi2_token"] = rho2 - 1.0
    rho_seq = portable.exp(2.0 * seq_lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    m["chi2_seq"] = torch.where(have, canonical_sum(torch.where(seq_active, rho_seq, zero)) / Sc, nan) - 1.0
    m["rollout_probs_diff_mean"] = pd_mean
    m["rollout_probs_diff_max"] = over_active(p_diff, float("-inf"), torch.amax)
    m["rollout_probs_diff_std"] = torch.where(N > 1, portable.sqrt(ss / torch.clamp(N - 1.0, min=1.0)), torch.where(have, zero, nan))
    m["rollout_is_mean"] = w_mean
    var_c = wc2_mean - wc_mean * wc_mean
    m["rollout_is_std"] = torch.where(N > 1, portable.sqrt(torch.clamp(var_c, min=0.0)), torch.where(have, zero, nan))
    m["rollout_is_eff_sample_size"] = torch.where(have, 1.0 / (wn2_sum / Nc), nan)
    weights = None
    if is_level is not None:
        weights = torch.where(mask, torch.clamp(w, max=is_threshold), zero)
    # -- rejection (MIS) and veto
    new_mask = mask
    if rs_level is not None:
        upper = float(rs_threshold)
        lower = float(rs_threshold_lower) if rs_threshold_lower is not None else 1.0 / upper
        if rs_level == "token":
            v = rho
        elif rs_level == "sequence":
            v = _exp_clamped(seq_lr)[:, None].expand(lr.shape)
        else:  # geometric
            v = _exp_clamped(seq_lr / torch.clamp(n_b, min=1.0))[:, None].expand(lr.shape)
        keep = (v >= lower) & (v <= upper)
        rejected = mask & ~keep
        m["rollout_rs_masked_fraction"] = torch.where(have, rejected.sum().to(f32) / Nc, nan)
        m["rollout_rs_seq_masked_fraction"] = torch.where(have, rejected.any(-1).sum().to(f32) / Sc, nan)
        new_mask = new_mask & keep
    if veto_threshold is not None:
        catastrophic = mask & (lr < math.log(veto_threshold))
        vetoed = catastrophic.any(-1)
        m["rollout_is_veto_fraction"] = torch.where(have, vetoed.sum().to(f32) / Sc, nan)
        m["rollout_is_catastrophic_token_fraction"] = torch.where(have, catastrophic.sum().to(f32) / Nc, nan)
        new_mask = new_mask & ~vetoed[:, None]
    return weights, new_mask, m
