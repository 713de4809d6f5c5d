"""Qwen3 dense: dimensions, presets and operator inventory.

A :class:`Qwen3Spec` is read from a Hugging Face ``config.json`` (transformers 4.x puts the
RoPE base in ``rope_theta``, 5.x in ``rope_parameters.rope_theta``; both are accepted) or taken
from :data:`PRESETS`. Anything the assembly does not implement (sliding window or sliding
``layer_types``, RoPE scaling of any type, partial rotary, attention dropout, MLP biases,
quantization, another architecture) is rejected with a :class:`ModelLoadError` naming the config
field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["Qwen3Spec", "PRESETS", "OPERATOR_INVENTORY", "ModelLoadError", "load_spec", "preset", "read_config"]

#: Every operator the assembly calls, per plan module (see ``rl_engine.runtime.plan.MODULES``).
OPERATOR_INVENTORY: dict[str, tuple[str, ...]] = {
    "embedding": ("embedding.embedding",),
    "norm": ("norm.rms_norm",),
    "gemm": ("gemm.linear",),
    "rope": ("rope.apply_rope",),
    "attention": ("attention.varlen_attention", "attention.cached_attention"),
    "activation": ("activation.silu_and_mul",),
    "logprob": ("logprob.token_logprobs", "logprob.entropy", "logprob.log_softmax", "logprob.linear_token_logprobs"),
    "moe": (),  # a dense model calls no mixture-of-experts operator (rl_engine.models.qwen3_moe does)
}

ARCHITECTURES = ("Qwen3ForCausalLM",)


class ModelLoadError(ValueError):
    """A checkpoint directory or config cannot be loaded as a supported Qwen3 model."""


class Qwen3Spec(BaseModel):
    """Dimensions of one Qwen3 dense model (names follow the HF config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "qwen3"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_theta: float = Field(default=1_000_000.0, gt=0)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = Field(default=40960, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "Qwen3Spec":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        return self

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * self.head_dim
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size + h
        layer = attn + 3 * h * i + 2 * h
        return v * h + self.num_hidden_layers * layer + h + (0 if self.tie_word_embeddings else v * h)

    def to_hf_config(self) -> dict[str, Any]:
        """A transformers ``config.json`` dictionary for this spec (5.x spelling plus ``rope_theta``)."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "use_sliding_window": False,
        }

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, name: str = "qwen3") -> "Qwen3Spec":
        """Build a spec from a parsed HF ``config.json``; unsupported features raise ModelLoadError."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"config: expected a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if not any(a in ARCHITECTURES for a in archs) and model_type != "qwen3":
            raise ModelLoadError(
                f"config: unsupported architecture {archs or model_type!r} "
                f"(model_type={model_type!r}); supported: {list(ARCHITECTURES)} (model_type 'qwen3')"
            )
        _refuse_unsupported(cfg)
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta"))
        heads = cfg.get("num_attention_heads")
        fields = {
            "name": name,
            "vocab_size": cfg.get("vocab_size"),
            "hidden_size": cfg.get("hidden_size"),
            "intermediate_size": cfg.get("intermediate_size"),
            "num_hidden_layers": cfg.get("num_hidden_layers"),
            "num_attention_heads": heads,
            "num_key_value_heads": cfg.get("num_key_value_heads", heads),
            "head_dim": cfg.get("head_dim") or (cfg["hidden_size"] // heads if cfg.get("hidden_size") and heads else None),
            "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
            "rope_theta": theta if theta is not None else 10000.0,
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "attention_bias": bool(cfg.get("attention_bias", False)),
            "max_position_embeddings": cfg.get("max_position_embeddings", 40960),
        }
        missing = [k for k, v in fields.items() if v is None]
        if missing:
            raise ModelLoadError(f"config: missing required field(s) {missing}")
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise ModelLoadError(f"config: invalid Qwen3 dimensions: {exc}") from exc


#: The keys of a RoPE dictionary (``rope_parameters`` / ``rope_scaling``) that plain RoPE has.
_PLAIN_ROPE_KEYS = {"rope_type", "type", "rope_theta"}


def _refuse_unsupported(cfg: dict[str, Any]) -> None:
    """Raise :class:`ModelLoadError` naming the first config field whose value asks for a feature
    the assembly does not implement (it would otherwise run silently as plain Qwen3)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"config.hidden_act: only 'silu' is supported, got {cfg['hidden_act']!r}")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError("config.use_sliding_window: sliding-window attention is not supported by this assembly "
                             f"(got {cfg['use_sliding_window']!r})")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ModelLoadError(f"config.layer_types: expected a list of layer types, got {type(layer_types).__name__}")
        other = sorted({str(t) for t in layer_types if t != "full_attention"})
        if other:
            raise ModelLoadError(f"config.layer_types: only 'full_attention' layers are supported, got {other} "
                                 "(sliding-window or other attention layers)")
    for field in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ModelLoadError(f"config.{field}: expected an object or null, got {type(rope).__name__}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ModelLoadError(f"config.{field}: only plain RoPE (rope_type 'default') is supported, got rope_type "
                                 f"{rope_type!r}")
        extra = sorted(set(rope) - _PLAIN_ROPE_KEYS)
        if extra:
            raise ModelLoadError(f"config.{field}: plain RoPE takes only rope_type and rope_theta, got also {extra}")
    if cfg.get("partial_rotary_factor", 1.0) not in (1, 1.0, None):
        raise ModelLoadError(f"config.partial_rotary_factor: only 1.0 (RoPE on the whole head) is supported, "
                             f"got {cfg['partial_rotary_factor']!r}")
    if cfg.get("attention_dropout") not in (None, 0, 0.0):
        raise ModelLoadError(f"config.attention_dropout: only 0 is supported, got {cfg['attention_dropout']!r}")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"config.mlp_bias: MLP biases are not supported, got {cfg['mlp_bias']!r}")
    if cfg.get("quantization_config") is not None:
        raise ModelLoadError("config.quantization_config: quantized checkpoints are not supported (dense fp32/bf16 "
                             "weights only)")


def _p(name, hidden, inter, layers, heads, kv, tie) -> Qwen3Spec:
    return Qwen3Spec(
        name=name, vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=tie, max_position_embeddings=40960,
    )


#: Official Qwen3 dense dimensions (Qwen/Qwen3-*/config.json), plus ``tiny`` for the embedded
#: default (random weights; head_dim 32 so vLLM's CPU attention can run the same model) and
#: ``tiny-tp`` for tensor-parallel validation.
PRESETS: dict[str, Qwen3Spec] = {
    "qwen3-0.6b": _p("qwen3-0.6b", 1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _p("qwen3-1.7b", 2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _p("qwen3-4b", 2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _p("qwen3-8b", 4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _p("qwen3-14b", 5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _p("qwen3-32b", 5120, 25600, 64, 64, 8, False),
    "tiny": Qwen3Spec(
        name="tiny", vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
    # the tensor-parallel validation model (rlk validate ws2): heads, KV heads and the MLP width
    # divide by 4, and the vocabulary spans 5 blocks of 1024 (whole-block shards at TP 1, 2, 4).
    "tiny-tp": Qwen3Spec(
        name="tiny-tp", vocab_size=4608, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
}


def preset(name: str) -> Qwen3Spec:
    if name not in PRESETS:
        raise ModelLoadError(f"preset: unknown Qwen3 preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


def load_spec(model_dir: str | Path) -> Qwen3Spec:
    """Read ``<model_dir>/config.json`` into a :class:`Qwen3Spec`."""
    return Qwen3Spec.from_hf_config(read_config(model_dir), name=Path(model_dir).name)


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``<model_dir>/config.json`` (ModelLoadError for a missing directory or file, or bad JSON)."""
    path = Path(model_dir)
    if not path.exists():
        raise ModelLoadError(f"model: directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model: {str(path)!r} is not a directory")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"model: {str(path)!r} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"config: {str(cfg_path)!r} is not valid JSON: {exc}") from exc
    return cfg
