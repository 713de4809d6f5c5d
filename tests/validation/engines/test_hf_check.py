"""``rlk check --engine hf``: the check flow through transformers (generate vs training forward)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rl_engine.entrypoints.cli import app
from rl_engine.validation.engines.hf import HF_LAYOUTS

runner = CliRunner()
INSTALLED_OPS = {"embedding.embedding", "norm.rms_norm", "gemm.linear", "rope.apply_rope", "activation.silu_and_mul",
                 "attention.varlen_attention", "attention.cached_attention", "logprob.token_logprobs"}
ARGS = ["check", "--engine", "hf", "--num-prompts", "5", "--max-new-tokens", "7", "--json"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_hf_passes_with_install(dtype):
    res = runner.invoke(app, [*ARGS, "--dtype", dtype])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["engine"] == "hf" and out["plan"] == "R/R" and out["passed"]
    assert [lay["name"] for lay in out["layouts"]] == list(HF_LAYOUTS)
    assert out["mismatched_tokens"] == 0
    assert out["compared_tokens"] == len(HF_LAYOUTS) * out["rollout"]["active_tokens"] > 0
    ops = {r["op"] for r in out["provenance"]["operators"]}
    assert INSTALLED_OPS <= ops, ops  # every module of the model ran through rl_engine
    assert not out["provenance"]["fallback"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_hf_negative_control_unpatched(dtype):
    res = runner.invoke(app, [*ARGS, "--dtype", dtype, "--plan", "P/P", "--max-new-tokens", "16"])
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert not out["passed"] and out["mismatched_tokens"] > 0
    assert {r["op"] for r in out["provenance"]["operators"]} == {"logprob.token_logprobs"}  # only the scoring op is ours


def test_engine_hf_rejects_mixed_plans_and_bad_models(tmp_path):
    res = runner.invoke(app, [*ARGS, "--plan", "P/R"])
    assert res.exit_code == 2 and "R/R or P/P" in res.output
    res = runner.invoke(app, [*ARGS, "--model", str(tmp_path)])
    assert res.exit_code == 2 and "cannot load the model" in res.output


def test_engine_hf_human_output():
    res = runner.invoke(app, ["check", "--engine", "hf", "--num-prompts", "3", "--max-new-tokens", "4"])
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output and "padded-right" in res.output


def test_engine_hf_with_a_checkpoint_directory(tmp_path):
    from tests.helpers.qwen3 import TINY_CONFIGS, build_hf_model

    build_hf_model(TINY_CONFIGS["h32-gqa6-untied-3l"]).save_pretrained(tmp_path)
    res = runner.invoke(app, [*ARGS, "--model", str(tmp_path), "--num-prompts", "3", "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["model"] == str(tmp_path) and out["passed"] and out["model_spec"]["num_key_value_heads"] == 1
