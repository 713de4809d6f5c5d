"""Qwen3-MoE: dimensions, presets and operator inventory.

A :class:`Qwen3MoeSpec` is a :class:`~rl_engine.models.qwen3.Qwen3Spec` (attention, norms, RoPE,
embedding and LM head are Qwen3's) plus the sparse MLP: ``num_experts`` routed experts of
intermediate size ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token, their
weights renormalised when ``norm_topk_prob``. Layer ``i`` is sparse unless it is listed in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (then it has a dense MLP of
``intermediate_size``), as in transformers' ``Qwen3MoeDecoderLayer``. There is no shared expert.

Read from a Hugging Face ``config.json`` (``model_type: qwen3_moe``; transformers 5.x writes the
expert count as ``num_local_experts``, the official checkpoints as ``num_experts``: both are
read) or taken from :data:`PRESETS`. Unsupported features raise
:class:`~rl_engine.models.qwen3.ModelLoadError` naming the config field: a shared expert,
and everything the dense assembly refuses (sliding windows, RoPE scaling, another activation).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from rl_engine.models.qwen3.spec import ModelLoadError, Qwen3Spec, _refuse_unsupported

__all__ = ["Qwen3MoeSpec", "PRESETS", "OPERATOR_INVENTORY", "ARCHITECTURES", "load_spec", "preset", "is_moe_config"]

#: Every operator the assembly calls, per plan module (see ``rl_engine.runtime.plan.MODULES``).
OPERATOR_INVENTORY: dict[str, tuple[str, ...]] = {
    "embedding": ("embedding.embedding",),
    "norm": ("norm.rms_norm",),
    "gemm": ("gemm.linear",),  # attention projections, the router, dense-MLP layers, the LM head
    "rope": ("rope.apply_rope",),
    "attention": ("attention.varlen_attention", "attention.cached_attention"),
    "activation": ("activation.silu_and_mul",),  # dense-MLP layers only (mlp_only_layers)
    "logprob": ("logprob.token_logprobs", "logprob.entropy", "logprob.log_softmax", "logprob.linear_token_logprobs"),
    "moe": ("moe.route", "moe.expert_gate_up", "moe.expert_down_combine"),
}

ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def is_moe_config(cfg: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` names the Qwen3-MoE architecture."""
    return cfg.get("model_type") == "qwen3_moe" or any(a in ARCHITECTURES for a in cfg.get("architectures") or [])


class Qwen3MoeSpec(Qwen3Spec):
    """Dimensions of one Qwen3-MoE model (names follow the HF config)."""

    name: str = "qwen3-moe"
    num_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = Field(default=1, gt=0)
    mlp_only_layers: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _check_moe(self) -> "Qwen3MoeSpec":
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most num_experts "
                             f"({self.num_experts})")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layers of a {self.num_hidden_layers}-layer model")
        return self

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` has the sparse MoE block (else a dense MLP)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def num_parameters(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * self.head_dim
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size + h
        sparse = self.num_experts * h + self.num_experts * 3 * h * self.moe_intermediate_size
        dense = 3 * h * self.intermediate_size
        layers = sum(attn + 2 * h + (sparse if self.is_sparse(i) else dense) for i in range(self.num_hidden_layers))
        return v * h + layers + h + (0 if self.tie_word_embeddings else v * h)

    def num_active_parameters(self) -> int:
        """Parameters one token runs through (its ``num_experts_per_tok`` experts, not all of them)."""
        h = self.hidden_size
        unused = (self.num_experts - self.num_experts_per_tok) * 3 * h * self.moe_intermediate_size
        return self.num_parameters() - unused * sum(self.is_sparse(i) for i in range(self.num_hidden_layers))

    def to_hf_config(self) -> dict[str, Any]:
        """A transformers ``config.json`` dictionary for this spec."""
        cfg = super().to_hf_config()
        cfg.update({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        })
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, name: str = "qwen3-moe") -> "Qwen3MoeSpec":
        """Build a spec from a parsed HF ``config.json``; unsupported features raise ModelLoadError."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"config: expected a JSON object, got {type(cfg).__name__}")
        if not is_moe_config(cfg):
            raise ModelLoadError(f"config: unsupported architecture {cfg.get('architectures') or cfg.get('model_type')!r} "
                                 f"(model_type={cfg.get('model_type')!r}); expected {list(ARCHITECTURES)} "
                                 "(model_type 'qwen3_moe')")
        _refuse_unsupported(cfg)
        if cfg.get("shared_expert_intermediate_size"):
            raise ModelLoadError("config.shared_expert_intermediate_size: a shared expert is not supported by this "
                                 f"assembly (Qwen3-MoE has none), got {cfg['shared_expert_intermediate_size']!r}")
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        dense = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
        base = Qwen3Spec.from_hf_config({**dense, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
                                        name=name).model_dump()
        fields = {
            **base,
            "num_experts": experts,
            "num_experts_per_tok": cfg.get("num_experts_per_tok"),
            "moe_intermediate_size": cfg.get("moe_intermediate_size"),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "decoder_sparse_step": cfg.get("decoder_sparse_step", 1) or 1,
            "mlp_only_layers": tuple(cfg.get("mlp_only_layers") or ()),
        }
        missing = [k for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size") if fields[k] is None]
        if missing:
            raise ModelLoadError(f"config: missing required field(s) {missing}")
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise ModelLoadError(f"config: invalid Qwen3-MoE dimensions: {exc}") from exc


def _p(name, hidden, inter, moe_inter, layers, heads, kv, experts, top_k) -> Qwen3MoeSpec:
    return Qwen3MoeSpec(
        name=name, vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=False, max_position_embeddings=40960, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter, norm_topk_prob=True,
    )


#: Official Qwen3-MoE dimensions (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B config.json: 128 experts,
#: 8 per token, norm_topk_prob, no shared expert), plus ``qwen3-moe-tiny`` for CPU CI (random
#: weights, seconds per check; head_dim 32 so vLLM's CPU attention can run it).
PRESETS: dict[str, Qwen3MoeSpec] = {
    "qwen3-30b-a3b": _p("qwen3-30b-a3b", 2048, 6144, 768, 48, 32, 4, 128, 8),
    "qwen3-235b-a22b": _p("qwen3-235b-a22b", 4096, 12288, 1536, 94, 64, 4, 128, 8),
    "qwen3-moe-tiny": Qwen3MoeSpec(
        name="qwen3-moe-tiny", vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=True, max_position_embeddings=4096, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=64, norm_topk_prob=True,
    ),
}


def preset(name: str) -> Qwen3MoeSpec:
    if name not in PRESETS:
        raise ModelLoadError(f"preset: unknown Qwen3-MoE preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


def load_spec(model_dir: str | Path) -> Qwen3MoeSpec:
    """Read ``<model_dir>/config.json`` into a :class:`Qwen3MoeSpec`."""
    from rl_engine.models.qwen3.spec import read_config

    return Qwen3MoeSpec.from_hf_config(read_config(model_dir), name=Path(model_dir).name)
