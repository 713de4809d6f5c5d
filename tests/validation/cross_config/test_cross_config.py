"""Cross-config paired scoring: one knob at a time on frozen inputs; statuses."""

from __future__ import annotations

import pytest
import torch

from rl_engine.workloads import load_workload
from rl_engine.engine.executor import ScoredSequence
from rl_engine.validation.cross_config import STATUSES, paired_status, run_cross_config


@pytest.fixture(scope="module")
def cc():
    return run_cross_config(load_workload())


def test_invariant_knobs_pass_and_controls_are_detected(cc):
    by = {(r["knob"], r["value"]): r for r in cc["results"]}
    knobs = {r["knob"] for r in cc["results"]}
    assert knobs == {"batch size", "chunk size", "padding side", "permutation", "dtype", "plan"}
    for r in cc["results"]:
        assert r["status"] in STATUSES and r["tokens"] > 0
        if r["expect"] == "PASS":
            assert r["status"] == "PASS" and r["max_abs_diff"] == 0.0, r
    assert by[("dtype", "bfloat16")]["status"] == "INVALID" and by[("dtype", "bfloat16")]["max_abs_diff"] > 0
    plan = next(r for r in cc["results"] if r["knob"] == "plan")
    assert plan["status"] == "FAIL" and plan["mismatched_tokens"] > 0 and "first_mismatch" in plan
    assert cc["negative_controls"] and all(c["detected"] for c in cc["negative_controls"])
    assert cc["passed"]


def _scored(values, mask):
    return {0: ScoredSequence(0, torch.tensor(values, dtype=torch.float32), torch.tensor(mask))}


def test_paired_status_unit():
    a = _scored([0.0, -1.0, -2.0], [False, True, True])
    assert paired_status(a, _scored([0.0, -1.0, -2.0], [False, True, True]), True)[0] == "PASS"
    st, info = paired_status(a, _scored([0.0, -1.0, -2.5], [False, True, True]), True)
    assert st == "FAIL" and info["first_mismatch"]["position"] == 2 and info["max_abs_diff"] == 0.5
    assert paired_status(a, _scored([0.0, -1.0, -2.0], [False, True, True]), False)[0] == "INVALID"
    assert paired_status(a, _scored([0.0, -1.0, -2.0], [False, False, False]), True)[0] == "ZERO_ACTIVE"
    neg_zero = _scored([0.0, -0.0, -2.0], [False, True, True])  # raw bits: -0.0 is not +0.0
    assert paired_status(_scored([0.0, 0.0, -2.0], [False, True, True]), neg_zero, True)[0] == "FAIL"
