"""CLI errors: one clear line and exit 2 for bad --device / --seed / --out (no traceback, checked
before any work), and with ``--json`` every error is a JSON object on stdout."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rl_engine.entrypoints import validate as validate_cmd
from rl_engine.entrypoints.cli import app, main

runner = CliRunner()


def _json_error(res) -> dict:
    obj = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(obj) == {"error", "exit_code"} and obj["exit_code"] == res.exit_code
    return obj


@pytest.mark.parametrize("device,match", [("meta", "not on 'meta'"), ("mps", "not on 'mps'"),
                                          ("xla", "not on 'xla'"), ("cpu:x", "is not a device name"),
                                          ("bogus", "is not a device name")])
@pytest.mark.parametrize("command", [["check"], ["validate", "ws1"], ["debug"]])
def test_unsupported_devices_are_one_clear_line_and_exit_2(command, device, match):
    res = runner.invoke(app, [*command, "--device", device])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"rlk {command[0]}") and match in lines[0], res.stderr
    as_json = runner.invoke(app, [*command, "--device", device, "--json"])
    assert as_json.exit_code == 2 and match in _json_error(as_json)["error"]


@pytest.mark.parametrize("seed", [str(2**70), "-1", "2.5"])
def test_a_bad_seed_is_reported_as_a_bad_seed(seed):
    res = runner.invoke(app, ["check", "--seed", seed])
    assert res.exit_code == 2 and "--seed" in res.stderr and "model" not in res.stderr.lower()
    as_json = runner.invoke(app, ["check", "--seed", seed, "--json"])
    assert as_json.exit_code == 2 and "--seed" in _json_error(as_json)["error"]


def test_the_largest_seed_is_accepted_by_the_option():
    res = runner.invoke(app, ["check", "--seed", str(2**63 - 1), "--device", "meta"])  # stops at --device
    assert res.exit_code == 2 and "--device" in res.stderr


@pytest.mark.parametrize("kind", ["file", "under-a-file", "proc"])
def test_validate_out_unwritable_fails_before_the_suite(tmp_path, monkeypatch, kind):
    def never(*a, **k):
        raise AssertionError("the suite ran although --out is unusable")

    monkeypatch.setattr(validate_cmd, "run_suite", never)
    f = tmp_path / "afile"
    f.write_text("x")
    out = {"file": f, "under-a-file": f / "runs", "proc": "/proc/rlk-out"}[kind]
    res = runner.invoke(app, ["validate", "ws1", "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("rlk validate ws1: --out: ") and "Traceback" not in res.output
    as_json = runner.invoke(app, ["validate", "ws1", "--out", str(out), "--json"])
    assert as_json.exit_code == 2 and "--out" in _json_error(as_json)["error"]


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "--model", "/nonexistent/model", "--json"],
        ["check", "--bogus", "--json"],
        ["check", "--plan", "X/Y", "--json"],
        ["check", "--top-p", "0", "--json"],
        ["validate", "nope", "--json"],
        ["validate", "chain", "--workload", "/nonexistent.json", "--json"],
        ["debug", "--sample", "-5", "--json"],
        ["report", "/nonexistent/run", "--json"],
        ["ops", "--device", "tpu", "--json"],
        ["env", "--bogus", "--json"],
        ["no-such-command", "--json"],
    ],
)
def test_json_errors_are_a_json_object_on_stdout(argv):
    res = runner.invoke(app, argv)
    assert res.exit_code == 2, res.output
    assert _json_error(res)["error"]
    assert main(argv) == 2


def test_check_model_error_is_one_line_naming_the_model(tmp_path):
    res = runner.invoke(app, ["check", "--model", str(tmp_path / "none")])
    assert res.exit_code == 2 and res.stderr.startswith("rlk check: cannot load the model: model: directory")
