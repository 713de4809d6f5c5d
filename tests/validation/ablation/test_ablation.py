"""Plans × ablation: drift attributed to the right modules; the injected control is named."""

from __future__ import annotations

import pytest

from rl_engine.workloads import load_workload
from rl_engine.runtime.plan import MODULES
from rl_engine.validation.ablation import ablation_plans, attribute, run_ablation, run_ablation_plans
from rl_engine.validation.chain import build_model
from rl_engine.validation.faults import faulty_factory


@pytest.fixture(scope="module")
def ablation():
    return run_ablation(load_workload(), control_module="norm")


def test_plans_cover_every_module_both_ways():
    plans = ablation_plans()
    assert len(plans) == 2 + 2 * len(MODULES)
    for m in MODULES:
        assert plans[f"R/R-{m}"].side("train")[m] == "P" and plans[f"R/R-{m}"].side("rollout")[m] == "P"
        assert sum(v == "P" for v in plans[f"R/R-{m}"].choices.values()) == 2
        assert sum(v == "R" for v in plans[f"P/P+{m}"].choices.values()) == 2


def test_rr_is_bitwise_and_native_drift_is_attributed(ablation):
    runs = ablation["runs"]
    assert runs["R/R"]["passed"] and not runs["P/P"]["passed"]
    # native attention (SDPA prefill vs decode) and native GEMM (shape-dependent BLAS) drift on CPU
    assert ablation["attribution"]["modules"] == ["attention", "gemm"]
    assert ablation["passed"]


def test_injected_control_is_named(ablation):
    (control,) = ablation["negative_controls"]
    assert control["detected"] and control["attributed"] == ["norm"]


@pytest.mark.parametrize("module", ["activation", "logprob"])
def test_other_injected_modules_are_named(module):
    w = load_workload()
    res = run_ablation_plans(build_model(w.workload), w, faulty_factory(module))
    assert res["attribution"]["modules"] == [module]


def test_attribution_rule():
    ok = {"passed": True}
    bad = {"passed": False}
    runs = {"R/R": ok, "P/P": bad, **{f"R/R-{m}": ok for m in MODULES}, **{f"P/P+{m}": bad for m in MODULES}}
    runs["R/R-rope"] = bad
    assert attribute(runs)["modules"] == ["rope"]
    runs = {**runs, "R/R": bad, **{f"R/R-{m}": bad for m in MODULES}}
    a = attribute(runs)
    assert a["modules"] == [] and not a["determined"]
