"""Qwen3-MoE: spec and presets, HF checkpoint loading (per-expert names, sharded, transformers 5's
fused layout), accuracy against transformers' float64 forward and gradients with the same expert
choices, train/rollout parity on raw bits under R/R with its P/P negative control, and ``rlk check``
with ``--preset qwen3-moe-tiny`` and ``--model DIR``."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from rl_engine import contracts
from rl_engine.engine import ops_for
from rl_engine.engine.executor import LAYOUTS, RolloutExecutor, RolloutRequest, SamplingParams, TrainSequence, score
from rl_engine.entrypoints.cli import app
from rl_engine.models.qwen3 import ModelLoadError
from rl_engine.models.qwen3_moe import OPERATOR_INVENTORY, PRESETS, Qwen3MoeForCausalLM, Qwen3MoeSpec, load_spec
from rl_engine.models.registry import from_pretrained, model_class, preset
from rl_engine.runtime.plan import MODULES, Plan
from rl_engine.utils.bits import same_bits
from rl_engine.validation.alignment import align, compare
from tests.helpers.qwen3_moe import TINY_MOE_CONFIGS, build_hf_moe_model, forced_routing, hf_config, moe_spec, routing_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NAMES = ["qwen3-moe-tiny", *TINY_MOE_CONFIGS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{name: directory}`` saved by transformers' ``save_pretrained`` (per-expert tensor names);
    the untied one is sharded."""
    out = {}
    for name in NAMES:
        d = tmp_path_factory.mktemp(name)
        hf, _ = build_hf_moe_model(moe_spec(name), seed=2)
        hf.save_pretrained(d, max_shard_size="200KB" if name.startswith("e8") else "100MB")
        out[name] = d
    return out


# --------------------------------------------------------------------------- spec


def test_presets_have_the_official_dimensions():
    a3b, a22b = PRESETS["qwen3-30b-a3b"], PRESETS["qwen3-235b-a22b"]
    assert (a3b.hidden_size, a3b.num_hidden_layers, a3b.num_attention_heads, a3b.num_key_value_heads) == (2048, 48, 32, 4)
    assert (a3b.num_experts, a3b.num_experts_per_tok, a3b.moe_intermediate_size, a3b.norm_topk_prob) == (128, 8, 768, True)
    assert (a22b.hidden_size, a22b.num_hidden_layers, a22b.num_attention_heads, a22b.moe_intermediate_size) == (4096, 94, 64, 1536)
    # the names say the totals: ~30B / ~3B active and ~235B / ~22B active parameters
    assert 30.0e9 < a3b.num_parameters() < 31.0e9 and 3.0e9 < a3b.num_active_parameters() < 3.5e9
    assert 234e9 < a22b.num_parameters() < 236e9 and 21e9 < a22b.num_active_parameters() < 23e9
    assert preset("qwen3-moe-tiny") is PRESETS["qwen3-moe-tiny"] and preset("tiny").name == "tiny"
    with pytest.raises(ModelLoadError, match="unknown preset 'qwen3-moe-huge'"):
        preset("qwen3-moe-huge")


@pytest.mark.parametrize("name", NAMES)
def test_parameter_count_matches_transformers(name):
    from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

    spec = moe_spec(name)
    hf = HFQwen3Moe(hf_config(spec))
    assert sum(p.numel() for p in hf.parameters()) == spec.num_parameters()


def test_operator_inventory_names_every_plan_module_and_contracted_ops():
    assert set(OPERATOR_INVENTORY) == set(MODULES)
    for ops in OPERATOR_INVENTORY.values():
        for op in ops:
            contracts.load_contract(op)
    assert OPERATOR_INVENTORY["moe"] == ("moe.route", "moe.expert_gate_up", "moe.expert_down_combine")


def test_spec_reads_both_expert_count_spellings_and_refuses_a_shared_expert():
    cfg = PRESETS["qwen3-moe-tiny"].to_hf_config()
    assert Qwen3MoeSpec.from_hf_config(cfg).num_experts == 16
    local = {k: v for k, v in cfg.items() if k != "num_experts"} | {"num_local_experts": 16}
    assert Qwen3MoeSpec.from_hf_config(local).num_experts == 16
    with pytest.raises(ModelLoadError, match="^config.shared_expert_intermediate_size"):
        Qwen3MoeSpec.from_hf_config(cfg | {"shared_expert_intermediate_size": 64})
    with pytest.raises(ModelLoadError, match="missing required field"):
        Qwen3MoeSpec.from_hf_config({k: v for k, v in cfg.items() if k != "moe_intermediate_size"})
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        Qwen3MoeSpec.from_hf_config(cfg | {"num_experts_per_tok": 17})
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        Qwen3MoeSpec.from_hf_config(cfg | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ModelLoadError, match="^config.hidden_act"):
        Qwen3MoeSpec.from_hf_config(cfg | {"hidden_act": "gelu"})


def test_sparse_layers_follow_transformers_rule():
    spec = moe_spec("e6k3-step2-raw")
    assert [spec.is_sparse(i) for i in range(2)] == [False, True]
    spec = moe_spec("e8k2-untied-dense1")
    assert [spec.is_sparse(i) for i in range(3)] == [True, False, True]
    hf, _ = build_hf_moe_model(spec)
    kinds = [type(layer.mlp).__name__ for layer in hf.model.layers]
    assert kinds == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]


# --------------------------------------------------------------------------- weights


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_loads_with_the_class_its_config_names(checkpoints, name):
    d = checkpoints[name]
    spec = load_spec(d)
    assert isinstance(spec, Qwen3MoeSpec) and model_class(spec) is Qwen3MoeForCausalLM
    model = from_pretrained(d)
    _, ours = build_hf_moe_model(moe_spec(name), seed=2)
    assert set(model.params) == set(ours.params)
    for k, v in ours.params.items():
        assert same_bits(model.params[k], v), k
    if name.startswith("e8"):
        assert (d / "model.safetensors.index.json").is_file(), "the sharded fixture must exercise the index"
    # transformers 5's in-memory layout loads to the same parameters
    again = Qwen3MoeForCausalLM.from_hf_state_dict(spec, ours.to_hf_state_dict(fused_experts=True), dtype=torch.float32)
    assert all(same_bits(again.params[k], v) for k, v in ours.params.items())
    # and the per-expert names round-trip
    again = Qwen3MoeForCausalLM.from_hf_state_dict(spec, ours.to_hf_state_dict(), dtype=torch.float32)
    assert all(same_bits(again.params[k], v) for k, v in ours.params.items())


def test_bad_checkpoints_name_the_tensor():
    spec = moe_spec("qwen3-moe-tiny")
    sd = Qwen3MoeForCausalLM.random(spec).to_hf_state_dict()
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.experts.7.up_proj.weight"}
    with pytest.raises(ModelLoadError, match="missing 1 tensor"):
        Qwen3MoeForCausalLM.from_hf_state_dict(spec, missing, dtype=torch.float32)
    bad = dict(sd)
    bad["model.layers.0.mlp.gate.weight"] = torch.zeros(15, 128)
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.gate.weight has shape"):
        Qwen3MoeForCausalLM.from_hf_state_dict(spec, bad, dtype=torch.float32)
    with pytest.raises(ModelLoadError, match="Qwen3-MoE checkpoint"):
        Qwen3MoeForCausalLM.from_hf_state_dict(spec, {**sd, "model.layers.0.mlp.shared_expert.weight": torch.zeros(1)},
                                               dtype=torch.float32)


# --------------------------------------------------------------------------- accuracy


def _ids(vocab, n=37, seed=3):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_transformers_float64_with_the_same_experts(checkpoints, name, dtype):
    dt = DTYPES[dtype]
    from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

    model = Qwen3MoeForCausalLM.from_pretrained(checkpoints[name], dtype=dt)
    ops = ops_for(Plan.parse("R/R"), "train")
    ids = _ids(model.spec.vocab_size)
    with torch.no_grad():
        logits = model.logits(model.hidden_train(ids, torch.arange(37), torch.tensor([0, 37], dtype=torch.int32), ops), ops)
    routing = routing_of(model, ops, ids)
    assert sorted(routing) == [i for i in range(model.spec.num_hidden_layers) if model.spec.is_sparse(i)]
    hf = HFQwen3Moe.from_pretrained(checkpoints[name], dtype=torch.float32, experts_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(dt).float())
        hf = hf.double()
        with forced_routing(hf, routing):
            ref = hf(ids[None]).logits[0]
        free = hf(ids[None]).logits[0]  # float64's own routing
    tol = contracts.tolerance("models.qwen3_moe", dt, "forward")
    assert logits.dtype == dt
    assert tol.check(logits, ref), f"{name} {dtype}: {tol.max_violation(logits, ref):.3e}"
    if dt == torch.float32:  # fp32 logits of these models have no near-ties: float64 picks the same experts
        assert tol.check(logits, free)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "e8k2-untied-dense1"])
def test_gradients_match_transformers_float64_with_the_same_experts(name, dtype):
    """d(Σ active log-probs)/d(every parameter), including the router and both expert tensors, vs
    transformers' float64 autograd, each normalised by its reference max |g|."""
    dt = DTYPES[dtype]
    spec = moe_spec(name)
    hf, ours = build_hf_moe_model(spec, seed=3)
    model = Qwen3MoeForCausalLM.from_hf_state_dict(spec, ours.to_hf_state_dict(), dtype=dt).requires_grad_(True)
    toks = _ids(spec.vocab_size, 20, seed=1)
    ops = ops_for(Plan.parse("R/R"), "train")
    res = score(model, ops, [TrainSequence(0, tuple(toks.tolist()), (0,) * 5 + (1,) * 15)])[0]
    (-res.logprobs[res.mask].sum()).backward()
    routing = routing_of(model, ops, toks)
    hf.load_state_dict({k: v.double() for k, v in model.to_hf_state_dict(fused_experts=True).items()}, strict=False)
    hf = hf.double()
    hf.tie_weights()
    with forced_routing(hf, routing):
        lp = torch.log_softmax(hf(toks[None]).logits[0], -1)
    (-lp[4:-1].gather(-1, toks[5:, None]).sum()).backward()
    ref = {k: p.grad for k, p in hf.named_parameters()}
    grads = {}
    for k, v in model.params.items():
        g = v.grad
        if ".self_attn.qkv_proj." in k:
            base, kind = k.split(".self_attn.qkv_proj.")
            for n, t in zip("qkv", g.split([spec.q_size, spec.kv_size, spec.kv_size])):
                grads[f"{base}.self_attn.{n}_proj.{kind}"] = t
        elif k.endswith("mlp.gate_up_proj.weight"):
            base = k[: -len("gate_up_proj.weight")]
            grads[base + "gate_proj.weight"], grads[base + "up_proj.weight"] = g.split(spec.intermediate_size)
        else:
            grads[k] = g
    assert set(grads) == set(ref)
    tol = contracts.tolerance("models.qwen3_moe", dt, "backward")
    for k, g in grads.items():
        scale = ref[k].abs().max().clamp_min(1e-30)
        assert tol.check(g.double() / scale, ref[k] / scale), f"{name} {dtype} {k}: {tol.max_violation(g.double() / scale, ref[k] / scale):.3e}"


# --------------------------------------------------------------------------- parity


def _rollout(model, plan, sampling):
    g = torch.Generator().manual_seed(5)
    lengths = [4, 19, 1, 27, 9, 13]
    reqs = [RolloutRequest(i, tuple(torch.randint(1, model.spec.vocab_size, (lengths[i],), generator=g).tolist()),
                           9 - 2 * (i % 3), arrival_step=i // 2) for i in range(6)]
    ex = RolloutExecutor(model, ops_for(plan, "rollout"), max_len=64, max_seqs=3, prefill_chunk=8, max_step_tokens=20)
    with torch.no_grad():
        return ex.generate(reqs, sampling), ex


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_rr_every_layout_bitwise_equal_and_pp_mismatches(name, dtype):
    model = Qwen3MoeForCausalLM.random(moe_spec(name), seed=1, dtype=DTYPES[dtype])
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)
    for label in ("R/R", "P/P"):
        plan = Plan.parse(label)
        out, ex = _rollout(model, plan, sampling)
        assert len({tuple(s for s, _ in step) for step in ex.batch_log}) > 3, "batch composition must change"
        seqs = [TrainSequence.of(s) for s in out.values()]  # with the rollout's kept sets (top-k/top-p)
        results = {}
        for lay in LAYOUTS:
            with torch.no_grad():
                results[lay] = compare(align(out, score(model, ops_for(plan, "train"), seqs, lay,
                                                        temperature=sampling.logprob_temperature)))
        if label == "R/R":
            assert all(c.passed for c in results.values()), {k: str(c) for k, c in results.items() if not c.passed}
        else:  # the negative control: native torch (HF's eager experts) on both sides
            assert sum(c.mismatched_tokens for c in results.values()) > 0


def test_moe_module_on_native_breaks_parity():
    """Plan R/R with only the moe module on native torch for the rollout: the MoE block alone
    reintroduces mismatches (HF's experts see a row count that follows the batch)."""
    model = Qwen3MoeForCausalLM.random(moe_spec("qwen3-moe-tiny"), seed=1)
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)
    plan = Plan.parse("R/R").with_module("moe", rollout="P")
    out, _ = _rollout(model, plan, sampling)
    seqs = [TrainSequence.of(s) for s in out.values()]  # with the rollout's kept sets (top-k/top-p)
    with torch.no_grad():
        c = compare(align(out, score(model, ops_for(plan, "train"), seqs, "packed", temperature=0.8)))
    assert c.mismatched_tokens > 0


def _check(*args):
    res = CliRunner().invoke(app, ["check", "--json", "--num-prompts", "5", "--max-new-tokens", "8", *args])
    return res.exit_code, json.loads(res.stdout)


@pytest.mark.slow
def test_rlk_check_preset_and_model_dir(checkpoints):
    code, r = _check("--preset", "qwen3-moe-tiny")
    assert code == 0 and r["passed"] and r["mismatched_tokens"] == 0 and r["compared_tokens"] > 0
    assert r["model_spec"]["num_experts"] == 16
    assert any(o["op"] == "moe.expert_down_combine" for o in r["provenance"]["operators"])
    code, pp = _check("--preset", "qwen3-moe-tiny", "--plan", "P/P")
    assert code == 1 and not pp["passed"] and pp["mismatched_tokens"] > 0
    code, r = _check("--model", str(checkpoints["e8k2-untied-dense1"]), "--dtype", "bfloat16")
    assert code == 0 and r["passed"] and r["compared_tokens"] > 0, r["first_mismatch"]
    code, pp = _check("--model", str(checkpoints["e8k2-untied-dense1"]), "--plan", "P/P")
    assert code == 1 and pp["mismatched_tokens"] > 0
