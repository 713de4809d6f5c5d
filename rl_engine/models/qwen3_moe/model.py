"""Qwen3-MoE assembled from operator calls only: Qwen3's attention layers with a sparse MoE block.

A sparse layer's MLP (HF ``Qwen3MoeSparseMoeBlock``; ``T`` tokens, ``E`` experts, ``K`` per token)::

    logits       = linear(x, W_router)                          # [T, E]   (module gemm)
    weights, ids = moe_route(logits, K, norm_topk_prob)          # [T, K]   (module moe)
    mlp          = moe_experts(x, W_gate_up, W_down, weights, ids)   # [T, H]

with ``W_gate_up [E, 2I, H]`` (each expert's gate rows, then its up rows) and ``W_down [E, H, I]``
stored fused, the layout of transformers 5's ``Qwen3MoeExperts`` and vLLM's ``w13``/``w2``. Dense
layers (``mlp_only_layers``) are Qwen3's MLP. Everything else — embedding, attention, norms,
RoPE, LM head, the train and rollout forwards — is :class:`~rl_engine.models.qwen3.Qwen3ForCausalLM`.

The stage hook sees, per sparse layer, ``router_logits``, ``routing`` (the ``[T, K]`` expert ids:
which token chose which experts) and ``routing_weights`` before ``mlp``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from rl_engine.models.qwen3.model import Qwen3ForCausalLM, hf_parameter_shapes
from rl_engine.models.qwen3.spec import ModelLoadError
from rl_engine.models.qwen3_moe.spec import Qwen3MoeSpec, load_spec

__all__ = ["Qwen3MoeForCausalLM", "moe_parameter_shapes"]


def _expert(p: str, e: int, proj: str) -> str:
    return f"{p}mlp.experts.{e}.{proj}_proj.weight"


def moe_parameter_shapes(spec: Qwen3MoeSpec) -> dict[str, tuple[int, ...]]:
    """Every HF checkpoint tensor name of ``spec`` and its shape: the per-expert names of the
    official checkpoints (``mlp.gate.weight``, ``mlp.experts.{e}.{gate,up,down}_proj.weight``)."""
    h, i_moe = spec.hidden_size, spec.moe_intermediate_size
    shapes = {}
    for k, shp in hf_parameter_shapes(spec).items():
        if ".mlp." in k and spec.is_sparse(int(k.split(".")[2])):
            continue
        shapes[k] = shp
    for i in range(spec.num_hidden_layers):
        if not spec.is_sparse(i):
            continue
        p = f"model.layers.{i}."
        shapes[p + "mlp.gate.weight"] = (spec.num_experts, h)
        for e in range(spec.num_experts):
            shapes[_expert(p, e, "gate")] = (i_moe, h)
            shapes[_expert(p, e, "up")] = (i_moe, h)
            shapes[_expert(p, e, "down")] = (h, i_moe)
    return shapes


def _stack_gate_up(ts: list[torch.Tensor]) -> torch.Tensor:
    """``[gate_0 … gate_{E-1}, up_0 … up_{E-1}]`` → ``[E, 2I, H]`` (each expert's gate rows first)."""
    E = len(ts) // 2
    return torch.stack([torch.cat([ts[e], ts[E + e]]) for e in range(E)])


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE weights plus the forward passes of the train and rollout paths.

    Parameters (``self.params``) are HF-named, fused as in :class:`~rl_engine.models.qwen3.Qwen3ForCausalLM`
    plus, per sparse layer, ``model.layers.{i}.mlp.gate.weight`` ``[E, H]``,
    ``model.layers.{i}.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
    ``model.layers.{i}.mlp.experts.down_proj`` ``[E, H, I]``.
    """

    checkpoint_kind = "Qwen3-MoE"
    spec: Qwen3MoeSpec

    @classmethod
    def load_spec(cls, model_dir: str | Path) -> Qwen3MoeSpec:
        return load_spec(model_dir)

    @classmethod
    def parameter_shapes(cls, spec: Qwen3MoeSpec) -> dict[str, tuple[int, ...]]:
        return moe_parameter_shapes(spec)

    @classmethod
    def fusions(cls, spec: Qwen3MoeSpec) -> dict[str, tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]]]:
        fused = {k: v for k, v in super().fusions(spec).items()
                 if not (k.endswith("mlp.gate_up_proj.weight") and spec.is_sparse(int(k.split(".")[2])))}
        for i in range(spec.num_hidden_layers):
            if spec.is_sparse(i):
                p = f"model.layers.{i}."
                E = range(spec.num_experts)
                fused[p + "mlp.experts.gate_up_proj"] = (
                    [_expert(p, e, "gate") for e in E] + [_expert(p, e, "up") for e in E], _stack_gate_up)
                fused[p + "mlp.experts.down_proj"] = ([_expert(p, e, "down") for e in E], torch.stack)
        return fused

    @classmethod
    def from_hf_state_dict(cls, spec: Qwen3MoeSpec, sd: dict[str, torch.Tensor], *, dtype: torch.dtype,
                           device: torch.device | str = "cpu") -> "Qwen3MoeForCausalLM":
        """Load HF tensors: the per-expert checkpoint names, or transformers 5's in-memory layout
        (``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``, e.g. a
        ``model.state_dict()``), which is split into per-expert views first."""
        sd = dict(sd)
        I = spec.moe_intermediate_size
        for i in range(spec.num_hidden_layers):
            p = f"model.layers.{i}."
            for name in ("gate_up_proj", "down_proj"):
                t = sd.pop(p + f"mlp.experts.{name}", None)
                if t is None:
                    continue
                if not spec.is_sparse(i) or t.dim() != 3 or t.shape[0] != spec.num_experts:
                    raise ModelLoadError(f"weights: {p}mlp.experts.{name} has shape {tuple(t.shape)}, config says "
                                         f"{spec.num_experts} experts" + ("" if spec.is_sparse(i) else " and a dense layer"))
                for e in range(spec.num_experts):
                    if name == "down_proj":
                        sd[_expert(p, e, "down")] = t[e]
                    else:
                        sd[_expert(p, e, "gate")], sd[_expert(p, e, "up")] = t[e, :I], t[e, I:]
        return super().from_hf_state_dict(spec, sd, dtype=dtype, device=device)

    def to_hf_state_dict(self, *, fused_experts: bool = False) -> dict[str, torch.Tensor]:
        """HF-named tensors: the per-expert checkpoint names (default), or with ``fused_experts``
        transformers 5's module layout (what ``transformers.Qwen3MoeForCausalLM.load_state_dict`` takes)."""
        out = super().to_hf_state_dict()
        if fused_experts:
            return out
        I = self.spec.moe_intermediate_size
        for k in [k for k in out if ".mlp.experts." in k]:
            p = k.split("mlp.experts.")[0]
            t = out.pop(k)
            for e in range(t.shape[0]):
                if k.endswith("down_proj"):
                    out[_expert(p, e, "down")] = t[e].clone()
                else:
                    out[_expert(p, e, "gate")], out[_expert(p, e, "up")] = t[e, :I].clone(), t[e, I:].clone()
        return out

    def _mlp(self, i: int, x: torch.Tensor, ops, tap) -> torch.Tensor:
        if not self.spec.is_sparse(i):
            return super()._mlp(i, x, ops, tap)
        s, P = self.spec, self.params
        p = f"model.layers.{i}."
        logits = ops.linear(x, P[p + "mlp.gate.weight"])
        weights, ids = ops.moe_route(logits, s.num_experts_per_tok, s.norm_topk_prob)
        if tap:
            tap(i, "router_logits", logits)
            tap(i, "routing", ids)
            tap(i, "routing_weights", weights)
        return ops.moe_experts(x, P[p + "mlp.experts.gate_up_proj"], P[p + "mlp.experts.down_proj"], weights, ids)
