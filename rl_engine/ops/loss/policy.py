r"""Policy-gradient losses: PPO clip (+ dual clip), GRPO, Dr. GRPO, DAPO, GSPO, CISPO.

All share one contract (``loss.policy``) and one input convention (see :mod:`rl_engine.ops.loss`):
``log_probs`` (current policy, the only input that receives a gradient), ``old_log_probs``
(the policy that sampled, or the proximal policy), ``advantages`` — all ``[B, L]`` — and
``mask``. The per-token log-ratio :math:`\log r_t = \log\pi_t - \log\pi^{old}_t` is clamped to
``[-20, 20]`` before ``exp``. Each returns a :class:`~rl_engine.ops.loss.LossOutput` whose
``metrics`` are ``clip_frac``, ``clip_frac_low``, ``clip_frac_high``, ``dual_clip_frac``,
``ratio_mean``, ``ratio_min``, ``ratio_max``, ``approx_kl`` (:math:`\text{mean}(\log\pi^{old} -
\log\pi)`), ``active_tokens``, ``active_sequences``.
"""

from __future__ import annotations

import math

import torch

from rl_engine.ops.loss._common import (
    LossOutput,
    as_mask,
    check_log_probs,
    check_number,
    check_tokens,
    finish,
    resolve_and_pad,
)
from rl_engine.runtime.registry import dispatch, make_request

__all__ = ["ppo_clip_loss", "grpo_loss", "dr_grpo_loss", "dapo_loss", "gspo_loss", "cispo_loss"]

_STATS = ("tokens", "clipped_low", "clipped_high", "dual_clipped", "ratio_sum", "ratio_min", "ratio_max", "log_ratio_sum")


def _policy(kind, *, log_probs, old_log_probs, advantages, mask, eps_low, eps_high, dual_clip=None, reduction,
            denominator, loss_scale_factor, is_weights) -> LossOutput:
    """The shared body of the public losses, which call it as ``_policy(kind, **locals())``:
    their parameters (all of them, and nothing else) are its keyword arguments."""
    m = as_mask(mask)
    check_tokens(m, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, is_weights=is_weights)
    check_log_probs(m, log_probs=log_probs, old_log_probs=old_log_probs)
    if kind == "cispo":
        lo = math.inf if eps_low is None else check_number("eps_low", eps_low, low=0.0)
    else:
        lo = check_number("eps_low", eps_low, low=0.0, high=1.0)
    hi = check_number("eps_high", eps_low if eps_high is None else eps_high, low=0.0)
    c = check_number("dual_clip", dual_clip, low=1.0, low_open=True, allow_none=True)
    den, given, m, (log_probs, old_log_probs, advantages, is_weights) = resolve_and_pad(
        m, reduction, denominator, loss_scale_factor, log_probs, old_log_probs, advantages, is_weights
    )
    req = make_request("loss.policy", log_probs, features={"kind": kind, "reduction": reduction, "shape": tuple(m.shape)})
    seq_sum, stats = dispatch(req, log_probs, old_log_probs, advantages, m, is_weights, kind, lo, hi, c)
    stats_d = {k: stats[:, i] for i, k in enumerate(_STATS)}
    return finish(seq_sum, stats_d["tokens"], stats_d, reduction, den, given, "policy")


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    reduction: str = "token-mean",
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    r"""PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), optional dual clip.

    .. math::
        r_t = e^{\log\pi_t - \log\pi^{old}_t},\qquad
        ℓ_t = \max\bigl(-A_t r_t,\; -A_t\,\mathrm{clip}(r_t, 1-ε_{low}, 1+ε_{high})\bigr)

    ``eps_high=None`` means ``eps_high = eps_low`` (symmetric PPO, default 0.2). With
    ``dual_clip = c > 1`` (Ye et al. 2020, arXiv:1912.09729): :math:`ℓ_t = \min(ℓ_t, -c A_t)`
    where :math:`A_t < 0` (verl applies ``c = 3`` by default; here it is off unless given). Optional ``is_weights`` :math:`w_t` (e.g. truncated IS weights from
    :func:`~rl_engine.ops.loss.rollout_correction`) multiply :math:`ℓ_t` as constants. The loss is
    :math:`ℓ_t` reduced by ``reduction`` (default ``token-mean``: :math:`\sum m ℓ / N`).

    Gradient: :math:`∂ℓ_t/∂\log\pi_t = -A_t r_t w_t` where the unclipped branch is taken (and the
    log-ratio is inside ±20), else 0.

    Shapes:
        log_probs, old_log_probs, advantages, is_weights, mask: ``[B, L]``; returns a
        :class:`LossOutput` with a 0-dim ``loss`` and ``seq_terms`` ``[B]`` (float32).

    Contract ``loss.policy`` (``contracts/operators/loss.policy.json``): float32 or bfloat16
    inputs, float32 math and outputs, gradient in ``log_probs.dtype``; row, layout and
    micro-batch (chunk) invariant, deterministic, forward and backward. For micro-batches pass
    ``denominator=loss_denominator(full_mask, reduction)``.

    Raises:
        TypeError / ValueError: a tensor has the wrong type, dtype, shape (≠ ``mask.shape``),
            device, is non-contiguous or contains NaN; ``log_probs`` / ``old_log_probs`` hold
            a value that is not a log-probability (``+inf``, ``-inf`` or ``> 0``) at an active
            token (both where the NaN policy scans the tensor: :mod:`rl_engine.utils.checks`);
            ``mask`` is not 0/1; ``eps_low`` not in
            ``[0, 1]``; ``eps_high < 0``; ``dual_clip <= 1``; unknown ``reduction``;
            ``denominator <= 0``; ``loss_scale_factor`` missing or misplaced (message names the
            argument).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    return _policy("ppo_clip", **locals())


def grpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    reduction: str = "seq-mean-token-mean",
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    r"""GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): the PPO clipped surrogate averaged
    over each sequence's active tokens, then over sequences.

    .. math:: L = \frac{1}{G}\sum_b \frac{1}{n_b}\sum_t m_{b,t}\,ℓ^{clip}_{b,t}

    Advantages are usually :func:`~rl_engine.ops.loss.grpo_advantages`; GRPO's KL term is a
    separate :func:`~rl_engine.ops.loss.kl_penalty` (``k3``) with the same reduction, added as
    ``loss = pg.loss + β · kl.loss``. Shapes, contract and Raises as :func:`ppo_clip_loss`.
    """
    return _policy("ppo_clip", **locals())


def dr_grpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_scale_factor: float | None = None,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    reduction: str = "seq-mean-token-sum-norm",
    denominator: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    r"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783): the
    PPO clipped surrogate **summed** over tokens and divided by a constant — no per-sequence
    length normalisation (and advantages without std normalisation:
    ``grpo_advantages(..., norm_by_std=False)``).

    .. math:: L = \frac{1}{G\,C}\sum_b \sum_t m_{b,t}\,ℓ^{clip}_{b,t}

    ``loss_scale_factor`` is the constant :math:`C` (the paper uses the generation budget,
    e.g. the maximum response length); it is required unless ``denominator`` (= :math:`G C` of
    the full batch) is given. Shapes, contract and Raises as :func:`ppo_clip_loss`.
    """
    return _policy("ppo_clip", **locals())


def dapo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    reduction: str = "token-mean",
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    r"""DAPO (Yu et al. 2025, arXiv:2503.14476): the PPO clipped surrogate with decoupled
    "clip-higher" bounds (:math:`ε_{low} = 0.2`, :math:`ε_{high} = 0.28`) and a token-level mean
    over **all** active tokens of the batch.

    .. math:: L = \frac{1}{N}\sum_{b,t} m_{b,t}\,ℓ^{clip}_{b,t}

    (DAPO's dynamic sampling and overlong shaping act on the data, not on this loss.) Shapes,
    contract and Raises as :func:`ppo_clip_loss`.
    """
    return _policy("ppo_clip", **locals())


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    reduction: str = "seq-mean-token-mean",
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    r"""GSPO (Zheng et al. 2025, arXiv:2507.18071): a sequence-level importance ratio, clipped at
    sequence level.

    .. math::
        s_b = \exp\Bigl(\frac{1}{n_b}\sum_t m_{b,t}(\log\pi_{b,t} - \log\pi^{old}_{b,t})\Bigr),\quad
        ℓ_{b,t} = \max\bigl(-A_{b,t} s_b,\; -A_{b,t}\,\mathrm{clip}(s_b, 1-ε_{low}, 1+ε_{high})\bigr)

    in the paper's GSPO-token form (:math:`s_{b,t} = \mathrm{sg}(s_b)\,\pi_{b,t}/\mathrm{sg}(\pi_{b,t})`,
    so :math:`∂ℓ_{b,t}/∂\log\pi_{b,t} = -A_{b,t} s_b` on the unclipped branch), reduced by
    ``seq-mean-token-mean``; with one advantage per sequence this is exactly the sequence-level
    GSPO objective :math:`\frac1G\sum_b \max(-A_b s_b, -A_b\,\mathrm{clip}(s_b))`. Clip fractions
    count tokens (every token of a clipped sequence). The mean log-ratio is a fixed-order
    per-sequence sum (layout invariant). Shapes, contract and Raises as :func:`ppo_clip_loss`.
    """
    return _policy("gspo", **locals())


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_high: float,
    eps_low: float | None = None,
    reduction: str = "token-mean",
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    r"""CISPO (MiniMax-M1, arXiv:2506.13585): a clipped, stop-gradient importance weight times
    the log-prob, so every token keeps a gradient.

    .. math::
        \hat r_t = \mathrm{clip}(r_t, 1-ε_{low}, 1+ε_{high}),\qquad
        ℓ_t = -\,\mathrm{sg}(\hat r_t)\,A_t\,\log\pi_t

    reduced by ``token-mean`` (the paper normalises by the total number of tokens). The paper
    sets no lower bound: ``eps_low=None`` (the default) disables it; ``eps_high`` has no
    universal value and must be given. Gradient: :math:`-\hat r_t A_t w_t`. ``clip_frac_*``
    count tokens whose weight was truncated. Shapes, contract and Raises as
    :func:`ppo_clip_loss` (``eps_low`` may exceed 1 here).
    """
    return _policy("cispo", **locals())
