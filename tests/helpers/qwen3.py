"""Tiny Qwen3 configs and transformers models built locally (no hub access)."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Three tiny configs that differ in head_dim, GQA ratio, tying, layer count and bias.
TINY_CONFIGS = {
    "h16-gqa2-tied-2l": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "h32-gqa6-untied-3l": dict(vocab_size=700, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                               num_attention_heads=6, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False),
    "h64-mha-untied-1l-bias": dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False,
                                   attention_bias=True),
}


def build_hf_model(cfg: dict, seed: int = 0):
    """A transformers Qwen3ForCausalLM with weights from ``Qwen3ForCausalLM.random`` (logits of a
    few units, unlike HF's std-0.02 init) in float32."""
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM as HFQwen3

    from rl_engine.models.qwen3 import Qwen3ForCausalLM, Qwen3Spec

    spec = Qwen3Spec(name="hf-tiny", rms_norm_eps=1e-6, rope_theta=1_000_000.0, **cfg)
    hf_cfg = Qwen3Config(**{k: v for k, v in spec.to_hf_config().items() if k not in ("architectures", "rope_theta")})
    hf = HFQwen3(hf_cfg).eval()
    ours = Qwen3ForCausalLM.random(spec, seed=seed)
    missing, unexpected = hf.load_state_dict(ours.to_hf_state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf


def hf_logits_f64(model_dir, ids: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """Logits of the transformers model in float64 with weights first rounded to ``weight_dtype``."""
    from transformers import Qwen3ForCausalLM as HFQwen3

    hf = HFQwen3.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(weight_dtype).float())
        hf = hf.double()
        return hf(ids[None]).logits[0]
