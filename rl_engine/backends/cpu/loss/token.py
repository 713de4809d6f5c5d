"""Token-level loss kernels: policy surrogates, KL estimators, masked row sums.

Each kernel maps ``[B, L]`` token tensors and a bool ``mask`` to **per-sequence** outputs
(``[B]`` sums over the sequence's active tokens, plus per-sequence statistics). The scalar loss is
formed from those by the operator layer (:mod:`rl_engine.ops.loss`), with a value-ordered sum
over sequences and a denominator, so that micro-batches combine bitwise.

Numerics (the same on every device: portable PyTorch, no BLAS, no atomics):

* all arithmetic in float32 (bf16 inputs are widened exactly), one rounding to the input dtype
  for gradients;
* elementwise: IEEE ``+ - * /``, ``exp`` (measured position-consistent on CPU), exact
  ``clamp``/``maximum``/``where``/comparisons; the log-ratio is clamped to ``[-20, 20]`` before
  ``exp`` and the gradient through a clamped log-ratio is zero (``clamp``'s rule);
* per-sequence sums: :func:`~rl_engine.utils.reductions.row_sum_active` (active tokens
  compacted, fixed lanes and tree), so row ``b``'s outputs depend only on row ``b``'s active
  tokens, in order;
* backward: ``grad[b, t] = upstream[b] * coef[b, t]`` elementwise, where ``coef`` is
  ``∂ℓ_t / ∂log_probs_t`` recomputed from the inputs: no reduction at all, so every gradient
  element depends only on its own token and its sequence's upstream value.
"""

from __future__ import annotations

import torch

from rl_engine.runtime.custom_ops import call_op
from rl_engine.utils.reductions import row_count_active, row_max_active, row_min_active, row_sum_active
from rl_engine.utils import portable

__all__ = [
    "LOG_RATIO_CLAMP",
    "POLICY_KINDS",
    "POLICY_STATS",
    "KL_ESTIMATORS",
    "loss_policy",
    "loss_kl",
    "loss_masked_row_sum",
]

#: Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp``.
LOG_RATIO_CLAMP = 20.0
POLICY_KINDS = ("ppo_clip", "gspo", "cispo")
#: Columns of the per-sequence statistics returned by :func:`loss_policy`.
POLICY_STATS = ("tokens", "clipped_low", "clipped_high", "dual_clipped", "ratio_sum", "ratio_min", "ratio_max", "log_ratio_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _policy_math(log_probs, old_log_probs, advantages, mask, is_weights, kind, eps_low, eps_high, dual_clip):
    """Per-token loss ``ℓ``, gradient coefficient ``∂ℓ/∂logp`` (both zero off-mask) and the
    per-token quantities the statistics are made of."""
    lp = log_probs.float()
    d = lp - old_log_probs.float()  # log ratio, one fp32 rounding
    adv = advantages.float()
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    zero = _zero(d)
    if kind == "gspo":
        n = row_count_active(mask)
        seq_d = row_sum_active(d, mask) / torch.clamp(n, min=1.0)
        in_range = ((seq_d >= -LOG_RATIO_CLAMP) & (seq_d <= LOG_RATIO_CLAMP))[:, None]
        ratio = portable.exp(seq_d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))[:, None].expand_as(d)
    else:
        in_range = (d >= -LOG_RATIO_CLAMP) & (d <= LOG_RATIO_CLAMP)
        ratio = portable.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped_ratio = ratio.clamp(lo, hi)
    dual = torch.zeros_like(mask)
    if kind == "cispo":
        neg_aw = -adv * clipped_ratio  # stop-gradient IS weight times advantage
        loss = neg_aw * lp
        coef = neg_aw
        clipped_high = ratio > hi
        clipped_low = ratio < lo
    else:
        pg1 = -adv * ratio
        pg2 = -adv * clipped_ratio
        loss = torch.maximum(pg1, pg2)
        clipped = pg2 > pg1
        clipped_high = clipped & (adv > 0)
        clipped_low = clipped & (adv < 0)
        active = ~clipped & in_range
        if dual_clip is not None:
            pg3 = -adv * dual_clip
            dual = (adv < 0) & (pg3 < loss)
            loss = torch.where(dual, pg3, loss)
            active = active & ~dual
        coef = torch.where(active, pg1, zero)
    if is_weights is not None:
        w = is_weights.float()
        loss = loss * w
        coef = coef * w
    loss = torch.where(mask, loss, zero)
    coef = torch.where(mask, coef, zero)
    return loss, coef, (ratio, d, clipped_low, clipped_high, dual)


def _policy_forward(log_probs, old_log_probs, advantages, mask, is_weights, kind, eps_low, eps_high, dual_clip):
    loss, _, (ratio, d, clipped_low, clipped_high, dual) = _policy_math(
        log_probs, old_log_probs, advantages, mask, is_weights, kind, eps_low, eps_high, dual_clip
    )
    sums = row_sum_active(torch.stack([loss, ratio, d]), mask)  # one fixed-order pass, rows independent
    stats = (
        row_count_active(mask),
        row_count_active(clipped_low & mask),
        row_count_active(clipped_high & mask),
        row_count_active(dual & mask),
        sums[1],
        row_min_active(ratio, mask),
        row_max_active(ratio, mask),
        sums[2],
    )
    return sums[0], torch.stack(stats, dim=-1)


@torch.library.custom_op("rlk::loss_policy", mutates_args=())
def loss_policy(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None,
    kind: str,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence policy-loss sums ``[B]`` and statistics ``[B, len(POLICY_STATS)]`` (fp32)."""
    return _policy_forward(log_probs, old_log_probs, advantages, mask, is_weights, kind, eps_low, eps_high, dual_clip)


@loss_policy.register_fake
def _(log_probs, old_log_probs, advantages, mask, is_weights, kind, eps_low, eps_high, dual_clip):
    B = log_probs.shape[0]
    return log_probs.new_empty((B,), dtype=torch.float32), log_probs.new_empty((B, len(POLICY_STATS)), dtype=torch.float32)


@torch.library.custom_op("rlk::loss_policy_backward", mutates_args=())
def loss_policy_backward(
    grad_seq: torch.Tensor,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None,
    kind: str,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> torch.Tensor:
    _, coef, _ = _policy_math(log_probs, old_log_probs, advantages, mask, is_weights, kind, eps_low, eps_high, dual_clip)
    return torch.where(mask, grad_seq.float()[:, None] * coef, _zero(coef)).to(log_probs.dtype)


@loss_policy_backward.register_fake
def _(grad_seq, log_probs, old_log_probs, advantages, mask, is_weights, kind, eps_low, eps_high, dual_clip):
    return log_probs.new_empty(log_probs.shape)


def _policy_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4], inputs[4])
    ctx.params = inputs[5:]
    ctx.mark_non_differentiable(output[1])


def _policy_backward(ctx, grad_seq, _grad_stats):
    lp, old, adv, mask, w = ctx.saved_tensors
    if grad_seq is None:
        grad_seq = lp.new_zeros(lp.shape[0], dtype=torch.float32)
    g = call_op(loss_policy_backward, grad_seq.contiguous(), lp, old, adv, mask, w, *ctx.params)
    return g, None, None, None, None, None, None, None, None


loss_policy.register_autograd(_policy_backward, setup_context=_policy_setup)


def _kl_math(log_probs, ref_log_probs, mask, estimator):
    lp = log_probs.float()
    d = lp - ref_log_probs.float()  # log(π/π_ref)
    zero = _zero(d)
    if estimator == "k1":
        val = d
        coef = torch.ones_like(d)
    elif estimator == "k2":
        val = 0.5 * (d * d)
        coef = d
    else:  # k3: r - 1 - log r with log r = ref - logp
        u = -d
        in_range = (u >= -LOG_RATIO_CLAMP) & (u <= LOG_RATIO_CLAMP)
        r = portable.exp(u.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        val = (r - 1.0) - u
        coef = torch.where(in_range, 1.0 - r, torch.ones_like(r))
    return torch.where(mask, val, zero), torch.where(mask, coef, zero)


@torch.library.custom_op("rlk::loss_kl", mutates_args=())
def loss_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums ``[B]`` of the KL estimator and active-token counts ``[B]`` (fp32)."""
    val, _ = _kl_math(log_probs, ref_log_probs, mask, estimator)
    return row_sum_active(val, mask), row_count_active(mask)


@loss_kl.register_fake
def _(log_probs, ref_log_probs, mask, estimator):
    B = log_probs.shape[0]
    return log_probs.new_empty((B,), dtype=torch.float32), log_probs.new_empty((B,), dtype=torch.float32)


@torch.library.custom_op("rlk::loss_kl_backward", mutates_args=())
def loss_kl_backward(grad_seq: torch.Tensor, log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    _, coef = _kl_math(log_probs, ref_log_probs, mask, estimator)
    return torch.where(mask, grad_seq.float()[:, None] * coef, _zero(coef)).to(log_probs.dtype)


@loss_kl_backward.register_fake
def _(grad_seq, log_probs, ref_log_probs, mask, estimator):
    return log_probs.new_empty(log_probs.shape)


def _kl_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2])
    ctx.estimator = inputs[3]
    ctx.mark_non_differentiable(output[1])


def _kl_backward(ctx, grad_seq, _grad_tokens):
    lp, ref, mask = ctx.saved_tensors
    if grad_seq is None:
        grad_seq = lp.new_zeros(lp.shape[0], dtype=torch.float32)
    return call_op(loss_kl_backward, grad_seq.contiguous(), lp, ref, mask, ctx.estimator), None, None, None


loss_kl.register_autograd(_kl_backward, setup_context=_kl_setup)


@torch.library.custom_op("rlk::loss_masked_row_sum", mutates_args=())
def loss_masked_row_sum(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums ``[B]`` of ``values`` over active tokens and the counts ``[B]`` (fp32)."""
    return row_sum_active(values.float(), mask), row_count_active(mask)


@loss_masked_row_sum.register_fake
def _(values, mask):
    B = values.shape[0]
    return values.new_empty((B,), dtype=torch.float32), values.new_empty((B,), dtype=torch.float32)


@torch.library.custom_op("rlk::loss_masked_row_sum_backward", mutates_args=())
def loss_masked_row_sum_backward(grad_seq: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    g = grad_seq.float()[:, None].expand(mask.shape)
    return torch.where(mask, g, torch.zeros((), dtype=torch.float32, device=g.device)).to(values.dtype)


@loss_masked_row_sum_backward.register_fake
def _(grad_seq, values, mask):
    return values.new_empty(values.shape)


def _row_sum_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.mark_non_differentiable(output[1])


def _row_sum_backward(ctx, grad_seq, _grad_tokens):
    values, mask = ctx.saved_tensors
    if grad_seq is None:
        grad_seq = values.new_zeros(values.shape[0], dtype=torch.float32)
    return call_op(loss_masked_row_sum_backward, grad_seq.contiguous(), values, mask), None


loss_masked_row_sum.register_autograd(_row_sum_backward, setup_context=_row_sum_setup)
