"""WS1 operator suite: every covered cell green on CPU, negative controls detected."""

from __future__ import annotations

import pytest
import torch

from rl_engine import contracts
from rl_engine.workloads import load_workload
from rl_engine.validation.operators import CASES, NOT_COVERED
from rl_engine.validation.ws1 import CHECKS, check_cell, run_negative_controls, run_ws1, trials_for


@pytest.fixture(scope="module")
def ws1():
    return run_ws1(load_workload())


def test_every_cell_green_on_cpu(ws1):
    red = [c for c in ws1["cells"] if c["status"] == "red"]
    assert red == []
    assert ws1["counts"]["green"] >= 50
    assert ws1["passed"]
    green_ops = {c["op"] for c in ws1["cells"] if c["status"] == "green"}
    assert green_ops == set(CASES)
    for op in CASES:  # each covered op: all four checks green in both dtypes
        for dt in ("float32", "bfloat16"):
            got = {c["check"]: c["status"] for c in ws1["cells"] if c["op"] == op and c["dtype"] == dt and c["impl"].startswith("cpu.")}
            assert set(got) == set(CHECKS), (op, dt, got)
            assert all(s in ("green", "n.a.") for s in got.values()), (op, dt, got)


def test_na_cells_carry_a_reason(ws1):
    for c in ws1["cells"]:
        if c["status"] == "n.a.":
            assert len(c["detail"]) > 10, c


def test_every_contract_is_covered_or_explained():
    ops = set(contracts.all_contracts())
    assert set(CASES) | set(NOT_COVERED) == ops
    assert not set(CASES) & set(NOT_COVERED)


def test_negative_controls_are_detected(ws1):
    assert len(ws1["negative_controls"]) == 4
    assert all(c["detected"] for c in ws1["negative_controls"]), ws1["negative_controls"]
    # and the suite verdict depends on them
    controls = run_negative_controls(9, 6, 0)
    assert [c["check"] for c in controls] == ["forward_invariance", "gradient_invariance", "forward_accuracy",
                                              "forward_invariance"]
    assert controls[-1]["op"] == "moe.expert_down_combine" and controls[-1]["detected"]


def test_trials_mix_odd_and_even_row_counts():
    t = trials_for(9, 10, 0)
    assert len(t) == 10
    assert {len(x) % 2 for x in t} == {0, 1}
    assert all(0 <= i < 9 for x in t for i in x)


def test_inaccurate_implementation_is_red_in_every_dtype():
    from rl_engine.ops.norm import rms_norm

    bad = lambda x, w, eps: rms_norm(x, w, eps) * 1.05  # noqa: E731
    for dt in (torch.float32, torch.bfloat16):
        res = check_cell(CASES["norm.rms_norm"], bad, "norm.rms_norm", dt, 9, 6, 0)
        assert res["forward_accuracy"][0] == "red" and res["gradient_accuracy"][0] == "red"
        assert res["forward_invariance"][0] == "green"  # inaccurate yet invariant: the checks are independent
