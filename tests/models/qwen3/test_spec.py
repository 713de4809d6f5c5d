"""Qwen3 spec: presets, HF config parsing, weight loading and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine.models.qwen3 import OPERATOR_INVENTORY, PRESETS, ModelLoadError, Qwen3ForCausalLM, Qwen3Spec, load_spec, preset
from rl_engine.runtime.plan import MODULES


@pytest.mark.parametrize(
    "name,hidden,inter,layers,heads,kv,tied,billions",
    [
        ("qwen3-0.6b", 1024, 3072, 28, 16, 8, True, 0.6),
        ("qwen3-1.7b", 2048, 6144, 28, 16, 8, True, 1.7),
        ("qwen3-4b", 2560, 9728, 36, 32, 8, True, 4.0),
        ("qwen3-8b", 4096, 12288, 36, 32, 8, False, 8.2),
        ("qwen3-14b", 5120, 17408, 40, 40, 8, False, 14.8),
        ("qwen3-32b", 5120, 25600, 64, 64, 8, False, 32.8),
    ],
)
def test_official_presets(name, hidden, inter, layers, heads, kv, tied, billions):
    s = preset(name)
    assert (s.hidden_size, s.intermediate_size, s.num_hidden_layers) == (hidden, inter, layers)
    assert (s.num_attention_heads, s.num_key_value_heads, s.head_dim) == (heads, kv, 128)
    assert (s.vocab_size, s.rope_theta, s.tie_word_embeddings) == (151936, 1e6, tied)
    assert abs(s.num_parameters() / 1e9 - billions) / billions < 0.08, s.num_parameters()


def test_tiny_preset_runs_on_vllm_cpu_attention():
    assert PRESETS["tiny"].head_dim >= 32


def test_inventory_covers_every_plan_module():
    assert set(OPERATOR_INVENTORY) == set(MODULES)


def test_hf_config_both_rope_spellings():
    base = preset("tiny").to_hf_config()
    v5 = {k: v for k, v in base.items() if k != "rope_theta"}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert Qwen3Spec.from_hf_config(v5).rope_theta == 5e5
    v4 = {k: v for k, v in base.items() if k != "rope_parameters"}
    v4["rope_theta"] = 2e4
    assert Qwen3Spec.from_hf_config(v4).rope_theta == 2e4
    no_kv = {k: v for k, v in base.items() if k != "num_key_value_heads"}
    assert Qwen3Spec.from_hf_config(no_kv).num_key_value_heads == base["num_attention_heads"]


@pytest.mark.parametrize(
    "patch,match",
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "unsupported architecture"),
        ({"use_sliding_window": True}, "sliding"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
         r"^config.rope_scaling: only plain RoPE"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"^config.rope_scaling: only plain RoPE"),
        ({"rope_scaling": {"rope_type": "default", "factor": 2.0}}, r"^config.rope_scaling: plain RoPE takes only"),
        ({"rope_scaling": "yarn"}, r"^config.rope_scaling: expected an object or null"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, r"^config.rope_parameters: only plain RoPE"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, r"^config.layer_types: only 'full_attention'"),
        ({"layer_types": "sliding_attention"}, r"^config.layer_types: expected a list"),
        ({"use_sliding_window": True, "sliding_window": 4096}, r"^config.use_sliding_window"),
        ({"partial_rotary_factor": 0.5}, r"^config.partial_rotary_factor"),
        ({"attention_dropout": 0.1}, r"^config.attention_dropout"),
        ({"mlp_bias": True}, r"^config.mlp_bias"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"^config.quantization_config"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_bad_configs_are_rejected(patch, match):
    cfg = {**preset("tiny").to_hf_config(), **patch}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ModelLoadError, match=match):
        Qwen3Spec.from_hf_config(cfg)


def test_plain_qwen3_config_fields_are_accepted():
    cfg = {**preset("tiny").to_hf_config(), "rope_scaling": None, "sliding_window": None, "max_window_layers": 2,
           "layer_types": ["full_attention", "full_attention"], "attention_dropout": 0.0, "use_sliding_window": False}
    assert Qwen3Spec.from_hf_config(cfg) == preset("tiny").model_copy(update={"name": "qwen3"})


def test_directory_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_spec(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf_config()))
    with pytest.raises(ModelLoadError, match="neither model.safetensors"):
        Qwen3ForCausalLM.from_pretrained(tmp_path)


def test_weight_errors(tmp_path):
    from safetensors.torch import save_file

    spec = Qwen3Spec(name="t", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    sd = Qwen3ForCausalLM.random(spec).to_hf_state_dict()
    (tmp_path / "config.json").write_text(json.dumps(spec.to_hf_config()))
    bad = dict(sd)
    bad["model.norm.weight"] = torch.ones(31)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.norm.weight has shape"):
        Qwen3ForCausalLM.from_pretrained(tmp_path)
    bad = {k: v for k, v in sd.items() if "down_proj" not in k}
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing 1 tensor"):
        Qwen3ForCausalLM.from_pretrained(tmp_path)
    save_file(sd, str(tmp_path / "model.safetensors"))
    m = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16 and m.lm_head_weight is m.params["model.embed_tokens.weight"]
    assert torch.equal(m.to_hf_state_dict()["model.layers.0.mlp.up_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"].bfloat16())


def test_random_init_is_seeded():
    s = preset("tiny")
    a, b, c = (Qwen3ForCausalLM.random(s, seed=k) for k in (0, 0, 1))
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k])
    assert not torch.equal(a.params["model.embed_tokens.weight"], c.params["model.embed_tokens.weight"])
