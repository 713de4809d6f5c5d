r"""Rollout correction — for users whose rollout and training log-probs are *not* yet bitwise
equal: truncated importance sampling (TIS), masked IS / rejection (MIS), a veto threshold, and
the off-policy metrics known from verl, plus the exact ``mismatched_tokens`` count that is
``0`` when rollout and training run rl-kernel's invariant operators (``R/R``).

``log_probs`` are the training engine's log-probs of the sampled tokens (verl ``old_log_probs``),
``rollout_log_probs`` the rollout engine's, both ``[B, L]`` in the same dtype (the raw-bit
comparison needs it); :math:`\log ρ_t = \log\pi_{train,t} - \log\pi_{rollout,t}`, clamped to
±20 inside ``exp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.ops.loss._common import as_mask, check_choice, check_log_probs, check_number, check_tokens
from rl_engine.runtime.registry import dispatch, make_request

__all__ = ["RolloutCorrection", "IS_LEVELS", "RS_LEVELS", "rollout_correction", "rollout_mismatch_metrics"]

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class RolloutCorrection:
    """Result of :func:`rollout_correction`.

    Attributes:
        is_weights: ``[B, L]`` float32 truncated IS weights (``+0`` off-mask), or ``None`` when
            ``is_level`` is ``None``; pass as ``is_weights=`` to a policy loss.
        mask: ``[B, L]`` bool, the input mask with rejected tokens / sequences removed; use it as
            the loss mask (and for the loss denominator).
        metrics: 0-dim tensors (see :func:`rollout_correction`).
    """

    is_weights: torch.Tensor | None
    mask: torch.Tensor
    metrics: dict[str, torch.Tensor]


def rollout_correction(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_level: str | None = None,
    is_threshold: float = 2.0,
    rs_level: str | None = None,
    rs_threshold: float | None = None,
    rs_threshold_lower: float | None = None,
    veto_threshold: float | None = None,
) -> RolloutCorrection:
    r"""IS weights, rejection mask and mismatch metrics (semantics of verl's rollout correction).

    **TIS** (``is_level``; Yao et al. 2025 "Your efficient RL framework secretly brings you
    off-policy RL training"): ``token`` :math:`w_t = \min(ρ_t, τ)`; ``sequence``
    :math:`w_b = \min(\prod_t ρ_t, τ) = \min(e^{\sum_t \log ρ_t}, τ)` on every token of the
    sequence; :math:`τ` = ``is_threshold``. Weights are constants of the loss.

    **MIS / rejection** (``rs_level``; Liu, Li et al. 2025 "When Speed Kills Stability"): a token
    (``token``: :math:`ρ_t`), or a whole sequence (``sequence``: :math:`\prod_t ρ_t`;
    ``geometric``: :math:`(\prod_t ρ_t)^{1/n_b}`) is removed from the mask when its ratio is
    outside ``[rs_threshold_lower, rs_threshold]`` (lower default: ``1/rs_threshold``).

    **Veto** (``veto_threshold``): a sequence with any active token :math:`ρ_t <`
    ``veto_threshold`` is removed entirely.

    **Metrics** (over the *input* mask; token means over :math:`N` active tokens, sequence means
    over the sequences with at least one active token):

    * ``kl`` :math:`= \overline{\log\pi_{rollout} - \log\pi_{train}}`, ``k3_kl``
      :math:`= \overline{ρ - \log ρ - 1}` (unclamped ``exp``);
    * ``chi2_token`` :math:`= \overline{ρ_t^2} - 1`, ``chi2_seq`` :math:`= \overline{(\prod_t ρ_t)^2} - 1`;
    * ``rollout_is_mean/min/max`` of the IS weights at ``is_level`` (``token`` if ``None``)
      before truncation (sequence level: ``max`` clamps :math:`\sum\log ρ` at 20 from above,
      ``min`` is unclamped), ``rollout_is_std`` and ``rollout_is_eff_sample_size``
      :math:`= 1/\overline{(w/(\bar w + 10^{-8}))^2}` of the weights clamped to
      ``[1/is_threshold, is_threshold]`` (std: :math:`\sqrt{\max(\overline{w^2} - \bar w^2, 0)}`,
      0 for one token);
    * ``rollout_probs_diff_mean/max/std`` of :math:`|e^{\log\pi_{rollout}} - e^{\log\pi_{train}}|`
      (std unbiased);
    * ``mismatched_tokens`` (int64): active tokens whose two log-probs differ in **raw bits**
      (NaN counts as a mismatch), ``mismatched_token_fraction``, ``active_tokens`` (int64);
    * with ``rs_level``: ``rollout_rs_masked_fraction`` (tokens), ``rollout_rs_seq_masked_fraction``
      (sequences with a rejected token); with ``veto_threshold``: ``rollout_is_veto_fraction``
      (sequences), ``rollout_is_catastrophic_token_fraction``.

    Without active tokens the weights are 0, the mask is unchanged, counts are 0 and the other
    metrics are NaN.

    Shapes:
        log_probs, rollout_log_probs, mask: ``[B, L]``; returns :class:`RolloutCorrection`.

    Contract ``loss.rollout_correction``: weights and mask row invariant; metrics invariant to
    batch order and padding (value-ordered sums over per-sequence fixed-order sums);
    deterministic. Differences from verl: sequence means (``chi2_seq``, veto and rejection
    fractions over sequences) skip sequences without active tokens.

    Raises:
        TypeError / ValueError: bad tensor (type, dtype, shape, device, non-contiguous, NaN),
            a log-prob that is ``±inf`` or ``> 0`` at an active token (NaN and log-prob values
            where the NaN policy scans the tensor: :mod:`rl_engine.utils.checks`), the two
            log-prob tensors differ in dtype, ``mask`` not 0/1, unknown level, a
            threshold not a positive finite number, ``rs_threshold`` missing with ``rs_level``,
            ``rs_threshold_lower > rs_threshold`` (message names the argument).
    """
    m = as_mask(mask)
    check_tokens(m, log_probs=log_probs, rollout_log_probs=rollout_log_probs)
    check_log_probs(m, log_probs=log_probs, rollout_log_probs=rollout_log_probs)
    if rollout_log_probs.dtype != log_probs.dtype:
        raise ValueError(
            f"rollout_log_probs: expected dtype {log_probs.dtype} (the dtype of log_probs; mismatched_tokens compares raw bits), "
            f"got {rollout_log_probs.dtype}"
        )
    check_choice("is_level", is_level, IS_LEVELS, allow_none=True)
    check_choice("rs_level", rs_level, RS_LEVELS, allow_none=True)
    tau = check_number("is_threshold", is_threshold, low=0.0, low_open=True)
    upper = lower = None
    if rs_level is not None:
        if rs_threshold is None:
            raise ValueError("rs_threshold: required when rs_level is set")
        upper = check_number("rs_threshold", rs_threshold, low=0.0, low_open=True)
        lower = check_number("rs_threshold_lower", rs_threshold_lower, low=0.0, low_open=True, allow_none=True)
        if lower is not None and lower > upper:
            raise ValueError(f"rs_threshold_lower: expected <= rs_threshold ({upper}), got {lower}")
    elif rs_threshold is not None or rs_threshold_lower is not None:
        raise ValueError("rs_threshold: only used when rs_level is set")
    veto = check_number("veto_threshold", veto_threshold, low=0.0, low_open=True, allow_none=True)
    req = make_request("loss.rollout_correction", log_probs, features={"is_level": is_level, "rs_level": rs_level})
    w, new_mask, metrics = dispatch(req, log_probs, rollout_log_probs, m, is_level, tau, rs_level, upper, lower, veto)
    return RolloutCorrection(w, new_mask, metrics)


def rollout_mismatch_metrics(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_level: str = "token",
    is_threshold: float = 2.0,
) -> dict[str, torch.Tensor]:
    """Only the metrics of :func:`rollout_correction` (no weights, no rejection).

    Shapes, contract and Raises as :func:`rollout_correction`.
    """
    check_choice("is_level", is_level, IS_LEVELS)
    res = rollout_correction(log_probs, rollout_log_probs, mask, is_threshold=is_threshold)
    if is_level == "token":
        return res.metrics
    return rollout_correction(log_probs, rollout_log_probs, mask, is_level=is_level, is_threshold=is_threshold).metrics
