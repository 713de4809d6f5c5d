"""rl_engine installed into a transformers Qwen3-MoE: training forward vs ``generate`` raw-bit parity.

Rollout log-probs come from ``generate(output_logits=True)`` (KV cache, left-padded batches) and
train log-probs from one teacher-forced forward of the same sequences. With the install every
sparse layer's router and experts run ``rl_engine.ops.moe`` (and the rest of the model the dense
install), so they must be raw-bit equal; the unpatched model is the negative control. Also:
what the install replaces and restores, the router-logits recorder (``output_router_logits``),
gradients through the installed block, and accuracy against transformers in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rl_engine import contracts
from rl_engine.integrations.hf.install import install, is_installed
from rl_engine.integrations.hf.moe import MOE_SUBSTITUTIONS
from rl_engine.integrations.hf.rollout import generate_with_logprobs
from rl_engine.integrations.hf.train import train_token_logprobs
from rl_engine.runtime import provenance
from rl_engine.utils.bits import same_bits
from tests.helpers.qwen3_moe import build_hf_moe_model, forced_routing, moe_spec
from tests.helpers.threads import threads

NAMES = ["qwen3-moe-tiny", "e8k2-untied-dense1"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAD = 0
CASES = [([5], False, 6), ([3, 9, 1], True, 6), ([20, 13, 30, 7], True, 12)]


@pytest.fixture(autouse=True)
def _one_thread():
    with threads(1):
        yield


@pytest.fixture(scope="module")
def models():
    out = {}
    for name in NAMES:
        base, _ = build_hf_moe_model(moe_spec(name), seed=4)
        base.generation_config.pad_token_id = PAD
        for dname, dt in DTYPES.items():
            out[name, dname] = copy.deepcopy(base).to(dt)
    return out


def _prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.full((len(lengths), P), PAD, dtype=torch.int64)
    mask = torch.zeros(len(lengths), P, dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, P - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, P - n:] = 1
    return ids, mask


def _compare(model, lengths, *, do_sample, max_new_tokens, seed=0):
    ids, mask = _prompts(model.config.vocab_size, lengths, seed)
    T = 0.7 if do_sample else 1.0
    r = generate_with_logprobs(model, ids, mask, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=T, seed=seed)
    with torch.no_grad():
        t = train_token_logprobs(model, r.sequences, r.attention_mask, r.prompt_len, temperature=T)
    return r, same_bits(r.logprobs, t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_generate_vs_train_raw_bit_equal(models, name, dtype):
    model = models[name, dtype]
    with install(model) as inst, provenance.record() as calls:
        kinds = {cls for _, cls in inst.replaced}
        assert {"Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "Qwen3MoeExperts", "Qwen3MoeAttention",
                "Qwen3MoeRMSNorm"} <= kinds
        for lengths, do_sample, n in CASES:
            r, d = _compare(model, lengths, do_sample=do_sample, max_new_tokens=n)
            assert r.logprobs.numel() == len(lengths) * n
            assert d.equal, f"{name} {dtype} B={len(lengths)} sample={do_sample}: {d}"
    ops = {c.op for c in calls}
    assert {"moe.route", "moe.expert_gate_up", "moe.expert_down_combine"} <= ops
    assert not any(c.fallback for c in calls)
    assert not is_installed(model)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_without_install_mismatches(models, dtype):
    """The unpatched model (sdpa attention, HF's grouped_mm / eager experts) mismatches somewhere."""
    model = models["qwen3-moe-tiny", dtype]
    total = sum(_compare(model, lengths, do_sample=s, max_new_tokens=n)[1].mismatched for lengths, s, n in CASES)
    assert total > 0


def test_unapply_restores_every_forward_and_the_router_outputs(models):
    model = models["qwen3-moe-tiny", "float32"]
    block = model.model.layers[0].mlp
    x = torch.randn(1, 5, model.config.hidden_size)
    with torch.no_grad():
        native_logits, native_scores, native_ids = block.gate(x.reshape(-1, x.shape[-1]))
        with install(model):
            assert all("forward" in m.__dict__ for m in (block, block.gate, block.experts))
            logits, scores, ids = block.gate(x.reshape(-1, x.shape[-1]))
        assert all("forward" not in m.__dict__ for m in (block, block.gate, block.experts))
    assert scores.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids.sort(-1).values, native_ids.sort(-1).values)  # same experts (no near-ties here)
    assert (scores - native_scores.float()).abs().max() < 1e-6


def test_router_logits_recorder_and_gradients_flow_through_the_installed_block(models):
    """``output_router_logits`` still records every router (the block calls ``self.gate`` as a
    module) and the auxiliary loss is computed; gradients reach the router and both expert tensors,
    the same bits run to run."""
    base = copy.deepcopy(models["qwen3-moe-tiny", "float32"])
    ids, mask = _prompts(base.config.vocab_size, [7, 4], seed=2)
    grads = []
    with install(base):
        for _ in range(2):
            base.zero_grad()
            out = base(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
            assert len(out.router_logits) == base.config.num_hidden_layers and out.aux_loss is not None
            out.loss.backward()
            mlp = base.model.layers[0].mlp
            grads.append([mlp.gate.weight.grad.clone(), mlp.experts.gate_up_proj.grad.clone(),
                          mlp.experts.down_proj.grad.clone()])
    assert all(g.abs().sum() > 0 for g in grads[0])
    assert all(same_bits(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_against_float64_transformers_with_the_same_experts(models, dtype):
    """Installed padded-batch logits vs transformers in float64 on the same weights (rounded to
    ``dtype``), with the experts the installed router chose; tolerance from the model contract."""
    model = models["e8k2-untied-dense1", dtype]
    ref = copy.deepcopy(model).double()
    ref.set_attn_implementation("eager")
    ref.set_experts_implementation("eager")
    ids, mask = _prompts(model.config.vocab_size, [12, 5], seed=4)
    routing: dict[int, torch.Tensor] = {}
    with install(model), torch.no_grad():
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: routing.__setitem__(i, o[2]))
                 for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
        logits = model(input_ids=ids, attention_mask=mask).logits
        for h in hooks:
            h.remove()
    tol = contracts.tolerance("models.qwen3_moe", DTYPES[dtype], "forward")
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        L = ids.shape[1]
        rows = {i: r.view(ids.shape[0], L, -1)[b, L - n:] for i, r in routing.items()}
        with torch.no_grad(), forced_routing(ref, rows):
            z = ref(input_ids=ids[b, -n:][None]).logits[0]
        got = logits[b, -n:]
        assert tol.check(got, z), f"{dtype} row {b}: {tol.max_violation(got, z):.3e}"


def test_install_table_has_the_moe_forwards():
    from rl_engine.integrations.hf.install import SUBSTITUTIONS

    for cls, fn in MOE_SUBSTITUTIONS.items():
        assert SUBSTITUTIONS[cls] is fn


def test_rlk_check_engine_hf_on_qwen3_moe():
    """``rlk check --engine hf --preset qwen3-moe-tiny``: generate vs the training forward through
    transformers' Qwen3-MoE, installed (R/R: 0 mismatches) and unpatched (P/P: the negative control)."""
    import json

    from typer.testing import CliRunner

    from rl_engine.entrypoints.cli import app

    def run(plan):
        res = CliRunner().invoke(app, ["check", "--engine", "hf", "--preset", "qwen3-moe-tiny", "--num-prompts", "4",
                                       "--max-new-tokens", "6", "--plan", plan, "--json"])
        return res.exit_code, json.loads(res.stdout)

    code, rr = run("R/R")
    assert code == 0 and rr["passed"] and rr["compared_tokens"] > 0
    assert rr["model_spec"]["model_type"] == "qwen3_moe"
    code, pp = run("P/P")
    assert code == 1 and pp["mismatched_tokens"] > 0
