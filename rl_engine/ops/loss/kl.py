r"""KL penalty against a reference policy (Schulman's k1/k2/k3), entropy bonus, generic masked
aggregation — token terms reduced exactly like the policy losses, so they add up and combine
across micro-batches the same way::

    pg = grpo_loss(lp, old, adv, mask, denominator=den)
    kl = kl_penalty(lp, ref, mask, estimator="k3", reduction=pg.reduction, denominator=den)
    ent = entropy_bonus(entropy, mask, reduction=pg.reduction, denominator=den)
    loss = pg.loss + beta * kl.loss - c_ent * ent.loss
"""

from __future__ import annotations

import torch

from rl_engine.ops.loss._common import (
    LossOutput,
    as_mask,
    check_choice,
    check_log_probs,
    check_tokens,
    finish,
    resolve_and_pad,
)
from rl_engine.runtime.registry import dispatch, make_request

__all__ = ["KL_ESTIMATORS", "kl_penalty", "masked_aggregate", "entropy_bonus"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: str = "k3",
    reduction: str = "token-mean",
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    r"""Token-level estimate of :math:`KL(\pi\,\|\,\pi_{ref})` from samples of :math:`\pi`
    (Schulman, "Approximating KL Divergence", 2020), reduced like the policy losses.

    With :math:`\log\rho_t = \log\pi_{ref,t} - \log\pi_t`:

    * ``k1`` :math:`= -\log\rho_t` (unbiased, high variance; verl ``kl``);
    * ``k2`` :math:`= \tfrac12(\log\rho_t)^2` (biased, low variance; verl ``mse``);
    * ``k3`` :math:`= (\rho_t - 1) - \log\rho_t` (unbiased, low variance, ≥ 0; verl
      ``low_var_kl``, GRPO's penalty). :math:`\log\rho` is clamped to ±20 inside ``exp``;
      the result is not clipped.

    Gradients w.r.t. ``log_probs``: ``k1`` 1, ``k2`` :math:`-\log\rho_t`, ``k3``
    :math:`1 - \rho_t`. ``ref_log_probs`` is a constant. ``metrics``: ``kl`` (token mean of the
    estimate), ``active_tokens``, ``active_sequences``.

    Shapes:
        log_probs, ref_log_probs, mask: ``[B, L]``; returns a :class:`LossOutput`.

    Contract ``loss.kl``: float32 or bfloat16 in, float32 math/outputs; row, layout and
    micro-batch invariant, deterministic, forward and backward.

    Raises:
        TypeError / ValueError: bad tensor (type, dtype, shape, device, non-contiguous, NaN),
            a log-prob that is ``±inf`` or ``> 0`` at an active token (NaN and log-prob values where
            the NaN policy scans the tensor: :mod:`rl_engine.utils.checks`), ``mask`` not 0/1,
            unknown ``estimator`` or ``reduction``, bad ``denominator`` /
            ``loss_scale_factor`` (message names the argument).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    m = as_mask(mask)
    check_tokens(m, log_probs=log_probs, ref_log_probs=ref_log_probs)
    check_log_probs(m, log_probs=log_probs, ref_log_probs=ref_log_probs)
    check_choice("estimator", estimator, KL_ESTIMATORS)
    den, given, m, (log_probs, ref_log_probs) = resolve_and_pad(
        m, reduction, denominator, loss_scale_factor, log_probs, ref_log_probs
    )
    req = make_request("loss.kl", log_probs, features={"estimator": estimator, "reduction": reduction, "shape": tuple(m.shape)})
    seq_sum, tokens = dispatch(req, log_probs, ref_log_probs, m, estimator)
    return finish(seq_sum, tokens, {"tokens": tokens, "value_sum": seq_sum.detach()}, reduction, den, given, "kl")


def _aggregate(values, mask, reduction, denominator, loss_scale_factor, name, kind) -> LossOutput:
    m = as_mask(mask)
    check_tokens(m, **{name: values})
    den, given, m, (values,) = resolve_and_pad(m, reduction, denominator, loss_scale_factor, values)
    req = make_request("loss.aggregate", values, features={"reduction": reduction, "shape": tuple(m.shape)})
    seq_sum, tokens = dispatch(req, values, m)
    return finish(seq_sum, tokens, {"tokens": tokens, "value_sum": seq_sum.detach()}, reduction, den, given, kind)


def masked_aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    reduction: str = "token-mean",
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    r"""Reduce any per-token term :math:`v_{b,t}` over active tokens with ``reduction``
    (e.g. a custom per-token loss), with the same bitwise guarantees as the policy losses.

    .. math:: \text{token-mean: } \frac1N \sum_{b,t} m_{b,t} v_{b,t};\quad
              \text{seq-mean-token-mean: } \frac1G\sum_b \frac{1}{n_b}\sum_t m_{b,t} v_{b,t};\ \dots

    The gradient of :math:`v_{b,t}` is its sequence's upstream value on active tokens and
    ``+0`` elsewhere. ``metrics``: ``mean`` (token mean), ``active_tokens``, ``active_sequences``.

    Shapes:
        values, mask: ``[B, L]``; returns a :class:`LossOutput`.

    Contract ``loss.aggregate``.

    Raises:
        TypeError / ValueError: bad ``values`` (type, dtype, shape other than ``mask``'s, device,
            non-contiguous, NaN where the NaN policy scans it: :mod:`rl_engine.utils.checks`),
            ``mask`` not 0/1, unknown ``reduction``, bad ``denominator`` / ``loss_scale_factor``
            (message names the argument). ``values`` need not be log-probabilities: no range
            check.
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    return _aggregate(values, mask, reduction, denominator, loss_scale_factor, "values", "aggregate")


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    reduction: str = "token-mean",
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    r"""Aggregated policy entropy :math:`\bar H` over active tokens, to be **subtracted** from
    the loss with a coefficient (``loss = pg.loss - c · entropy_bonus(...).loss``; Williams & Peng
    1991, Mnih et al. 2016 A3C, arXiv:1602.01783).

    ``entropy`` is the per-token entropy :math:`H_t = -\sum_v \pi(v)\log\pi(v)` of the current
    policy (differentiable, from the model's logits); this op only reduces it, like
    :func:`masked_aggregate`. ``metrics``: ``entropy`` (token mean), ``active_tokens``,
    ``active_sequences``.

    Shapes:
        entropy, mask: ``[B, L]``; returns a :class:`LossOutput`.

    Contract ``loss.aggregate``. Raises as :func:`masked_aggregate` (naming ``entropy``).
    """
    return _aggregate(entropy, mask, reduction, denominator, loss_scale_factor, "entropy", "entropy")
