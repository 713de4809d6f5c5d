"""References for the ``logprob.*`` operators, in float64.

``*_f64`` return float64 (accuracy tests, differentiable); the registered fallbacks have the
operators' signatures and return fp32, like the operators.
"""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import register_reference


def log_softmax_f64(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(logits.double() / float(temperature), dim=-1)


def token_logprobs_f64(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return log_softmax_f64(logits, temperature).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def entropy_f64(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = log_softmax_f64(logits, temperature)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


def linear_token_logprobs_f64(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    logits = hidden.double() @ weight.double().T
    lp = token_logprobs_f64(logits, targets, temperature)
    return (lp, entropy_f64(logits, temperature)) if return_entropy else lp


@register_reference("logprob.log_softmax")
def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return log_softmax_f64(logits, temperature).float()


@register_reference("logprob.token_logprobs")
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return token_logprobs_f64(logits, targets, temperature).float()


@register_reference("logprob.entropy")
def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return entropy_f64(logits, temperature).float()


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    out = linear_token_logprobs_f64(hidden, weight, targets, temperature, return_entropy)
    return (out[0].float(), out[1].float()) if return_entropy else out.float()
