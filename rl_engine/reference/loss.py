"""References for the ``loss.*`` operators: the formulas of docs/operators/losses.md in float64.

Same signatures as the kernels the operators dispatch to (per-sequence outputs; the operator
layer forms the scalar loss). Plain ``torch.sum`` in float64 and autograd for gradients: the
mathematical ground truth, with no invariance promise. ``*_f64`` return float64; the registered
references (the diagnostic fallback) return what the kernels return (float32 / bool).
"""

from __future__ import annotations

import math

import torch

from rl_engine.runtime.registry import register_reference

CLAMP = 20.0  # log-ratio clamp before exp, as in the kernels


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)


def policy_f64(log_probs, old_log_probs, advantages, mask, is_weights, kind, eps_low, eps_high, dual_clip):
    r"""Per-sequence ``Σ_t m_t ℓ_t`` and statistics, float64.

    * ``ppo_clip``: :math:`r_t = e^{\log\pi_t - \log\pi^{old}_t}`,
      :math:`ℓ_t = \max(-A_t r_t, -A_t\,\mathrm{clip}(r_t, 1-ε_l, 1+ε_h))`; dual clip ``c``:
      :math:`ℓ_t = \min(ℓ_t, -c A_t)` where :math:`A_t < 0`.
    * ``gspo``: :math:`s = \exp(\frac{1}{n}\sum_t m_t(\log\pi_t - \log\pi^{old}_t))` per
      sequence; :math:`ℓ_t = \max(-A_t s_t, -A_t\,\mathrm{clip}(s_t, 1-ε_l, 1+ε_h))` with
      :math:`s_t = \mathrm{sg}(s)\,\pi_t/\mathrm{sg}(\pi_t)` (GSPO-token).
    * ``cispo``: :math:`ℓ_t = -\mathrm{sg}(\mathrm{clip}(r_t, 1-ε_l, 1+ε_h))\,A_t \log\pi_t`.
    """
    lp = log_probs.double()
    d = lp - old_log_probs.double()
    adv = advantages.double()
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    n = mask.sum(-1).double()
    if kind == "gspo":
        seq_d = _masked_sum(d, mask) / n.clamp(min=1.0)
        s = torch.exp(seq_d.clamp(-CLAMP, CLAMP))
        in_range = ((seq_d >= -CLAMP) & (seq_d <= CLAMP)).double()[:, None]
        ratio = s.detach()[:, None] * torch.exp((lp - lp.detach()) * in_range)
        ratio_val = s.detach()[:, None].expand_as(d)
    else:
        ratio = torch.exp(d.clamp(-CLAMP, CLAMP))
        ratio_val = ratio.detach()
    clipped_ratio = ratio.clamp(lo, hi)
    dual = torch.zeros_like(mask)
    if kind == "cispo":
        loss = -clipped_ratio.detach() * adv * lp
        clipped_low, clipped_high = ratio_val < lo, ratio_val > hi
    else:
        pg1, pg2 = -adv * ratio, -adv * clipped_ratio
        loss = torch.maximum(pg1, pg2)
        clipped = (pg2 > pg1).detach()
        clipped_low, clipped_high = clipped & (adv < 0), clipped & (adv > 0)
        if dual_clip is not None:
            pg3 = -adv * dual_clip
            dual = ((adv < 0) & (pg3 < loss)).detach()
            loss = torch.where(adv < 0, torch.minimum(loss, pg3), loss)
    if is_weights is not None:
        loss = loss * is_weights.double()
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    stats = torch.stack(
        [
            n,
            (clipped_low & mask).sum(-1).double(),
            (clipped_high & mask).sum(-1).double(),
            (dual & mask).sum(-1).double(),
            _masked_sum(ratio_val, mask),
            torch.where(mask, ratio_val, inf).amin(-1) if d.shape[-1] else n.new_full(n.shape, float("inf")),
            torch.where(mask, ratio_val, -inf).amax(-1) if d.shape[-1] else n.new_full(n.shape, float("-inf")),
            _masked_sum(d.detach(), mask),
        ],
        dim=-1,
    )
    return _masked_sum(loss, mask), stats


@register_reference("loss.policy")
def policy(log_probs, old_log_probs, advantages, mask, is_weights, kind, eps_low, eps_high, dual_clip):
    seq, stats = policy_f64(log_probs, old_log_probs, advantages, mask, is_weights, kind, eps_low, eps_high, dual_clip)
    return seq.float(), stats.float()


def kl_f64(log_probs, ref_log_probs, mask, estimator):
    r"""Schulman's estimators of :math:`KL(\pi\,\|\,\pi_{ref})` per token, summed per sequence.

    With :math:`\log\rho_t = \log\pi_{ref,t} - \log\pi_t`: ``k1`` :math:`= -\log\rho`, ``k2``
    :math:`= \tfrac12(\log\rho)^2`, ``k3`` :math:`= (\rho - 1) - \log\rho` (``log ρ`` clamped to ±20
    inside ``exp``).
    """
    u = ref_log_probs.double() - log_probs.double()
    if estimator == "k1":
        val = -u
    elif estimator == "k2":
        val = 0.5 * u * u
    else:
        val = (torch.exp(u.clamp(-CLAMP, CLAMP)) - 1.0) - u
    return _masked_sum(val, mask), mask.sum(-1).double()


@register_reference("loss.kl")
def kl(log_probs, ref_log_probs, mask, estimator):
    seq, n = kl_f64(log_probs, ref_log_probs, mask, estimator)
    return seq.float(), n.float()


def masked_row_sum_f64(values, mask):
    return _masked_sum(values.double(), mask), mask.sum(-1).double()


@register_reference("loss.aggregate")
def masked_row_sum(values, mask):
    seq, n = masked_row_sum_f64(values, mask)
    return seq.float(), n.float()


def advantages_f64(scores, group_ids, mask, estimator, eps):
    r"""Outcome advantages per sequence, broadcast to active tokens (float64).

    Group ``g`` of size ``n`` with mean :math:`\bar s_g` and unbiased std :math:`σ_g`:
    ``grpo`` :math:`(s_i - \bar s_g)/(σ_g + ε)`; ``grpo_no_std`` :math:`s_i - \bar s_g`;
    ``rloo`` :math:`\frac{n}{n-1}(s_i - \bar s_g)`; ``reinforce_pp_baseline``: :math:`a_i = s_i -
    \bar s_g` on every active token, then whitened over all active tokens of the batch:
    :math:`(a - μ)/\sqrt{σ^2 + ε}` (unbiased token variance). Singleton groups give 0.
    """
    s = scores.double()
    adv = torch.zeros_like(s)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        grp = s[idx]
        n = grp.numel()
        dev = grp - grp.mean()
        if n == 1:
            dev = torch.zeros_like(grp)
        if estimator == "grpo":
            std = grp.std() if n > 1 else torch.zeros((), dtype=torch.float64)
            den = std + eps
            adv[idx] = dev / den if den > 0 else torch.zeros_like(dev)
        elif estimator == "rloo":
            adv[idx] = dev * n / (n - 1)
        else:
            adv[idx] = dev
    tok = torch.where(mask, adv[:, None], torch.zeros((), dtype=torch.float64))
    if estimator != "reinforce_pp_baseline":
        return tok
    vals = adv[:, None].expand(mask.shape)[mask]
    if vals.numel() == 0:
        return tok
    mu = vals.mean()
    var = vals.var() if vals.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return torch.where(mask, (adv[:, None] - mu) / torch.sqrt(var + eps), torch.zeros((), dtype=torch.float64))


@register_reference("loss.advantages")
def advantages(scores, group_ids, mask, estimator, eps):
    return advantages_f64(scores, group_ids, mask, estimator, eps).float()


def rollout_correction_f64(log_probs, rollout_log_probs, mask, is_level, is_threshold, rs_level, rs_threshold, rs_threshold_lower, veto_threshold):
    """TIS weights, MIS/veto mask and mismatch metrics in float64 (see docs/operators/losses.md)."""
    f = torch.float64
    lp, rl = log_probs.double(), rollout_log_probs.double()
    lr = lp - rl
    act = lr[mask]
    N = act.numel()
    seq_active = mask.any(-1)
    seq_lr = _masked_sum(lr, mask)
    nan = torch.tensor(float("nan"), dtype=f)

    def tmean(x):
        return x[mask].mean() if N else nan

    m = {"active_tokens": torch.tensor(N)}
    m["mismatched_tokens"] = ((log_probs != rollout_log_probs) & mask).sum()
    m["mismatched_token_fraction"] = m["mismatched_tokens"].double() / N if N else nan
    m["kl"] = tmean(-lr)
    m["k3_kl"] = tmean(torch.exp(lr) - lr - 1.0)
    rho = torch.exp(lr.clamp(-CLAMP, CLAMP))
    m["chi2_token"] = tmean(rho**2) - 1.0
    m["chi2_seq"] = (torch.exp(2.0 * seq_lr.clamp(-CLAMP, CLAMP))[seq_active].mean() - 1.0) if N else nan
    pd = (torch.exp(rl) - torch.exp(lp)).abs()
    m["rollout_probs_diff_mean"] = tmean(pd)
    m["rollout_probs_diff_max"] = pd[mask].max() if N else nan
    m["rollout_probs_diff_std"] = (pd[mask].std() if N > 1 else torch.zeros((), dtype=f)) if N else nan
    level = is_level or "token"
    if level == "token":
        w = rho
        m["rollout_is_max"] = w[mask].max() if N else nan
        m["rollout_is_min"] = w[mask].min() if N else nan
    else:
        w = torch.exp(seq_lr.clamp(-CLAMP, CLAMP))[:, None].expand(lr.shape)
        m["rollout_is_max"] = torch.exp(seq_lr[seq_active].max().clamp(max=CLAMP)) if N else nan
        m["rollout_is_min"] = torch.exp(seq_lr[seq_active].min()) if N else nan
    m["rollout_is_mean"] = tmean(w)
    wc = w.clamp(1.0 / is_threshold, is_threshold)
    mc = tmean(wc)
    m["rollout_is_std"] = (torch.sqrt(torch.clamp(tmean(wc**2) - mc**2, min=0.0)) if N > 1 else torch.zeros((), dtype=f)) if N else nan
    m["rollout_is_eff_sample_size"] = 1.0 / tmean((wc / (mc + 1e-8)) ** 2)
    weights = torch.where(mask, w.clamp(max=is_threshold), torch.zeros((), dtype=f)) if is_level is not None else None
    new_mask = mask.clone()
    S = int(seq_active.sum())
    if rs_level is not None:
        lower = rs_threshold_lower if rs_threshold_lower is not None else 1.0 / rs_threshold
        if rs_level == "token":
            v = rho
        elif rs_level == "sequence":
            v = torch.exp(seq_lr.clamp(-CLAMP, CLAMP))[:, None].expand(lr.shape)
        else:
            v = torch.exp((seq_lr / mask.sum(-1).clamp(min=1)).clamp(-CLAMP, CLAMP))[:, None].expand(lr.shape)
        rejected = mask & ~((v >= lower) & (v <= rs_threshold))
        m["rollout_rs_masked_fraction"] = rejected.sum().double() / N if N else nan
        m["rollout_rs_seq_masked_fraction"] = rejected.any(-1).sum().double() / S if N else nan
        new_mask &= ~rejected
    if veto_threshold is not None:
        cat = mask & (lr < math.log(veto_threshold))
        vetoed = cat.any(-1)
        m["rollout_is_veto_fraction"] = vetoed.sum().double() / S if N else nan
        m["rollout_is_catastrophic_token_fraction"] = cat.sum().double() / N if N else nan
        new_mask &= ~vetoed[:, None]
    return weights, new_mask, m


@register_reference("loss.rollout_correction")
def rollout_correction(log_probs, rollout_log_probs, mask, is_level, is_threshold, rs_level, rs_threshold, rs_threshold_lower, veto_threshold):
    w, new_mask, m = rollout_correction_f64(log_probs, rollout_log_probs, mask, is_level, is_threshold, rs_level, rs_threshold, rs_threshold_lower, veto_threshold)
    metrics = {k: (v if not v.is_floating_point() else v.float()) for k, v in m.items()}
    return (w.float() if w is not None else None), new_mask, metrics
