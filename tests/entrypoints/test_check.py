"""``rlk check``: the embedded default passes bitwise, the P/P control fails, HF checkpoints
load, and bad input exits 2 with a clear message."""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine.entrypoints.cli import main
from tests.helpers.qwen3 import TINY_CONFIGS, build_hf_model

REQUIRED = {"model", "dtype", "device", "plan", "layouts", "compared_tokens", "mismatched_tokens",
            "max_abs_diff", "first_mismatch", "provenance", "passed"}


def _run(capsys, *args):
    code = main(["check", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen3")
    cfg = dict(TINY_CONFIGS["h32-gqa6-untied-3l"])
    build_hf_model(cfg, seed=4).save_pretrained(d)
    return d


def test_default_passes_bitwise(capsys):
    threads = torch.get_num_threads()
    code, out, _ = _run(capsys, "--json")
    assert torch.get_num_threads() == threads, "the command must restore the thread count"
    res = json.loads(out)
    assert res["provenance"]["torch_threads"] == 1  # auto: one thread for a tiny model
    assert REQUIRED <= set(res)
    assert code == 0 and res["passed"] is True
    assert res["mismatched_tokens"] == 0 and res["first_mismatch"] is None and res["max_abs_diff"] == 0.0
    assert res["compared_tokens"] >= 200 and res["rollout"]["active_tokens"] >= 200
    assert (res["model"], res["dtype"], res["device"], res["plan"]) == ("tiny", "float32", "cpu", "R/R")
    assert {lay["name"] for lay in res["layouts"]} == {"packed", "padded-right", "padded-left", "permuted", "micro-batched", "chunked"}
    assert res["rollout"]["distinct_batch_compositions"] > 5
    prov = res["provenance"]
    assert prov["fallback"] is False and prov["native_modules"] == []
    ops = {r["op"] for r in prov["operators"]}
    assert {"gemm.linear", "norm.rms_norm", "rope.apply_rope", "activation.silu_and_mul",
            "embedding.embedding", "logprob.linear_token_logprobs"} <= ops
    assert any(op.startswith("attention.") for op in ops)
    assert all(r["source_fingerprint"].startswith("sha256:") for r in prov["operators"])


def test_pp_negative_control_exits_1(capsys):
    code, out, _ = _run(capsys, "--plan", "P/P", "--json", "--num-prompts", "6", "--max-new-tokens", "12")
    res = json.loads(out)
    assert code == 1 and res["passed"] is False and res["mismatched_tokens"] > 0
    fm = res["first_mismatch"]
    assert fm["rollout"] != fm["train"] and {"layout", "sample_id", "position"} <= set(fm)
    assert res["provenance"]["native_modules"]


def test_human_summary_greedy_bf16_two_threads(capsys):
    code, out, _ = _run(capsys, "--dtype", "bfloat16", "--temperature", "0", "--num-prompts", "3", "--max-new-tokens", "6",
                        "--threads", "2")
    assert code == 0, out
    assert "PASS" in out and "bitwise equal" in out and "plan=R/R" in out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_checkpoint_passes(capsys, tiny_dir, dtype):
    code, out, _ = _run(capsys, "--model", str(tiny_dir), "--dtype", dtype, "--json", "--num-prompts", "8",
                        "--max-new-tokens", "12", "--top-k", "0", "--top-p", "0.8", "--temperature", "0.7")
    res = json.loads(out)
    assert code == 0 and res["passed"], res["first_mismatch"]
    assert res["model"] == str(tiny_dir) and res["model_spec"]["tie_word_embeddings"] is False


def test_load_errors_exit_2(capsys, tmp_path):
    code, _, err = _run(capsys, "--model", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err
    (tmp_path / "config.json").write_text("{broken")
    code, _, err = _run(capsys, "--model", str(tmp_path))
    assert code == 2 and "not valid JSON" in err
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    code, _, err = _run(capsys, "--model", str(tmp_path))
    assert code == 2 and "unsupported architecture" in err


@pytest.mark.parametrize("args", [["--plan", "X/R"], ["--dtype", "float16"], ["--top-p", "0"], ["--num-prompts", "0"],
                                  ["--bogus"], ["--device", "nosuchdevice"]])
def test_usage_errors_exit_2(capsys, args):
    code, _, _ = _run(capsys, *args)
    assert code == 2


def test_non_finite_weights_exit_2(capsys, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "nan-model"
    build_hf_model(dict(TINY_CONFIGS["h16-gqa2-tied-2l"])).save_pretrained(d)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.norm.weight"][3] = float("nan")
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = _run(capsys, "--model", str(d))
    assert code == 2 and "NaN or Inf" in err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_passes_bitwise_on_gpu(capsys, dtype):
    """The main job end to end on the GPU: every operator of the model runs its Triton kernel
    (provenance says so) and every active token's train log-prob equals the rollout's bits."""
    code, out, _ = _run(capsys, "--device", "cuda", "--dtype", dtype, "--json")
    res = json.loads(out)
    assert code == 0 and res["passed"] is True, res.get("first_mismatch")
    assert res["mismatched_tokens"] == 0 and res["compared_tokens"] >= 200
    assert res["device"].startswith("cuda") and res["dtype"] == dtype
    prov = res["provenance"]
    assert prov["fallback"] is False and prov["native_modules"] == []
    impls = {r["op"]: r["impl_id"] for r in prov["operators"]}
    assert any(op.startswith("attention.") for op in impls)
    assert all(i.startswith("triton.") for i in impls.values()), impls


@pytest.mark.gpu
def test_pp_negative_control_fails_on_gpu(capsys):
    """Control: native torch on both sides (cuBLAS/SDPA in different batch shapes) mismatches."""
    code, out, _ = _run(capsys, "--device", "cuda", "--dtype", "bfloat16", "--plan", "P/P", "--json")
    res = json.loads(out)
    assert code == 1 and res["passed"] is False and res["mismatched_tokens"] > 0
