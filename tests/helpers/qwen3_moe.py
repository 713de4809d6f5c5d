"""Tiny Qwen3-MoE models for tests: transformers twins of rl_engine's model, and a float64
reference that runs with the experts rl_engine chose (no hub access)."""

from __future__ import annotations

import contextlib
import os
import types

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Small Qwen3-MoE specs (beyond the qwen3-moe-tiny preset): untied with a dense layer, and a
#: layout with decoder_sparse_step 2 and no renormalisation.
TINY_MOE_CONFIGS = {
    "e8k2-untied-dense1": dict(vocab_size=600, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                               mlp_only_layers=(1,)),
    "e6k3-step2-raw": dict(vocab_size=500, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                           num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False,
                           decoder_sparse_step=2),
}


def moe_spec(name: str):
    from rl_engine.models.qwen3_moe import PRESETS, Qwen3MoeSpec

    if name in PRESETS:
        return PRESETS[name]
    return Qwen3MoeSpec(name=name, **TINY_MOE_CONFIGS[name])


def hf_config(spec):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{k: v for k, v in spec.to_hf_config().items() if k not in ("architectures", "rope_theta", "model_type")})


def build_hf_moe_model(spec, seed: int = 0):
    """``(transformers Qwen3MoeForCausalLM in float32, rl_engine's Qwen3MoeForCausalLM)`` with the same
    seeded weights (``Qwen3MoeForCausalLM.random``)."""
    from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

    from rl_engine.models.qwen3_moe import Qwen3MoeForCausalLM

    hf = HFQwen3Moe(hf_config(spec)).eval()
    hf.set_experts_implementation("eager")  # transformers' default, grouped_mm, has no float64
    ours = Qwen3MoeForCausalLM.random(spec, seed=seed)
    missing, unexpected = hf.load_state_dict(ours.to_hf_state_dict(fused_experts=True), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    return hf, ours


def routing_of(model, ops, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{layer: expert ids [T, K]}`` that ``model`` (rl_engine) chooses for the sequence ``ids``."""
    from rl_engine.models.hooks import use_stage_hook

    seen: dict[int, torch.Tensor] = {}

    def hook(layer, stage, t):
        if stage == "routing":
            seen[layer] = t.clone()
        return t

    T = ids.shape[0]
    with use_stage_hook(hook), torch.no_grad():
        model.hidden_train(ids, torch.arange(T), torch.tensor([0, T], dtype=torch.int32), ops)
    return seen


@contextlib.contextmanager
def forced_routing(hf, routing: dict[int, torch.Tensor]):
    """Run a transformers Qwen3-MoE with the given experts per layer: its router's softmax (in the
    model's dtype, float64 for the reference) evaluated at those experts, renormalised as configured."""
    gates = []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or i not in routing:
            continue

        def forward(self, hidden_states, _ids=routing[i]):
            h = hidden_states.reshape(-1, self.hidden_dim)
            logits = torch.nn.functional.linear(h, self.weight)
            w = torch.softmax(logits, dim=-1).gather(-1, _ids)
            if self.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
            return logits, w, _ids

        gate.forward = types.MethodType(forward, gate)
        gates.append(gate)
    try:
        yield
    finally:
        for g in gates:
            g.__dict__.pop("forward", None)
