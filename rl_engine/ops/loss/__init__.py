"""RL losses, advantage estimators, KL estimators and rollout-correction metrics.

**Input convention.** Token tensors are ``[B, L]``: ``B`` sequences (responses), ``L`` the padded
response length, with a ``mask`` ``[B, L]`` (bool or 0/1) marking the **active tokens** — the
response tokens that enter the loss. Padding side, padded length and masked holes do not matter:
only each sequence's ordered list of active tokens does. Log-probs are those of the sampled
tokens (e.g. from :mod:`rl_engine.ops.logprob`). float32 or bfloat16 in; all math and all
outputs float32; gradients in the input's dtype.

**Reductions** (``reduction=``; verl's ``loss_agg_mode`` names): ``token-mean``,
``seq-mean-token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm`` — see
:mod:`rl_engine.ops.loss._common` and docs/operators/losses.md.

**Micro-batches, bitwise.** Per-token terms are elementwise; each sequence's sum runs in a fixed
order over its compacted active tokens; the loss adds the per-sequence terms in ascending-value
order and divides by a denominator. So: compute ``den = loss_denominator(full_mask, reduction)``
once, pass ``denominator=den`` to every micro-batch call, ``backward()`` each micro-batch's
``loss`` (its log-prob gradients are exactly the full batch's rows), and log
``combine_microbatch_losses(parts).loss`` (exactly the full-batch loss). Without the global
denominator a token-mean cannot be split bitwise (nor exactly): the count of active tokens of
the whole batch must be known up front.
"""

from rl_engine.ops.loss._common import REDUCTIONS, LossOutput, combine_microbatch_losses, loss_denominator
from rl_engine.ops.loss.advantages import grpo_advantages, reinforce_pp_baseline_advantages, rloo_advantages
from rl_engine.ops.loss.correction import RolloutCorrection, rollout_correction, rollout_mismatch_metrics
from rl_engine.ops.loss.kl import KL_ESTIMATORS, entropy_bonus, kl_penalty, masked_aggregate
from rl_engine.ops.loss.policy import cispo_loss, dapo_loss, dr_grpo_loss, gspo_loss, grpo_loss, ppo_clip_loss

__all__ = [
    "REDUCTIONS",
    "KL_ESTIMATORS",
    "LossOutput",
    "RolloutCorrection",
    "loss_denominator",
    "combine_microbatch_losses",
    "ppo_clip_loss",
    "grpo_loss",
    "dr_grpo_loss",
    "dapo_loss",
    "gspo_loss",
    "cispo_loss",
    "kl_penalty",
    "masked_aggregate",
    "entropy_bonus",
    "grpo_advantages",
    "rloo_advantages",
    "reinforce_pp_baseline_advantages",
    "rollout_correction",
    "rollout_mismatch_metrics",
]
