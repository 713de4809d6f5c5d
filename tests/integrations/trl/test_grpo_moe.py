"""TRL GRPOTrainer on a tiny Qwen3-MoE (8 experts, 2 per token) with rl_engine attached: the
rollout (``generate``) log-probs and the trainer's recomputed log-probs are raw-bit equal at every
step, fp32 and bf16, with top-k sampling (the replayed kept sets); the install ran the MoE block
on ``rl_engine.ops.moe``. Negative control: plain TRL + transformers mismatches. Runs the
documented example (examples/post_training/grpo_trl_cpu.py --moe)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "post_training" / "grpo_trl_cpu.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("grpo_trl_cpu", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype,top_k", [("float32", 0), ("bfloat16", 20)])
def test_grpo_steps_on_qwen3_moe_zero_mismatches(example, tmp_path, dtype, top_k):
    from rl_engine.runtime import provenance

    with provenance.record() as calls:
        res = example.run(steps=2, dtype=dtype, output_dir=str(tmp_path), moe=True, top_k=top_k)
    for h in res["history"]:
        assert h["compared"] > 0 and h["unmatched_rows"] == 0 and h["mismatched"] == 0, h
    assert sum("loss" in r for r in res["log"]) == 2
    ops = {c.op for c in calls}
    assert {"moe.route", "moe.expert_gate_up", "moe.expert_down_combine"} <= ops
    assert not any(c.fallback for c in calls)


def test_negative_control_plain_trl_on_qwen3_moe_mismatches(example, tmp_path):
    res = example.run(steps=1, dtype="float32", native=True, output_dir=str(tmp_path), moe=True)
    assert all(h["compared"] > 0 for h in res["history"])
    assert sum(h["mismatched"] for h in res["history"]) > 0
