"""Qwen3 dense: spec (dimensions, presets, operator inventory) and assembly from rl_engine ops."""

from rl_engine.models.qwen3.model import Qwen3ForCausalLM, dtype_from_name, hf_parameter_shapes
from rl_engine.models.qwen3.spec import OPERATOR_INVENTORY, PRESETS, ModelLoadError, Qwen3Spec, load_spec, preset

__all__ = [
    "Qwen3ForCausalLM",
    "Qwen3Spec",
    "PRESETS",
    "OPERATOR_INVENTORY",
    "ModelLoadError",
    "load_spec",
    "preset",
    "dtype_from_name",
    "hf_parameter_shapes",
]
