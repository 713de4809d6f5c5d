"""References for the ``norm`` family in float64.

``rms_norm_f64``: ``y = x / sqrt(mean(x²) + eps) * weight`` over the last dimension, with no
intermediate rounding (the mathematical value the contract's tolerances are measured against).
"""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import register_reference


def rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.double()
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def fused_add_rms_norm_f64(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x.double() + residual.double()
    return rms_norm_f64(new_residual, weight, eps), new_residual


@register_reference("norm.rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return rms_norm_f64(x, weight, eps).to(x.dtype)


@register_reference("norm.fused_add_rms_norm")
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    out, new_residual = fused_add_rms_norm_f64(x, residual, weight, eps)
    return out.to(x.dtype), new_residual.to(x.dtype)
