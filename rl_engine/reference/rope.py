"""Reference for ``rope.apply_rope`` in float64 (rotate-half RoPE, HF Qwen3/Llama layout).

``inv_freq_i = theta^(-2i/R)`` for ``i < R/2`` (``R`` = rotary_dim), ``angle = position ·
inv_freq`` and ``out = x·cos + rotate_half(x)·sin`` on the first ``R`` features, with cos/sin
duplicated over the two halves; features past ``R`` pass through. libm float64 cos/sin.
"""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import register_reference


def apply_rope_f64(
    x: torch.Tensor, positions: torch.Tensor, *, theta: float = 10000.0, rotary_dim: int | None = None
) -> torch.Tensor:
    D = x.shape[-1]
    R = D if rotary_dim is None else rotary_dim
    inv_freq = theta ** (-torch.arange(0, R, 2, dtype=torch.float64, device=x.device) / R)
    angle = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[:, None, :]
    sin = torch.cat([angle.sin(), angle.sin()], -1)[:, None, :]
    h = x.double()
    xr, xp = h[..., :R], h[..., R:]
    x1, x2 = xr[..., : R // 2], xr[..., R // 2 :]
    out = xr * cos + torch.cat([-x2, x1], -1) * sin
    return torch.cat([out, xp], -1)


@register_reference("rope.apply_rope")
def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0, rotary_dim: int | None = None
) -> torch.Tensor:
    return apply_rope_f64(x, positions, theta=theta, rotary_dim=rotary_dim).to(x.dtype)
