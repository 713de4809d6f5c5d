"""Qwen3-MoE (routed experts, no shared expert): spec, presets, operator inventory and assembly
from rl_engine ops (Qwen3's attention layers with a sparse MoE block)."""

from rl_engine.models.qwen3_moe.model import Qwen3MoeForCausalLM, moe_parameter_shapes
from rl_engine.models.qwen3_moe.spec import OPERATOR_INVENTORY, PRESETS, Qwen3MoeSpec, is_moe_config, load_spec, preset

__all__ = [
    "Qwen3MoeForCausalLM",
    "Qwen3MoeSpec",
    "PRESETS",
    "OPERATOR_INVENTORY",
    "is_moe_config",
    "load_spec",
    "preset",
    "moe_parameter_shapes",
]
