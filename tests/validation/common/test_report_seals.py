"""Run directories cannot be edited unnoticed: every field of report.json (the verdict
included) and every file is sealed, the manifest must list exactly the run's files, paths stay
inside the run directory, and malformed seal files are a clear error (``rlk report`` exit 2;
a seal mismatch exits 1)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_engine.workloads import load_workload
from rl_engine.entrypoints.cli import app
from rl_engine.validation.reports import ReportError, SealError, build_report, verify_run, write_run

runner = CliRunner()


def _failing_run(tmp_path: Path) -> Path:
    result = {"plan": "P/P", "compared_tokens": 10, "mismatched_tokens": 4, "passed": False,
              "cells": [{"cell": "packed", "layout": "packed", "compared_tokens": 10, "mismatched_tokens": 4,
                         "max_abs_diff": 1e-6, "passed": False}]}
    rep = build_report("chain", result, load_workload().header(), {"suite": "chain", "plan": "P/P"}, "cpu",
                       {"policy": "strict"})
    return write_run(tmp_path, rep)


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    os.chmod(path, 0o644)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _reseal(run: Path, name: str) -> None:
    """What a forger does next: fix the file's entry in COMPLETE."""
    import hashlib

    _edit_json(run / "COMPLETE", lambda c: c["files"].__setitem__(name, hashlib.sha256((run / name).read_bytes()).hexdigest()))


def _report_code(run: Path) -> int:
    return runner.invoke(app, ["report", str(run), "--json"]).exit_code


def test_an_untouched_run_verifies(tmp_path):
    run = _failing_run(tmp_path)
    rep = verify_run(run)
    assert rep["passed"] is False and set(rep["seals"]) == {"inputs_sha256", "result_sha256", "report_sha256"}
    assert _report_code(run) == 0


TOP_LEVEL_EDITS = {
    "passed": lambda r: r.__setitem__("passed", True),
    "suite": lambda r: r.__setitem__("suite", "ws1"),
    "created_utc": lambda r: r.__setitem__("created_utc", "2000-01-01T00:00:00+00:00"),
    "environment": lambda r: r["environment"].__setitem__("torch", "9.9"),
    "provenance": lambda r: r["provenance"].__setitem__("policy", "diagnostic"),
    "workload": lambda r: r["workload"].__setitem__("version", 99),
    "options": lambda r: r["options"].__setitem__("plan", "R/R"),
    "result": lambda r: r["result"].__setitem__("passed", True),
    "schema_version": lambda r: r.__setitem__("schema_version", 1),
    "seals": lambda r: r["seals"].__setitem__("result_sha256", "0" * 64),
    "extra field": lambda r: r.__setitem__("note", "ok"),
}


@pytest.mark.parametrize("field", sorted(TOP_LEVEL_EDITS))
def test_every_report_field_is_sealed_even_after_resealing_the_file(tmp_path, field):
    run = _failing_run(tmp_path)
    _edit_json(run / "report.json", TOP_LEVEL_EDITS[field])
    with pytest.raises(SealError, match="^seal: report.json was changed"):
        verify_run(run)
    _reseal(run, "report.json")  # the manifest now agrees with the edited file
    with pytest.raises(ReportError):
        verify_run(run)
    assert _report_code(run) in (1, 2)


def test_the_verdict_and_result_cannot_be_flipped_together(tmp_path):
    run = _failing_run(tmp_path)

    def flip(r):
        r["passed"] = True
        r["result"]["passed"] = True
        r["result"]["mismatched_tokens"] = 0

    _edit_json(run / "report.json", flip)
    _reseal(run, "report.json")
    with pytest.raises(SealError, match="^seal: result_sha256"):
        verify_run(run)
    assert _report_code(run) == 1


@pytest.mark.parametrize("manifest", [{}, {"report.json": None}, {"summary.md": None}])
def test_an_empty_or_partial_manifest_is_rejected(tmp_path, manifest):
    run = _failing_run(tmp_path)
    files = json.loads((run / "COMPLETE").read_text())["files"]
    kept = {k: files[k] for k in manifest}
    _edit_json(run / "COMPLETE", lambda c: c.__setitem__("files", kept))
    with pytest.raises(SealError, match="^seal: (COMPLETE does not list|.* is not listed in COMPLETE)"):
        verify_run(run)
    assert _report_code(run) == 1


def test_a_plot_left_out_of_the_manifest_or_added_later_is_detected(tmp_path):
    run = _failing_run(tmp_path)
    plot = next(k for k in json.loads((run / "COMPLETE").read_text())["files"] if k.startswith("plots/"))
    _edit_json(run / "COMPLETE", lambda c: c["files"].pop(plot))
    with pytest.raises(SealError, match=f"^seal: {plot} is not listed in COMPLETE"):
        verify_run(run)
    run2 = _failing_run(tmp_path / "b")
    (run2 / "plots" / "extra.png").write_bytes(b"\x89PNG")
    with pytest.raises(SealError, match="^seal: plots/extra.png is not listed"):
        verify_run(run2)


@pytest.mark.parametrize("name", ["summary.md", "plots"])
def test_every_file_is_sealed(tmp_path, name):
    run = _failing_run(tmp_path)
    target = run / name if name != "plots" else next((run / "plots").glob("*.png"))
    os.chmod(target, 0o644)
    target.write_bytes(target.read_bytes() + b"x")
    with pytest.raises(SealError, match="was changed or removed"):
        verify_run(run)
    target.unlink()
    with pytest.raises(SealError, match="was changed or removed"):
        verify_run(run)


@pytest.mark.parametrize("path", ["../../../../etc/hostname", "/etc/hostname", "plots/../../x", "./report.json",
                                  "plots\\\\x.png"])
def test_manifest_paths_outside_the_run_directory_are_rejected(tmp_path, path):
    run = _failing_run(tmp_path)
    _edit_json(run / "COMPLETE", lambda c: c["files"].__setitem__(path, "0" * 64))
    with pytest.raises(SealError, match="^seal: COMPLETE names .* outside the run directory"):
        verify_run(run)
    assert _report_code(run) == 1


def test_a_symlink_out_of_the_run_directory_is_rejected(tmp_path):
    run = _failing_run(tmp_path / "run")
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    (run / "plots" / "link.png").symlink_to(outside)
    import hashlib

    _edit_json(run / "COMPLETE", lambda c: c["files"].__setitem__("plots/link.png", hashlib.sha256(b"secret").hexdigest()))
    with pytest.raises(SealError, match="symbolic link"):
        verify_run(run)
    os.symlink(tmp_path, run / "up")
    with pytest.raises(SealError, match="symbolic link"):
        verify_run(run)


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "^COMPLETE: not readable as JSON"),
        ("[]", "^COMPLETE: expected a JSON object with a 'files' object"),
        ('{"schema_version": 2, "files": []}', "^COMPLETE: expected a JSON object with a 'files' object"),
        ('{"schema_version": 2, "files": {"report.json": 5}}', "^COMPLETE: expected a sha256"),
        ('{"files": {}}', "^COMPLETE: schema_version None"),
        ("", "^COMPLETE: not readable as JSON"),
    ],
)
def test_a_malformed_manifest_is_a_clear_error_exit_2(tmp_path, content, match):
    run = _failing_run(tmp_path)
    os.chmod(run / "COMPLETE", 0o644)
    (run / "COMPLETE").write_text(content)
    with pytest.raises(ReportError, match=match) as exc:
        verify_run(run)
    assert not isinstance(exc.value, SealError)
    res = runner.invoke(app, ["report", str(run), "--json"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert json.loads(res.stdout)["exit_code"] == 2


def test_a_malformed_report_json_is_a_clear_error_exit_2(tmp_path):
    run = _failing_run(tmp_path)
    os.chmod(run / "report.json", 0o644)
    (run / "report.json").write_text("[1, 2")
    _reseal(run, "report.json")
    with pytest.raises(ReportError, match="^report.json: not readable as JSON"):
        verify_run(run)
    res = runner.invoke(app, ["report", str(run)])
    assert res.exit_code == 2 and "Traceback" not in res.output
