"""Consistency debugger: equal under R/R; an injected fault is located at its layer and stage."""

from __future__ import annotations

import pytest

from rl_engine.workloads import load_workload
from rl_engine.validation.capture import Capture
from rl_engine.validation.debugger import compare_captures, run_debug, stage_order
from rl_engine.validation.faults import faulty_factory


def test_rr_is_equal_at_every_stage():
    r = run_debug(load_workload(), sample=1)
    assert r["outcome"] == "equal" and r["first_divergence"] is None
    assert [(s["layer"], s["stage"]) for s in r["stages"]] == stage_order(r["num_layers"])
    assert all(s["equal"] and s["tokens"] > 1 for s in r["stages"])


@pytest.mark.parametrize("module, stage", [("norm", "input_norm"), ("activation", "mlp")])
def test_injected_fault_names_layer_and_stage(module, stage):
    r = run_debug(load_workload(), sample=2, factory=faulty_factory(module))
    assert r["outcome"] == "diverged"
    f = r["first_divergence"]
    assert (f["layer"], f["stage"]) == (0, stage)
    assert f["side_a"] != f["side_b"] and f["side_a_bits"] != f["side_b_bits"]
    before = [s for s in r["stages"] if (s["layer"], s["stage"]) == (-1, "embedding")]
    assert before[0]["equal"]


def test_native_plans_diverge_in_attention():
    r = run_debug(load_workload(), sample=0, plan_a="P/P")
    assert r["outcome"] == "diverged" and r["first_divergence"]["stage"] == "attention"


def test_not_comparable():
    assert run_debug(load_workload(), sample=99)["outcome"] == "not_comparable"
    a, b = Capture(), Capture()
    import torch

    a.set_rows([(0, 0)])
    a(-1, "embedding", torch.zeros(1, 3))
    b.set_rows([(0, 0)])
    b(-1, "embedding", torch.zeros(1, 4))
    r = compare_captures(a, b, 0, 0)
    assert r["outcome"] == "not_comparable" and "shapes" in r["reason"]
