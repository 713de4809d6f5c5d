"""Which model class a preset or a checkpoint directory is: Qwen3 dense or Qwen3-MoE.

Callers that take "a preset name or an HF checkpoint directory" (``rlk check``, the validation
suites, the HF and vLLM checks) resolve it here, so every model family is reachable the same way::

    spec  = preset("qwen3-moe-tiny")                 # a Qwen3Spec or Qwen3MoeSpec
    model = random_model(spec, seed=0)               # the class that spec belongs to
    model = from_pretrained("path/to/Qwen3-30B-A3B")  # config.json decides the class
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl_engine.models.qwen3 import PRESETS as DENSE_PRESETS
from rl_engine.models.qwen3 import ModelLoadError, Qwen3ForCausalLM, Qwen3Spec
from rl_engine.models.qwen3.spec import read_config
from rl_engine.models.qwen3_moe import PRESETS as MOE_PRESETS
from rl_engine.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSpec, is_moe_config

__all__ = ["PRESETS", "preset", "model_class", "load_spec", "random_model", "from_pretrained"]

#: Every preset of every model family, by name.
PRESETS: dict[str, Qwen3Spec] = {**DENSE_PRESETS, **MOE_PRESETS}


def preset(name: str) -> Qwen3Spec:
    """The spec of preset ``name`` (ModelLoadError naming the known presets otherwise)."""
    if name not in PRESETS:
        raise ModelLoadError(f"preset: unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


def model_class(spec: Qwen3Spec) -> type[Qwen3ForCausalLM]:
    """The model class that assembles ``spec``."""
    return Qwen3MoeForCausalLM if isinstance(spec, Qwen3MoeSpec) else Qwen3ForCausalLM


def load_spec(model_dir: str | Path) -> Qwen3Spec:
    """The spec of a checkpoint directory: Qwen3-MoE when its ``config.json`` says so, else Qwen3 dense
    (which names the architecture it does not support)."""
    cfg = read_config(model_dir)
    name = Path(model_dir).name
    return Qwen3MoeSpec.from_hf_config(cfg, name=name) if is_moe_config(cfg) else Qwen3Spec.from_hf_config(cfg, name=name)


def random_model(spec: Qwen3Spec, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> Qwen3ForCausalLM:
    """Seeded random weights of ``spec``'s model class."""
    return model_class(spec).random(spec, seed=seed, dtype=dtype, device=device)


def from_pretrained(model_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> Qwen3ForCausalLM:
    """Load a checkpoint directory with the model class its ``config.json`` names."""
    return model_class(load_spec(model_dir)).from_pretrained(model_dir, dtype=dtype, device=device)
