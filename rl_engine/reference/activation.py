"""Reference for ``activation.silu_and_mul`` in float64: ``silu(a) * b`` with ``[a, b] = x``."""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import register_reference


def silu_and_mul_f64(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    a, b = x[..., :d].double(), x[..., d:].double()
    return a * torch.sigmoid(a) * b


@register_reference("activation.silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_f64(x).to(x.dtype)
