"""Reference for ``embedding.embedding``: ``weight[ids]`` (float64 result)."""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import register_reference


def embedding_f64(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight.double()[ids.long()]


@register_reference("embedding.embedding")
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return embedding_f64(ids, weight).to(weight.dtype)
