"""benchmarks/operators/bench_call_overhead.py: the ``entry`` measurement (the public call with the
implementation's work replaced by its answer) and a tiny CPU run of the whole benchmark."""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine import ops
from rl_engine.runtime import registry
from tests.helpers.scripts import load_script

bench = load_script("benchmarks/operators/bench_call_overhead.py")


def test_entry_only_answers_for_one_op_and_restores_the_selection():
    x, w = torch.randn(2, 8), torch.rand(8) + 0.5
    real = ops.norm.rms_norm(x, w, 1e-6)
    answer = torch.full_like(real, 7.0)
    before = registry._selected
    with bench.entry_only("norm.rms_norm", answer):
        assert ops.norm.rms_norm(x, w, 1e-6) is answer  # the implementation did not run
        assert not torch.equal(ops.activation.silu_and_mul(torch.randn(2, 8)), answer)  # other ops untouched
    assert registry._selected is before
    assert torch.equal(ops.norm.rms_norm(x, w, 1e-6), real)  # negative control: outside, the real work


def test_entry_only_restores_after_a_failed_call():
    before = registry._selected
    with pytest.raises(ValueError, match="^x: contains NaN"):
        with bench.entry_only("norm.rms_norm", torch.zeros(1)):
            ops.norm.rms_norm(torch.tensor([[float("nan")]]), torch.ones(1), 1e-6)
    assert registry._selected is before


def test_tiny_cpu_run_reports_the_entry_time_beside_the_overhead(tmp_path):
    out = tmp_path / "o.json"
    assert bench.main(["--device", "cpu", "--calls", "5", "--repeats", "2", "--cases", "rms_norm,embedding",
                       "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    summaries = {r["op"]: r["summary"] for r in rows if "summary" in r}
    assert set(summaries) == {"rms_norm", "embedding"}
    for s in summaries.values():
        assert s["target_on"] == "overhead_us" and s["entry_us"] > 0
        assert s["meets_target"] == (s["overhead_us"] <= 15.0)
        assert s["interaction_us"] == pytest.approx(s["composed_us"] - s["entry_us"] - s["impl_us"])
        assert s["unscanned_overhead_us"] is not None
        assert s["direct_saving_us"] == pytest.approx(s["op_layer_us"] - s["public_us"])
    assert {r["implementation"] for r in rows} == {"native", "public", "entry", "impl", "composed", "unscanned",
                                                   "op_layer"}


def test_op_layer_kept_sends_every_call_through_its_custom_op_and_restores():
    """Under ``op_layer_kept`` a no-grad public call runs its ``rlk::`` op (the profiler's
    dispatcher event); outside it the direct path runs none (negative control); the decision
    function is restored, also after a failed call."""
    from rl_engine.runtime import custom_ops
    from tests.helpers.op_layer import ops_run

    x, w = torch.randn(2, 8), torch.rand(8) + 0.5
    real = custom_ops.direct_call_ok
    run = bench._op_layer(lambda: ops.norm.rms_norm(x, w, 1e-6))
    with run.scope():
        assert ops_run(run) == ["rlk::rms_norm_cpu"]
    assert ops_run(run) == []
    with pytest.raises(ValueError, match="^x: contains NaN"):
        with bench.op_layer_kept():
            ops.norm.rms_norm(torch.tensor([[float("nan")]]), torch.ones(1), 1e-6)
    assert custom_ops.direct_call_ok is real


def test_unscanned_runs_the_public_call_without_the_nan_scan():
    """``unscanned`` is the public call inside ``nan_policy("propagate")``: a NaN activation
    passes there (its scope) and is refused outside it (negative control)."""
    x, w = torch.tensor([[float("nan"), 1.0]]), torch.ones(2)
    run = bench._unscanned(lambda: ops.norm.rms_norm(x, w, 1e-6))
    with run.scope():
        assert torch.isnan(run()).all()
    with pytest.raises(ValueError, match="^x: contains NaN"):
        run()


def test_composed_runs_the_entry_then_the_implementation():
    """``composed`` = the entry call (whose answer stands in for the implementation's) and then
    the implementation: its result is the implementation's, not the stand-in's; outside the
    scope the entry piece runs the real work (negative control)."""
    x, w = torch.randn(2, 8), torch.rand(8) + 0.5
    calls = []
    stand_in = torch.full((2, 8), 7.0)

    def public():
        return ops.norm.rms_norm(x, w, 1e-6)

    entry = bench._entry("norm.rms_norm", public)
    entry.answer = stand_in
    impl = bench._impl("norm.rms_norm", x, {"H": 8})
    composed = bench._composed(entry, lambda: calls.append(1) or impl(x, w, 1e-6))
    with composed.scope():
        assert entry() is stand_in
        out = composed()
    assert calls == [1] and torch.equal(out, public())
    assert not torch.equal(entry(), stand_in)


def test_neutral_controls_time_each_kind_alone_and_before_the_implementation(tmp_path):
    """``--neutral``: every kind of neutral work alone and before the implementation, and the
    implementation alone; each ``kind+impl`` call runs both pieces (negative control: a piece that
    is not called leaves its counter at zero)."""
    calls = {"impl": 0}
    x = torch.randn(1, 256)
    fns = bench.neutral_cases(lambda: calls.__setitem__("impl", calls["impl"] + 1), x)
    assert set(fns) == {"impl", "python", "reductions", "allocations", "python+impl", "reductions+impl",
                        "allocations+impl"}
    fns["python"]()
    assert calls["impl"] == 0
    fns["python+impl"]()
    fns["allocations+impl"]()
    assert calls["impl"] == 2
    out = tmp_path / "n.json"
    assert bench.main(["--device", "cpu", "--calls", "3", "--repeats", "2", "--cases", "embedding", "--neutral",
                       "--out", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["op"] == "rms_norm.neutral"]
    assert len(rows) == 7
    summary = next(r["summary"] for r in rows if r["implementation"] == "impl")
    assert set(summary) == {"impl_us", "python_us", "python_interaction_us", "reductions_us",
                            "reductions_interaction_us", "allocations_us", "allocations_interaction_us"}
    dispatch = [r for r in json.loads(out.read_text())["rows"] if r["op"] == "dispatch.custom_op"]
    assert {r["implementation"] for r in dispatch} == {"function", "custom_op", "custom_op_autograd"}
    summary = next(r["summary"] for r in dispatch if r["implementation"] == "function")
    assert summary["dispatch_us"] == summary["custom_op_us"] - summary["function_us"]


def test_dispatch_controls_compute_the_same_copy_through_each_layer():
    """``dispatch_cases``: the function called directly, as a custom operator and as one with an
    autograd formula return the same copy of ``x``, and the two operators go through torch's
    dispatcher (they are ``torch.ops`` operators; the function is not)."""
    x = torch.randn(1, 256)
    fns = bench.dispatch_cases(x)
    assert set(fns) == {"function", "custom_op", "custom_op_autograd"}
    outs = {k: f() for k, f in fns.items()}
    assert all(torch.equal(o, x) and o.data_ptr() != x.data_ptr() for o in outs.values())
    assert hasattr(torch.ops.rlk_bench, "copy_row") and hasattr(torch.ops.rlk_bench, "copy_row_autograd")
    assert bench.dispatch_cases(x).keys() == fns.keys()  # registered once: a second call does not re-register
