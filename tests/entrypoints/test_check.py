"""``rlk check``: the embedded default passes bitwise, the P/P control fails, HF checkpoints
load, and bad input exits 2 with a clear message."""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine.entrypoints.cli import main
from tests.helpers.op_layer import gpu_kernel_names
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
    assert prov["nan_policy"] == {"rollout": "propagate", "train": "auto"}  # the train side scans host tensors, as trainers do
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


def test_long_prompts_cross_the_kv_split_and_pass_bitwise(capsys):
    """``--extra-prompt-tokens 1000``: contexts past position 1024 (the first KV split of the
    attention contract), so the rollout decodes over caches of two splits and the train path
    merges them; every active token's bits still match."""
    code, out, _ = _run(capsys, "--extra-prompt-tokens", "1000", "--num-prompts", "6", "--json")
    res = json.loads(out)
    assert code == 0 and res["passed"] is True, res["first_mismatch"]
    assert res["extra_prompt_tokens"] == 1000 and 1024 < res["max_context"] <= 1000 + 64 + 24
    assert res["compared_tokens"] >= 200 and res["rollout"]["distinct_batch_compositions"] > 5


def test_long_prompts_paged_cache_pass_bitwise(capsys):
    """The same past the split with the rollout's cache in 16-token pages from a shared pool."""
    code, out, _ = _run(capsys, "--extra-prompt-tokens", "1000", "--kv-cache", "paged", "--num-prompts", "6", "--json")
    res = json.loads(out)
    assert code == 0 and res["passed"] is True, res["first_mismatch"]
    assert res["kv_cache"] == "paged" and res["max_context"] > 1024 and res["compared_tokens"] > 0


def test_long_prompts_large_prefill_chunks_pass_bitwise(capsys):
    """A rollout scheduler with 512-token prefill chunks and 1100-token steps: chunks that start
    before position 1024 and end past it, many sequences' chunks in one step."""
    code, out, _ = _run(capsys, "--extra-prompt-tokens", "1000", "--prefill-chunk", "512", "--max-step-tokens", "1100",
                        "--num-prompts", "6", "--json")
    res = json.loads(out)
    assert code == 0 and res["passed"] is True, res["first_mismatch"]
    ro = res["rollout"]
    assert ro["scheduler"] == {"max_seqs": 8, "prefill_chunk": 512, "max_step_tokens": 1100}
    assert 512 < ro["max_tokens_per_step"] <= 1100 + 8 and res["max_context"] > 1024


def test_long_prompts_negative_control_exits_1(capsys):
    code, out, _ = _run(capsys, "--extra-prompt-tokens", "1000", "--plan", "P/P", "--json", "--num-prompts", "4",
                        "--max-new-tokens", "12")
    res = json.loads(out)
    assert code == 1 and res["passed"] is False and res["mismatched_tokens"] > 0
    assert res["max_context"] > 1024


def test_hf_engine_long_prompts_pass_bitwise(capsys):
    """``--engine hf`` (transformers ``generate`` vs its training forward, rl_engine installed)
    past the first KV split."""
    code, out, _ = _run(capsys, "--engine", "hf", "--extra-prompt-tokens", "1000", "--num-prompts", "4",
                        "--max-new-tokens", "8", "--json")
    res = json.loads(out)
    assert code == 0 and res["passed"] is True, res["first_mismatch"]
    assert res["engine"] == "hf" and res["max_context"] > 1024 and res["compared_tokens"] > 0


def test_prompt_options_are_validated(capsys):
    code, _, err = _run(capsys, "--extra-prompt-tokens", "5000")  # tiny: max_position_embeddings 4096
    assert code == 2 and "--extra-prompt-tokens" in err and "4096" in err
    code, _, err = _run(capsys, "--preset", "qwen3-0.6b", "--model", "somewhere")
    assert code == 2 and "--preset" in err


def test_builtin_prompts_extra_tokens():
    from rl_engine.validation.parity import PROMPT_LENGTHS, builtin_prompts, check_context

    base = builtin_prompts(5, 100, 10, seed=3)
    longer = builtin_prompts(5, 100, 10, seed=3, extra_tokens=7)
    assert [len(r.prompt) for r in base] == list(PROMPT_LENGTHS[:5])  # the embedded default's prompts unchanged
    assert [len(r.prompt) for r in longer] == [n + 7 for n in PROMPT_LENGTHS[:5]]
    assert all(0 < t < 100 for r in longer for t in r.prompt)
    assert check_context(longer, 10_000) == max(len(r.prompt) + r.max_new_tokens for r in longer)
    longest = max(len(r.prompt) + r.max_new_tokens for r in longer)
    assert check_context(longer, longest) == longest
    with pytest.raises(ValueError, match=f"is {longest} tokens, more than the model's max_position_embeddings = "
                                         f"{longest - 1}"):
        check_context(longer, longest - 1)
    with pytest.raises(ValueError, match="extra_tokens"):
        builtin_prompts(2, 100, 10, seed=0, extra_tokens=-1)


def test_parity_config_rejects_unknown_preset():
    from pydantic import ValidationError

    from rl_engine.validation.parity import ParityConfig

    assert ParityConfig(preset="qwen3-0.6b").preset == "qwen3-0.6b"
    with pytest.raises(ValidationError, match="unknown preset 'qwen3-7b'"):
        ParityConfig(preset="qwen3-7b")
    from rl_engine.validation.engines.hf import load_hf_model

    with pytest.raises(ValueError, match="unknown preset 'qwen3-7b'"):  # the --engine hf loader, same rule
        load_hf_model(None, torch.float32, "cpu", 0, "qwen3-7b")


@pytest.mark.parametrize("args", [["--plan", "X/R"], ["--dtype", "float16"], ["--top-p", "0"], ["--num-prompts", "0"],
                                  ["--bogus"], ["--device", "nosuchdevice"], ["--preset", "nope"],
                                  ["--extra-prompt-tokens", "-1"], ["--kv-cache", "ring"],
                                  ["--engine", "hf", "--kv-cache", "paged"], ["--engine", "hf", "--prefill-chunk", "64"],
                                  ["--max-seqs", "0"], ["--max-step-tokens", "0"]])
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
@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_long_context_qwen3_shape_passes_bitwise_on_gpu(capsys, kv_cache):
    """The main job past the first KV split on the GPU, at Qwen3-0.6B's dimensions (random
    weights: 16 query / 8 KV heads of 128, 28 layers), bf16: prompts of 1001-1064 tokens, so
    every decode step reads a cache of two 1024-key splits (a split kernel, ``rlk_attn_fwd_split``
    or, where their bands take the step, ``hopper_transposed_decode.rlk_attn_split_wgt`` /
    ``hopper_warpgroup.rlk_attn_split_wg``,
    then ``rlk_attn_combine``)
    and the train path merges the splits (in the Hopper warpgroup forward). Every active
    token's bits must match; the attention launches the rollout made are recorded to show those
    kernels ran. ``paged``: the rollout's cache in 16-token pages from a shared pool (each key
    block gathered through the page table)."""
    from unittest import mock

    from torch.profiler import ProfilerActivity, profile

    from rl_engine.backends.triton.attention import configs, launch
    from tests.backends.triton._rowwise_common import evidence

    seen: dict[str, int] = {}
    real = launch.attend

    def spy(*args, **kw):
        cfg, path = kw.get("config"), kw["path"]
        ns = configs.num_splits(args[8])
        kind = "decode" if path == "decode" and ns > 1 else "prefill-kernel"
        layout = "paged" if args[3].shape[1] > 1 else "contiguous"  # page_rows: one column when contiguous
        key = f"{kind} splits={ns} {layout} {cfg.key if cfg is not None else 'default'}"
        seen[key] = seen.get(key, 0) + 1
        return real(*args, **kw)

    with mock.patch.object(launch, "attend", spy), profile(activities=[ProfilerActivity.CUDA]) as prof:
        code, out, _ = _run(capsys, "--device", "cuda", "--dtype", "bfloat16", "--preset", "qwen3-0.6b",
                            "--extra-prompt-tokens", "1000", "--num-prompts", "8", "--kv-cache", kv_cache, "--json")
    res = json.loads(out)
    names = set(gpu_kernel_names(prof))
    result = {k: res[k] for k in ("passed", "compared_tokens", "mismatched_tokens", "max_context", "model", "rollout",
                                  "kv_cache")}
    evidence(f"check_long_context_gpu_{kv_cache}",
             {"result": result, "attend_calls": seen, "rlk_kernels": sorted(n for n in names if "rlk_" in n)})
    assert code == 0 and res["passed"] is True, res.get("first_mismatch")
    assert res["mismatched_tokens"] == 0 and res["compared_tokens"] >= 100 and res["max_context"] > 1024
    assert res["provenance"]["fallback"] is False and res["provenance"]["native_modules"] == []
    assert res["kv_cache"] == kv_cache
    assert any(k.startswith(f"decode splits=2 {kv_cache}") for k in seen), seen  # the split-parallel decode ran
    # the rollout's split-parallel decode, and the train path's Hopper warpgroup forward (16-bit,
    # D = 128, sm90; scored under the default NaN policy, as a trainer's calls run)
    assert res["provenance"]["nan_policy"] == {"rollout": "propagate", "train": "auto"}
    # (the decode steps' splits on the Triton split kernel or on a Hopper split kernel where its band
    # takes the step: on the H200 the transposed one, configs.wgt_decode_programs)
    assert names & {"rlk_attn_fwd_split", "rlk_attn_split_wg", "rlk_attn_split_wgt"}, sorted(names)
    assert {"rlk_attn_combine", "rlk_attn_fwd_wg"} <= names, sorted(names)


@pytest.mark.gpu
def test_long_context_negative_control_fails_on_gpu(capsys):
    """Control for the test above, and the GPU's control of ``rlk check``: native torch on both
    sides at the same shape mismatches. (At the embedded tiny model's widths cuBLAS and SDPA can
    give the rollout's and the trainer's batch shapes the same bits on an H200, so the control
    runs at Qwen3-0.6B's.)"""
    code, out, _ = _run(capsys, "--device", "cuda", "--dtype", "bfloat16", "--preset", "qwen3-0.6b",
                        "--extra-prompt-tokens", "1000", "--num-prompts", "4", "--max-new-tokens", "12",
                        "--plan", "P/P", "--json")
    res = json.loads(out)
    assert code == 1 and res["passed"] is False and res["mismatched_tokens"] > 0


@pytest.mark.parametrize("args,hint,message", [
    (["--tp", "2"], "--tp", "runs one process"),
    (["--engine", "hf", "--train-engine", "megatron"], "--train-engine", "use it with --engine vllm"),
    (["--train-tp", "2"], "--train-tp", "add --train-engine megatron"),
    (["--engine", "vllm", "--train-engine", "megatron", "--train-tp", "4", "--preset", "tiny"], "--train-tp",
     "cannot split model 'tiny'"),
    (["--engine", "vllm", "--train-engine", "megatron", "--train-tp", "3"], "--train-tp", "a power of two"),
    (["--engine", "vllm", "--train-engine", "megatron", "--preset", "qwen3-moe-tiny"], "--train-tp", "dense Qwen3"),
    (["--model", "/nonexistent", "--preset", "tiny"], "--preset", "give one"),
])
def test_parallel_layout_options_reject_bad_combinations(capsys, args, hint, message):
    """Usage errors (exit 2) name the option and are raised before any engine starts."""
    code, out, err = _run(capsys, *args)
    assert code == 2, out + err
    flat = " ".join((out + err).replace("│", " ").split())
    assert hint in flat and message in flat, out + err
