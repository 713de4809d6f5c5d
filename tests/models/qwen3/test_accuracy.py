"""Our Qwen3 forward vs transformers' Qwen3ForCausalLM on the same weights.

Reference: the transformers model run in float64 on the weights rounded to the tested dtype;
the tolerance is the model contract's (``contracts/operators/models.qwen3.json``), read only via
``rl_engine.contracts.tolerance``.
"""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine import contracts
from rl_engine.models.qwen3 import Qwen3ForCausalLM, load_spec
from rl_engine.runtime.plan import Plan
from rl_engine.engine import ops_for
from tests.helpers.qwen3 import TINY_CONFIGS, hf_logits_f64

PLAN = "R/R"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_forward_matches_transformers(hf_checkpoints, name, dtype):
    dt = DTYPES[dtype]
    d = hf_checkpoints[name]
    model = Qwen3ForCausalLM.from_pretrained(d, dtype=dt)
    spec = model.spec
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, spec.vocab_size, (37,), generator=g)
    ops = ops_for(Plan.parse(PLAN), "train")
    with torch.no_grad():
        logits = model.logits(model.hidden_train(ids, torch.arange(37), torch.tensor([0, 37], dtype=torch.int32), ops), ops)
    ref = hf_logits_f64(d, ids, dt)
    tol = contracts.tolerance("models.qwen3", dt, "forward")
    assert logits.dtype == dt
    assert tol.check(logits, ref), f"{name} {dtype}: max violation {tol.max_violation(logits, ref):.3e} ({tol.reason})"
    # log-probs (fp32 output) against the float64 log-softmax of the reference logits
    lp = ops.token_logprobs(logits, ids.roll(-1))
    ref_lp = torch.log_softmax(ref, -1).gather(-1, ids.roll(-1)[:, None])[:, 0]
    assert tol.check(lp, ref_lp), f"{name} {dtype} logprobs: {tol.max_violation(lp, ref_lp):.3e}"


def test_spec_reads_hf_config(hf_checkpoints):
    for name, d in hf_checkpoints.items():
        spec = load_spec(d)
        cfg = TINY_CONFIGS[name]
        for k, v in cfg.items():
            assert getattr(spec, k) == v, (name, k)
        assert spec.rope_theta == 1_000_000.0
    sharded = hf_checkpoints["h32-gqa6-untied-3l"]
    assert (sharded / "model.safetensors.index.json").is_file(), "the sharded fixture must exercise the index"
    assert json.loads((sharded / "config.json").read_text())["tie_word_embeddings"] is False


def _hf_named(model: Qwen3ForCausalLM, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our fused-parameter gradients under HF names (q/k/v and gate/up split again)."""
    s = model.spec
    out = {}
    for k, g in grads.items():
        if ".self_attn.qkv_proj." in k:
            base, kind = k.split(".self_attn.qkv_proj.")
            for n, t in zip("qkv", g.split([s.q_size, s.kv_size, s.kv_size])):
                out[f"{base}.self_attn.{n}_proj.{kind}"] = t
        elif k.endswith("mlp.gate_up_proj.weight"):
            base = k[: -len("gate_up_proj.weight")]
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = g[: s.intermediate_size], g[s.intermediate_size :]
        else:
            out[k] = g
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_gradients_match_transformers(name, dtype):
    """d(Σ active log-probs)/d(every parameter) vs transformers' float64 autograd, each tensor
    normalised by its reference max |g| (the contract's backward tolerance says so)."""
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM as HFQwen3

    from rl_engine.models.qwen3 import Qwen3Spec
    from rl_engine.engine.executor import TrainSequence, score

    dt = DTYPES[dtype]
    spec = Qwen3Spec(name=name, **TINY_CONFIGS[name])
    model = Qwen3ForCausalLM.random(spec, seed=3, dtype=dt).requires_grad_(True)
    toks = torch.randint(0, spec.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    res = score(model, ops_for(Plan.parse(PLAN), "train"), [TrainSequence(0, tuple(toks.tolist()), (0,) * 5 + (1,) * 15)])[0]
    (-res.logprobs[res.mask].sum()).backward()
    hf = HFQwen3(Qwen3Config(**{k: v for k, v in spec.to_hf_config().items() if k not in ("architectures", "rope_theta")}))
    hf.load_state_dict({k: v.double() for k, v in model.to_hf_state_dict().items()}, strict=False)
    hf = hf.double()
    hf.tie_weights()
    lp = torch.log_softmax(hf(toks[None]).logits[0], -1)
    (-lp[4:-1].gather(-1, toks[5:, None]).sum()).backward()
    ref = {k: p.grad for k, p in hf.named_parameters()}
    tol = contracts.tolerance("models.qwen3", dt, "backward")
    ours = _hf_named(model, {k: v.grad for k, v in model.params.items()})
    assert set(ours) == set(ref)
    for k, g in ours.items():
        scale = ref[k].abs().max().clamp_min(1e-30)
        assert tol.check(g.double() / scale, ref[k] / scale), f"{name} {dtype} {k}: {tol.max_violation(g.double() / scale, ref[k] / scale):.3e}"
