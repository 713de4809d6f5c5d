"""Reference for ``gemm.linear``: ``y = x @ weight.T + bias`` in float64."""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import register_reference


def linear_f64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y


@register_reference("gemm.linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return linear_f64(x, weight, bias).to(out_dtype or x.dtype)
