"""Fuzz every ``rlk`` command with malformed option values (hypothesis, derandomized).

Each malformed invocation must end in exit code 2, one clear message on stderr and no
traceback, and — with ``--json`` — exactly one JSON object ``{"error", "exit_code"}`` on stdout.
Nothing may run with a malformed value: the runners are replaced by ones that fail the test.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rl_engine.entrypoints.cli import app

runner = CliRunner()

BAD_INT = ["-5", "1.5", "abc", ""]
BAD_FLOAT = ["nan", "inf", "abc", "-1", ""]
BAD_DEVICE = ["meta", "mps", "xyz", "cuda:99", "cpu:zz"]
BAD_CHOICE = ["bogus", ""]

#: command -> option -> malformed values
SURFACE = {
    ("check",): {"--num-prompts": BAD_INT, "--max-new-tokens": BAD_INT, "--max-seqs": BAD_INT, "--seed": BAD_INT + [str(2**70), str(2**63)],
                 "--top-k": BAD_INT, "--temperature": BAD_FLOAT, "--top-p": BAD_FLOAT + ["1.5", "0"],
                 "--device": BAD_DEVICE, "--dtype": BAD_CHOICE, "--plan": ["X/Y", "R", ""], "--kv-cache": BAD_CHOICE,
                 "--engine": BAD_CHOICE, "--preset": BAD_CHOICE, "--threads": BAD_INT[:3],
                 "--model": ["/nonexistent/model"]},
    ("validate", "chain"): {"--device": BAD_DEVICE, "--plan": ["X/Y", ""], "--inject": BAD_CHOICE,
                            "--workload": ["/nonexistent.json", "no-such-workload"], "--out": ["/proc/rlk-out"]},
    ("validate", "ws2"): {"--tp": ["3", "0", "abc", "16", ""], "--dp": ["3", "", "1,x"], "--device": BAD_DEVICE,
                          "--inject": ["gemm"], "--workload": ["/nonexistent.json"]},
    ("debug",): {"--device": BAD_DEVICE, "--plan-a": ["X/Y"], "--sample": ["-1", "abc"], "--out": ["/proc/rlk-out"]},
    ("ops",): {"--device": BAD_CHOICE + ["meta"]},
    ("report",): {"": ["/nonexistent/run", "/proc"]},
    ("env",): {"--bogus": ["1"]},
}


@pytest.fixture(autouse=True)
def _nothing_runs(monkeypatch):
    def ran(*a, **k):
        raise AssertionError("a command ran its work with a malformed argument")

    import rl_engine.entrypoints.validate as v
    import rl_engine.validation.parity as parity

    monkeypatch.setattr(parity, "run_parity", ran)
    monkeypatch.setattr(v, "run_suite", ran)


def _invocations():
    items = [(cmd, opt, val) for cmd, opts in SURFACE.items() for opt, vals in opts.items() for val in vals]
    return st.sampled_from(items)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(inv=_invocations(), as_json=st.booleans())
def test_malformed_cli_arguments_exit_2_with_a_clear_error(inv, as_json):
    cmd, opt, val = inv
    argv = [*cmd, *([opt, val] if opt else [val]), *(["--json"] if as_json else [])]
    res = runner.invoke(app, argv)
    assert res.exit_code == 2, (argv, res.output, res.exception)
    assert "Traceback" not in res.output, argv
    assert not isinstance(res.exception, AssertionError), (argv, res.exception)
    assert res.stderr.strip(), argv
    if as_json:
        lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
        assert len(lines) == 1, (argv, res.stdout)
        obj = json.loads(lines[0])
        assert set(obj) == {"error", "exit_code"} and obj["exit_code"] == 2 and obj["error"], (argv, obj)
