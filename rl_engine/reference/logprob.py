"""References for the ``logprob.*`` operators, in float64.

``*_f64`` return float64 (accuracy tests, differentiable); the registered fallbacks have the
operators' signatures and return fp32, like the operators.

Kept-set records (``kept_threshold`` / ``kept_boundary``, :mod:`rl_engine.utils.kept`): the kept
entries are decided on the fp32 scaled logits ``fl32(logits) / fl32(τ)`` — the values the
record was taken from — and the dropped ones are set to ``-inf`` in the float64 logits, so the
result is the float64 log-prob of the distribution renormalised over the kept set (the target of
a token log-prob counts as kept, as in the operators).
"""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import register_reference
from rl_engine.utils.kept import keep_mask


def _masked64(logits: torch.Tensor, temperature: float, kept_threshold: torch.Tensor | None,
              kept_boundary: torch.Tensor | None, targets: torch.Tensor | None = None) -> torch.Tensor:
    z = logits.double() / float(temperature)
    if kept_threshold is None:
        return z
    V = logits.shape[-1]
    z32 = logits.detach().float()
    z32 = z32 / float(temperature) if float(temperature) != 1.0 else z32
    tgt = targets.reshape(-1) if targets is not None else None
    keep = keep_mask(z32.reshape(-1, V), 0, kept_threshold.reshape(-1), kept_boundary.reshape(-1), tgt).reshape(logits.shape)
    return z.masked_fill(~keep, float("-inf"))


def log_softmax_f64(logits: torch.Tensor, temperature: float = 1.0, kept_threshold: torch.Tensor | None = None,
                    kept_boundary: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
    return torch.log_softmax(_masked64(logits, temperature, kept_threshold, kept_boundary, targets), dim=-1)


def token_logprobs_f64(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                       kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    logp = log_softmax_f64(logits, temperature, kept_threshold, kept_boundary, targets)
    return logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def entropy_f64(logits: torch.Tensor, temperature: float = 1.0, kept_threshold: torch.Tensor | None = None,
                kept_boundary: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
    logp = log_softmax_f64(logits, temperature, kept_threshold, kept_boundary, targets)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


def linear_token_logprobs_f64(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False,
    kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    logits = hidden.double() @ weight.double().T
    lp = token_logprobs_f64(logits, targets, temperature, kept_threshold, kept_boundary)
    ent = entropy_f64(logits, temperature, kept_threshold, kept_boundary, targets) if return_entropy else None
    return (lp, ent) if return_entropy else lp


@register_reference("logprob.log_softmax")
def log_softmax(logits: torch.Tensor, temperature: float = 1.0, *, kept_threshold: torch.Tensor | None = None,
                kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    return log_softmax_f64(logits, temperature, kept_threshold, kept_boundary).float()


@register_reference("logprob.token_logprobs")
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    return token_logprobs_f64(logits, targets, temperature, kept_threshold, kept_boundary).float()


@register_reference("logprob.entropy")
def entropy(logits: torch.Tensor, temperature: float = 1.0, *, kept_threshold: torch.Tensor | None = None,
            kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    return entropy_f64(logits, temperature, kept_threshold, kept_boundary).float()


@register_reference("logprob.linear_token_logprobs")
def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
    kept_threshold: torch.Tensor | None = None,
    kept_boundary: torch.Tensor | None = None,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    out = linear_token_logprobs_f64(hidden, weight, targets, temperature, return_entropy, kept_threshold, kept_boundary)
    return (out[0].float(), out[1].float()) if return_entropy else out.float()
