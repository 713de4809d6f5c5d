"""vLLM at tensor-parallel size 2 (two CPU worker processes) with the rl_engine plugin: the
log-probs vLLM returns equal the TP=1 training side's raw-bit, fp32 and bf16, greedy and
sampled, mixed prompt lengths with chunked prefill; every rank ran only rl_engine operators.
Row-parallel layers (o_proj, down_proj) run with the unsharded K order
(``RlkRowParallelLinear``), which is what makes TP=2 equal TP=1. Negative control: native vLLM
at TP=2 mismatches.

Runs in .venv-vllm only (one subprocess, tp2_worker.py: multiprocess vLLM needs a fresh
``__main__``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm, created by make test)")

from rl_engine.integrations.vllm import QWEN3_KINDS, assert_no_fallbacks  # noqa: E402
from rl_engine.integrations.vllm.parity import write_tiny_checkpoint  # noqa: E402

WORKER = Path(__file__).with_name("tp2_worker.py")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_tp2")
    ckpt = write_tiny_checkpoint(d / "tiny", seed=0)
    out = d / "tp2.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
               VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("RLK_VLLM", None)
    p = subprocess.run([sys.executable, str(WORKER), str(ckpt), str(out), "rlk:float32", "rlk:bfloat16",
                        "native:bfloat16"], env=env, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=540)
    assert p.returncode == 0 and out.exists(), p.stdout[-6000:]
    return {(r["plan"], r["dtype"]): r for r in json.loads(out.read_text())}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_tp2_logprobs_equal_tp1_training_side(tp2, dtype, mode):
    r = tp2[("rlk", dtype)]["runs"][mode]
    assert r["compared_tokens"] == 48 and r["mismatched_tokens"] == 0, r
    assert len({s["prompt_len"] for s in r["per_sequence"]}) > 1  # mixed prompt lengths


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_every_rank_ran_only_rl_engine(tp2, dtype):
    prov = tp2[("rlk", dtype)]["provenance"]
    assert sorted(p["rank"] for p in prov) == [0, 1] and len({p["pid"] for p in prov}) == 2
    assert_no_fallbacks(prov, require=QWEN3_KINDS)
    for p in prov:
        assert p["mode"] == "strict" and p["native_calls"] == {}
        ops = {o["op"] for o in p["operators"]}
        assert {"gemm.linear", "norm.rms_norm", "norm.fused_add_rms_norm", "rope.apply_rope",
                "activation.silu_and_mul", "attention.cached_attention", "embedding.embedding",
                "logprob.log_softmax"} <= ops, ops


def test_tp2_negative_control_native_vllm_mismatches(tp2):
    runs = tp2[("native", "bfloat16")]["runs"]
    assert all(r["compared_tokens"] == 48 for r in runs.values())
    assert runs["greedy"]["mismatched_tokens"] > 0 and runs["sampled"]["mismatched_tokens"] > 0, runs
