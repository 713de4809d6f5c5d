"""References for the mixture-of-experts operators in float64.

* ``moe.route`` — softmax of the router logits, the ``K`` experts with the largest logits (ties:
  the lower expert id), their probabilities renormalised to sum to 1 when ``renormalize``;
* ``moe.expert_gate_up`` — ``silu(g) ⊙ u`` with ``[g, u] = x[t] · W_gate_up[ids[t, j]]ᵀ`` per slot;
* ``moe.expert_down_combine`` — ``Σ_j weights[t, j] · act[t, j] · W_down[ids[t, j]]ᵀ``.

The ``*_f64`` functions return float64 (differentiable); the registered fallbacks cast back to
the operator's output dtypes.
"""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import register_reference


def route_f64(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, K] float64, ids [T, K] int64)`` of ``router_logits [T, E]``."""
    z = router_logits.double()
    p = torch.softmax(z, dim=-1)
    ids = torch.sort(z.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = p.gather(-1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def expert_gate_up_f64(x: torch.Tensor, w_gate_up: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[T, K, I]`` float64: ``silu(g) · u`` with ``[g, u] = x[t] W_gate_up[ids[t, j]]ᵀ``."""
    h = torch.einsum("th,tkoh->tko", x.double(), w_gate_up.double()[ids])
    d = h.shape[-1] // 2
    g, u = h[..., :d], h[..., d:]
    return g * torch.sigmoid(g) * u


def expert_down_combine_f64(act: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                            ids: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` float64: ``Σ_j weights[t, j] · act[t, j] W_down[ids[t, j]]ᵀ``."""
    y = torch.einsum("tki,tkhi->tkh", act.double(), w_down.double()[ids])
    return (weights.double()[..., None] * y).sum(1)


@register_reference("moe.route")
def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = route_f64(router_logits, top_k, renormalize)
    return w.float(), ids


@register_reference("moe.expert_gate_up")
def expert_gate_up(x: torch.Tensor, w_gate_up: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return expert_gate_up_f64(x, w_gate_up, ids).to(x.dtype)


@register_reference("moe.expert_down_combine")
def expert_down_combine(act: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return expert_down_combine_f64(act, w_down, weights, ids).to(act.dtype)
