"""``rlk check --engine vllm``: vLLM generate (plugin on / off) vs rl_engine and transformers
scoring, raw bits. The vLLM tests run in the vLLM environment (``.venv-vllm``, the second
``pytest`` of ``make test``) and run the real ``rlk`` console script of that environment in a
subprocess (one vLLM engine per process); the main environment checks the missing-vLLM message."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_engine.entrypoints.cli import app

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="needs the vLLM environment (.venv-vllm, created by make test)")
RLK = Path(sys.executable).with_name("rlk")
ARGS = ["check", "--engine", "vllm", "--json", "--num-prompts", "6", "--max-new-tokens", "10"]
QWEN3_OPS = {"gemm.linear", "norm.rms_norm", "norm.fused_add_rms_norm", "rope.apply_rope", "activation.silu_and_mul",
             "embedding.embedding", "attention.cached_attention", "logprob.log_softmax"}


def _rlk(*args: str, timeout: float = 300) -> tuple[int, dict | None, str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    env.pop("RLK_VLLM", None)
    p = subprocess.run([str(RLK), *args], capture_output=True, text=True, timeout=timeout, env=env)
    try:
        out = json.loads(p.stdout) if "--json" in args else None
    except json.JSONDecodeError as exc:
        raise AssertionError(f"stdout is not JSON (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}") from exc
    return p.returncode, out, p.stdout + p.stderr


@needs_vllm
@pytest.mark.parametrize("dtype,temperature", [("float32", "1.0"), ("bfloat16", "0")])
def test_engine_vllm_plugin_on_passes(dtype, temperature):
    from rl_engine.validation.engines.vllm import VLLM_LAYOUTS
    from rl_engine.integrations.vllm import QWEN3_KINDS, assert_no_fallbacks

    code, res, log = _rlk(*ARGS, "--dtype", dtype, "--temperature", temperature)
    assert code == 0, log[-4000:]
    assert res["engine"] == "vllm" and res["plan"] == "R/R" and res["passed"] is True
    assert [lay["name"] for lay in res["layouts"]] == list(VLLM_LAYOUTS)
    assert res["mismatched_tokens"] == 0 and res["first_mismatch"] is None and res["max_abs_diff"] == 0.0
    assert res["compared_tokens"] == len(VLLM_LAYOUTS) * res["rollout"]["active_tokens"] > 0
    prov = res["provenance"]
    assert len(prov["vllm"]) == 1 and prov["vllm"][0]["mode"] == "strict"
    # every Qwen3 kind ran through rl_engine in vLLM, zero native forwards; the returned log-probs from
    # compute_logprobs (greedy) or the sampler's processed path (sampled)
    logprob_kind = "Sampler.compute_logprobs" if temperature == "0" else "Sampler.processed_logprobs"
    assert_no_fallbacks(prov["vllm"], require=tuple(k for k in QWEN3_KINDS if k != "Sampler.compute_logprobs")
                        + (logprob_kind,))
    assert QWEN3_OPS <= {o["op"] for o in prov["vllm"][0]["operators"]}
    assert not prov["fallback"] and prov["native_modules"] == []
    train_ops = {o["op"] for o in prov["operators"]}  # the train side: rl_engine Qwen3 + HF install
    assert {"gemm.linear", "attention.varlen_attention", "logprob.token_logprobs"} <= train_ops


@needs_vllm
def test_engine_vllm_plugin_off_is_the_negative_control():
    """Rollout P: vLLM's own kernels; the same flow finds mismatching tokens and exits 1."""
    code, res, log = _rlk(*ARGS, "--plan", "R/P")
    assert code == 1, log[-4000:]
    assert res["passed"] is False and res["mismatched_tokens"] > 0
    assert res["provenance"]["vllm"] == [] and res["provenance"]["native_modules"] == ["rollout: all (native vLLM)"]
    fm = res["first_mismatch"]
    assert fm["rollout"] != fm["train"] and {"layout", "sample_id", "position"} <= set(fm)


@needs_vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_vllm_top_k_top_p_processed_passes_and_full_is_the_negative_control(dtype):
    """vLLM samples with top-k and top-p under the plugin (rl_engine's canonical filter in its
    sampler, ``processed_logprobs``); the kept-set records reach the train side: every layout
    raw-bit equal. Scored over the whole vocabulary (``--logprobs full``) every filtered token
    differs, in every layout."""
    sampling = ["--dtype", dtype, "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9"]
    code, res, log = _rlk(*ARGS, *sampling)
    assert code == 0, log[-4000:]
    assert res["passed"] and res["mismatched_tokens"] == 0 and res["sampling"]["logprobs"] == "processed"
    filtered = res["sampling"]["filtered_tokens"]
    assert filtered > 0 and "canonical" in res["sampling"]["kept_sets"]
    code, full, log = _rlk(*ARGS, *sampling, "--logprobs", "full")
    assert code == 1, log[-4000:]
    assert full["sampling"]["filtered_tokens"] == filtered
    assert full["mismatched_tokens"] == filtered * len(full["layouts"]) > 0


@needs_vllm
def test_engine_vllm_long_prompts_pass():
    """``--extra-prompt-tokens 1000``: vLLM's paged cache past the first 1024-key KV split (the
    plugin's paged attention) against rl_engine / transformers scoring, raw bits."""
    code, res, log = _rlk("check", "--engine", "vllm", "--json", "--num-prompts", "4", "--max-new-tokens", "8",
                          "--extra-prompt-tokens", "1000")
    assert code == 0, log[-4000:]
    assert res["passed"] is True and res["mismatched_tokens"] == 0 and res["compared_tokens"] > 0
    assert res["extra_prompt_tokens"] == 1000 and res["max_context"] > 1024


@needs_vllm
def test_engine_vllm_bad_model_exits_2(tmp_path):
    code, _, log = _rlk("check", "--engine", "vllm", "--num-prompts", "2", "--max-new-tokens", "3", "--model", str(tmp_path))
    assert code == 2 and "cannot load" in log, log[-2000:]


@needs_vllm
def test_engine_hf_under_the_vllm_envs_transformers():
    """transformers 5.19 (pinned by vllm-cpu) hands the KV cache to attention as
    ``past_key_values``: the HF install must still use it in ``generate`` (it once ignored it)."""
    import transformers

    res = CliRunner().invoke(app, ["check", "--engine", "hf", "--json", "--num-prompts", "4", "--max-new-tokens", "8"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["passed"] and out["mismatched_tokens"] == 0 and out["compared_tokens"] > 0
    assert out["provenance"]["transformers"] == transformers.__version__


def test_engine_vllm_without_vllm_says_where_to_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as in the main environment
    res = CliRunner().invoke(app, ["check", "--engine", "vllm"])
    assert res.exit_code == 2
    assert "run it in the vLLM env: .venv-vllm/bin/rlk check --engine vllm" in res.output


@needs_vllm
def test_engine_vllm_tp2_against_megatron_tp4_passes_and_native_row_reduction_mismatches():
    """The rollout at vLLM TP 2, the train side at Megatron TP 4 (gloo ranks): raw-bit equal on
    every sampled token (top-k / top-p, processed log-probs). Negative control: plan P/R gives
    Megatron its native K-shard all-reduce in the row-parallel layers, which must differ."""
    small = ("--num-prompts", "4", "--max-new-tokens", "8")
    code, res, log = _rlk("check", "--engine", "vllm", "--tp", "2", "--train-engine", "megatron", "--train-tp", "4",
                          "--json", *small, timeout=600)
    assert code == 0, log[-4000:]
    assert res["model"] == "tiny-tp" and (res["tp"], res["train_engine"], res["train_tp"]) == (2, "megatron", 4)
    assert [lay["name"] for lay in res["layouts"]] == ["megatron-tp4"]
    assert res["mismatched_tokens"] == 0 and res["compared_tokens"] == res["rollout"]["active_tokens"] > 0
    assert res["sampling"]["filtered_tokens"] > 0  # the kept sets were replayed across engines
    assert len(res["provenance"]["vllm"]) == 2 and not res["provenance"]["fallback"]  # both vLLM ranks, rl_engine only
    code, res, log = _rlk("check", "--engine", "vllm", "--train-engine", "megatron", "--train-tp", "4", "--plan", "P/R",
                          "--json", *small, timeout=600)
    assert code == 1, log[-4000:]
    assert res["mismatched_tokens"] > 0
    assert res["provenance"]["native_modules"] == ["train: Megatron's native row-parallel all-reduce"]
