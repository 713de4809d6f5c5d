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
    assert {r["implementation"] for r in rows} == {"native", "public", "entry", "impl"}
