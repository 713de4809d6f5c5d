"""vLLM (CPU) with the rl_engine plugin on Qwen3-MoE (``qwen3-moe-tiny``: 16 experts, 4 per token):
the log-probs vLLM returns for its generated tokens equal the training side's (rl_engine's
Qwen3-MoE, one packed forward) raw-bit, at tensor-parallel size 1 (in-process) and 2 (two worker
processes), fp32 and bf16, greedy and sampled, mixed prompt lengths with chunked prefill. vLLM's
``GateLinear``, ``RoutedExperts`` and ``MoERunner`` are replaced (strict mode: zero native
forwards on every rank); the expert weights stay in the checkpoint layout. Negative control:
native vLLM (its CPU fused-MoE kernels) mismatches at TP 1 and 2.

Runs in .venv-vllm only; the TP=1 builds happen once in a module fixture, the TP=2 runs in one
subprocess (tp2_worker.py: multiprocess vLLM needs a fresh ``__main__``)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm, created by make test)")

from rl_engine.integrations.vllm import QWEN3_MOE_KINDS, assert_no_fallbacks, install, uninstall, vllm_provenance  # noqa: E402
from rl_engine.integrations.vllm import parity  # noqa: E402

WORKER = Path(__file__).with_name("tp2_worker.py")
REPO = Path(__file__).resolve().parents[3]
ENGINE = dict(enforce_eager=True, max_model_len=128, seed=0, block_size=32, max_num_batched_tokens=32, max_num_seqs=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return parity.write_tiny_checkpoint(tmp_path_factory.mktemp("vllm_moe") / "moe", preset="qwen3-moe-tiny", seed=0)


def _run(ckpt, dtype, modes, *, plugin: bool):
    from vllm import LLM

    if plugin:
        install(strict=True)
    try:
        llm = LLM(model=str(ckpt), dtype=dtype, **ENGINE)
        prompts = parity.mixed_prompts(6, 2048, seed=1, max_len=60)
        out = {}
        for name, temp in modes.items():
            rep, _ = parity.run_parity(llm, ckpt, getattr(torch, dtype), prompts, max_tokens=8, temperature=temp,
                                       seed=None)
            out[name] = rep.as_dict()
        experts = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.model.layers[0].mlp.experts
        out["layout"] = {"runner": type(experts).__name__, "w13": tuple(experts.routed_experts.w13_weight.shape),
                         "w2": tuple(experts.routed_experts.w2_weight.shape)}
        out["provenance"] = vllm_provenance(llm) if plugin else None
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        return out
    finally:
        if plugin:
            uninstall()


@pytest.fixture(scope="module")
def tp1(ckpt):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return {
        ("rlk", "float32"): _run(ckpt, "float32", {"greedy": 0.0, "sampled": 0.8}, plugin=True),
        ("rlk", "bfloat16"): _run(ckpt, "bfloat16", {"greedy": 0.0, "sampled": 0.8}, plugin=True),
        ("native", "float32"): _run(ckpt, "float32", {"greedy": 0.0}, plugin=False),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_tp1_logprobs_equal_training_side(tp1, dtype, mode):
    r = tp1[("rlk", dtype)][mode]
    assert r["compared_tokens"] == 48 and r["mismatched_tokens"] == 0, r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp1_only_rl_engine_ran_and_experts_keep_the_checkpoint_layout(tp1, dtype):
    r = tp1[("rlk", dtype)]
    assert_no_fallbacks(r["provenance"], require=QWEN3_MOE_KINDS)
    ops = {o["op"] for p in r["provenance"] for o in p["operators"]}
    assert {"moe.route", "moe.expert_gate_up", "moe.expert_down_combine"} <= ops
    assert r["layout"] == {"runner": "RlkMoERunner", "w13": (16, 128, 128), "w2": (16, 128, 64)}


def test_tp1_native_vllm_mismatches(tp1):
    r = tp1[("native", "float32")]
    assert r["greedy"]["mismatched_tokens"] > 0 and r["layout"]["runner"] == "MoERunner"


@pytest.fixture(scope="module")
def tp2(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_moe_tp2") / "tp2.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
               VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("RLK_VLLM", None)
    p = subprocess.run([sys.executable, str(WORKER), str(ckpt), str(out), "rlk:float32", "rlk:bfloat16",
                        "native:float32"], env=env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=1200)
    assert p.returncode == 0 and out.exists(), p.stdout[-6000:]
    return {(r["plan"], r["dtype"]): r for r in json.loads(out.read_text())}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_tp2_logprobs_equal_tp1_training_side(tp2, dtype, mode):
    r = tp2[("rlk", dtype)]["runs"][mode]
    assert r["compared_tokens"] == 48 and r["mismatched_tokens"] == 0, r


def test_tp2_every_rank_ran_only_rl_engine(tp2):
    for dtype in ("float32", "bfloat16"):
        prov = tp2[("rlk", dtype)]["provenance"]
        assert sorted(p["rank"] for p in prov) == [0, 1]
        assert_no_fallbacks(prov, require=QWEN3_MOE_KINDS)


def test_tp2_native_vllm_mismatches(tp2):
    assert sum(r["mismatched_tokens"] for r in tp2[("native", "float32")]["runs"].values()) > 0
