"""Capture hooks of the model, and report run directories (append-only, sealed, rendered)."""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine.workloads import load_workload
from rl_engine.validation import capture as cap_mod
from rl_engine.validation.capture import LAYER_STAGES
from rl_engine.validation.chain import build_model
from rl_engine.validation.reports import SCHEMA_VERSION, ReportError, build_report, render, verify_run, write_run
from rl_engine.engine import ops_for


@pytest.fixture(scope="module")
def model():
    return build_model(load_workload().workload)


def test_tap_is_identity_without_capture():
    t = torch.ones(2)
    assert cap_mod.active() is None
    assert cap_mod.tap(0, "mlp", t) is t


def test_model_taps_every_stage_in_order(model):
    from rl_engine.runtime.plan import Plan

    ids = torch.tensor([5, 6, 7, 8])
    pos = torch.arange(4)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    ops = ops_for(Plan.parse("R/R"), "train")
    with torch.no_grad():
        plain = model.hidden_train(ids, pos, cu, ops)
        with cap_mod.capture() as outer:
            with cap_mod.capture() as cap:
                cap.set_rows([(0, p) for p in range(4)])
                tapped = model.hidden_train(ids, pos, cu, ops)
    assert cap_mod.active() is None and outer.records == []  # the innermost block records
    assert torch.equal(plain, tapped)
    L = model.spec.num_hidden_layers
    expect = [(-1, "embedding")] + [(i, s) for i in range(L) for s in LAYER_STAGES] + [(-1, "final_norm")]
    assert [(r.layer, r.stage) for r in cap.records] == expect
    assert torch.equal(cap.records[-1].value, plain)
    stages = cap.sample_stages(0)
    assert set(stages[(0, "mlp")]) == {0, 1, 2, 3}
    assert cap.sample_stages(1) == {}


def _report(passed=True):
    result = {"suite": "debug", "sample": 0, "side_a": {"path": "train", "plan": "R/R"},
              "side_b": {"path": "rollout", "plan": "R/R"}, "outcome": "diverged", "reason": "",
              "first_divergence": {"layer": 0, "stage": "mlp", "position": 2, "feature": 5, "side_a": 1.0, "side_b": 1.0000001,
                                   "side_a_bits": "0x3f800000", "side_b_bits": "0x3f800001"},
              "stages": [{"layer": -1, "stage": "embedding", "tokens": 3, "equal": True, "mismatched": 0, "max_abs_diff": 0.0},
                         {"layer": 0, "stage": "mlp", "tokens": 3, "equal": False, "mismatched": 2, "max_abs_diff": 1e-7}],
              "passed": passed}
    lw = load_workload()
    return build_report("debug", result, lw.header(), {"sample": 0}, "cpu", {"policy": "strict"})


def test_run_dir_is_sealed_append_only_and_renders(tmp_path):
    rep = _report()
    run = write_run(tmp_path, rep)
    assert (run / "COMPLETE").is_file() and (run / "summary.md").is_file()
    png = run / "plots" / "debug_per_layer_max_abs_diff.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = verify_run(run)
    assert saved["schema_version"] == SCHEMA_VERSION == 2 and saved["workload"]["sha256"] == load_workload().sha256
    assert saved["seals"]["result_sha256"] == rep["seals"]["result_sha256"]
    assert "layer 0, stage `mlp`, token position 2" in (run / "summary.md").read_text()
    first, second = render(run), render(run)
    assert (first.name, second.name) == ("rendered-1", "rendered-2")
    assert (second / "plots" / png.name).is_file()
    with pytest.raises(FileExistsError):  # append-only: existing files are never rewritten
        render(run, dest=run, verify=False)


def test_tampering_and_incomplete_runs_are_detected(tmp_path):
    run = write_run(tmp_path, _report())
    data = json.loads((run / "report.json").read_text())
    data["result"]["outcome"] = "equal"
    (run / "report.json").write_text(json.dumps(data))
    with pytest.raises(ReportError, match="seal: report.json was changed"):
        verify_run(run)
    (run / "COMPLETE").unlink()
    with pytest.raises(ReportError, match="no COMPLETE marker"):
        verify_run(run)
    with pytest.raises(ReportError, match="no report.json"):
        verify_run(tmp_path)
