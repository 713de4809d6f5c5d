"""``rlk validate``, ``rlk debug`` and ``rlk report``: JSON output, run directories, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_engine.workloads import load_workload
from rl_engine.entrypoints.cli import app
from tests.helpers.threads import threads

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with threads(1):
        yield


def _json(result) -> dict:
    return json.loads(result.stdout)


def test_validate_ws1_json_every_cell_green():
    res = runner.invoke(app, ["validate", "ws1", "--json"])
    assert res.exit_code == 0, res.output
    rep = _json(res)
    assert rep["schema_version"] == 2 and rep["suite"] == "ws1" and rep["passed"]
    assert rep["result"]["counts"]["green"] >= 50 and rep["result"]["counts"]["red"] == 0
    assert rep["workload"]["sha256"] == load_workload().sha256
    assert set(rep["seals"]) == {"inputs_sha256", "result_sha256", "report_sha256"}
    assert rep["environment"]["platform"]["family"] == "cpu"


def test_validate_cross_config_with_injected_fault_exits_1():
    res = runner.invoke(app, ["validate", "cross-config", "--json", "--inject", "norm"])
    assert res.exit_code == 1, res.output
    rep = _json(res)
    assert rep["provenance"]["injected_fault"] == "norm"
    assert any(r["status"] == "FAIL" and r["expect"] == "PASS" for r in rep["result"]["results"])


def test_validate_writes_a_run_dir_that_report_renders(tmp_path):
    res = runner.invoke(app, ["validate", "cross-config", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    (run,) = list(tmp_path.iterdir())
    assert (run / "COMPLETE").is_file() and (run / "plots" / "cross_config_per_token_abs_dlogp.png").is_file()
    rep = runner.invoke(app, ["report", str(run), "--json"])
    assert rep.exit_code == 0, rep.output
    out = _json(rep)
    assert out["passed"] and out["rendered"].endswith("rendered-1")
    assert [Path(p).name for p in out["plots"]] == ["cross_config_per_token_abs_dlogp.png"]
    md = runner.invoke(app, ["report", str(run)])
    assert md.exit_code == 0 and "rlk validate cross-config: PASS" in md.stdout
    (run / "summary.md").write_text("edited")
    assert runner.invoke(app, ["report", str(run)]).exit_code == 1  # seal mismatch
    assert runner.invoke(app, ["report", str(tmp_path)]).exit_code == 2  # not a run directory


def test_debug_exit_codes(tmp_path):
    ok = runner.invoke(app, ["debug", "--json", "--sample", "1"])
    assert ok.exit_code == 0, ok.output
    assert _json(ok)["result"]["outcome"] == "equal"
    bad = runner.invoke(app, ["debug", "--json", "--sample", "2", "--inject", "norm", "--out", str(tmp_path)])
    assert bad.exit_code == 1, bad.output
    f = _json(bad)["result"]["first_divergence"]
    assert (f["layer"], f["stage"]) == (0, "input_norm")
    (run,) = list(tmp_path.iterdir())
    assert (run / "plots" / "debug_per_layer_max_abs_diff.png").is_file()
    missing = runner.invoke(app, ["debug", "--sample", "99"])
    assert missing.exit_code == 2 and "not_comparable" in missing.stdout


@pytest.mark.parametrize("argv", [
    ["validate"],
    ["validate", "nope"],
    ["validate", "ws1", "--plan", "X/Y"],
    ["validate", "chain", "--inject", "flux"],
    ["validate", "ws1", "--inject", "norm"],
    ["validate", "ws1", "--workload", "no-such-workload"],
    ["debug", "--plan-a", "Q"],
    ["debug", "--workload", "missing.json"],
    ["report"],
])
def test_usage_errors_exit_2(argv):
    assert runner.invoke(app, argv).exit_code == 2
