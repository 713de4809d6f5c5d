"""The model chain and the debugger on Qwen3-MoE (workload ``ws1-moe-tiny``): zero raw-bit
mismatches under R/R on layout and decode cells, gradient invariance across layouts, the MoE
negative controls (a batch-dependent MoE forward and backward) detected, native
plans caught, and the debugger naming a routing difference by token and experts."""

from __future__ import annotations

import pytest

from rl_engine.validation.chain import run_chain
from rl_engine.validation.debugger import run_debug, stage_order
from rl_engine.validation.faults import faulty_factory
from rl_engine.validation.reports import build_report, markdown
from rl_engine.workloads import load_workload

CELLS = ["packed", "padded-left", "permuted", "BN/chunked", "B1/singleton", "decode/BN-varlen"]


@pytest.fixture(scope="module")
def rr():
    return run_chain(load_workload("ws1-moe-tiny"), cells=CELLS)  # one thread: tests/validation/conftest.py


def test_cells_bitwise_equal_and_gradients_invariant(rr):
    assert sorted(c["cell"] for c in rr["cells"]) == sorted(CELLS)
    for c in rr["cells"]:
        assert c["compared_tokens"] > 0 and c["mismatched_tokens"] == 0, c
    g = rr["gradient_invariance"]
    assert g["passed"] and all(c["tokens"] > 50 for c in g["comparisons"])
    assert rr["passed"]


def test_moe_negative_controls_are_detected(rr):
    names = [c["name"] for c in rr["negative_controls"]]
    assert names == ["batch-dependent R norm (forward)", "batch-dependent R norm (backward only)",
                     "batch-dependent R moe (forward)", "batch-dependent R moe (backward only)"]
    assert all(c["detected"] for c in rr["negative_controls"]), rr["negative_controls"]


def test_native_moe_is_caught():
    r = run_chain(load_workload("ws1-moe-tiny"), plan="P/P", cells=["packed", "decode/B1-short"], grads=False,
                  with_controls=False)
    assert not r["passed"] and r["mismatched_tokens"] > 0


def test_debugger_equal_at_every_stage_including_routing():
    r = run_debug(load_workload("ws1-moe-tiny"), sample=1)
    assert r["outcome"] == "equal" and r["sparse_layers"] == [0, 1]
    assert [(s["layer"], s["stage"]) for s in r["stages"]] == stage_order(r["num_layers"], r["sparse_layers"])
    assert {"router_logits", "routing", "routing_weights"} <= {s["stage"] for s in r["stages"]}


def test_debugger_names_a_routing_difference():
    """A router whose top-k follows the batch: the first divergence is the ``routing`` stage of
    layer 0, with the experts the token chose on each side."""
    r = run_debug(load_workload("ws1-moe-tiny"), sample=2, factory=faulty_factory("moe", kind="routing"))
    f = r["first_divergence"]
    assert r["outcome"] == "diverged" and (f["layer"], f["stage"]) == (0, "routing")
    assert len(f["experts_a"]) == len(f["experts_b"]) == 4 and f["experts_a"] != f["experts_b"]
    assert f["experts_a"][:3] == f["experts_b"][:3]  # the fault moves the last rank only
    before = {(s["layer"], s["stage"]): s["equal"] for s in r["stages"]}
    assert before[(0, "router_logits")] and before[(0, "post_attention_norm")]
    lw = load_workload("ws1-moe-tiny")
    text = markdown(build_report("debug", r, lw.header(), {"sample": 2}, "cpu", {"policy": "strict"}), [])
    assert f"token position {f['position']} chose experts {f['experts_a']} on side A and {f['experts_b']} on side B" in text


def test_routing_fault_is_for_the_moe_module_only():
    from rl_engine.runtime.plan import Plan

    with pytest.raises(ValueError, match="^kind: 'routing' perturbs the moe module"):
        faulty_factory("norm", kind="routing")(Plan.parse("R/R"), "train")
