"""The parity gate (``tools/benchmarking/matrix_gate_gpu.py``) on the CPU, with synthetic matrix
reports: a point 6 % slower than the baseline fails, a changed bits digest fails, 4 % slower
passes; errors, missing points and nondeterministic bits fail; the runs alternate between the
trees, each importing ``rl_engine`` from its own tree; bad arguments are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

TOOL = Path(__file__).resolve().parents[2] / "tools" / "benchmarking" / "matrix_gate_gpu.py"
gate = load_script("tools/benchmarking/matrix_gate_gpu.py")


def row(case: str, median: float, bits: str = "aaaa", *, mode: str = "graph", role: str = "ours",
        ratio: float | None = None, error: str | None = None, family: str = "gemm") -> dict:
    return {"family": family, "case": case, "mode": mode, "implementation": "rlk.ops.gemm.linear" if role == "ours"
            else "torch.F.linear", "role": role, "median": None if error else median, "bits": None if error else bits,
            "ratio_vs_baseline": ratio, "error": error}


def report(*rows: dict) -> dict:
    return {"schema_version": 1, "family": "matrix", "rows": list(rows)}


def write(tmp_path: Path, name: str, rep: dict) -> Path:
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(rep))
    return p


def judge_cli(tmp_path: Path, base: list[dict], new: list[dict], *extra: str) -> tuple[int, dict, str]:
    b = [str(write(tmp_path, f"b{i}", r)) for i, r in enumerate(base)]
    n = [str(write(tmp_path, f"n{i}", r)) for i, r in enumerate(new)]
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(TOOL), "--base-runs", *b, "--new-runs", *n, "--out-dir", str(out), *extra],
                       capture_output=True, text=True, timeout=120)
    summary = json.loads((out / "matrix_gate.json").read_text()) if (out / "matrix_gate.json").is_file() else {}
    return r.returncode, summary, r.stdout + r.stderr


def test_six_percent_slower_and_changed_bits_fail_four_percent_passes(tmp_path):
    base = report(row("p4", 1.00), row("p6", 1.00), row("pbits", 1.00, "aaaa"), row("cublas", 1.0, role="baseline"))
    new = report(row("p4", 1.04), row("p6", 1.06), row("pbits", 1.00, "bbbb"), row("cublas", 2.0, role="baseline"))
    code, summary, out = judge_cli(tmp_path, [base], [new])
    assert code == 1, out
    status = {p["case"]: p["status"] for p in summary["points"]}
    assert status == {"p4": "ok", "p6": "slower", "pbits": "bits"}  # baseline rows are not gated
    assert summary["verdict"] == "fail" and summary["counts"] == {"ok": 1, "slower": 1, "bits": 1}
    assert [p["case"] for p in summary["points"]][-1] == "p4"  # failing points first
    p6 = next(p for p in summary["points"] if p["case"] == "p6")
    assert p6["change"] == pytest.approx(0.06) and p6["base"] == 1.0 and p6["new"] == 1.06
    assert "FAIL" in out and "slower" in out and "bits differ: base aaaa, new bbbb" in out
    # the negative control's other side: only the 4 % point, the gate passes
    code, summary, out = judge_cli(tmp_path, [report(row("p4", 1.00))], [report(row("p4", 1.04))])
    assert code == 0 and summary["verdict"] == "pass", out


def test_medians_over_rounds_are_compared():
    """Two rounds per tree: the median of each tree's per-run medians (one slow outlier of the
    new tree's three rounds does not fail it; two do)."""
    base = [report(row("p", 1.0)) for _ in range(3)]
    one = [report(row("p", v)) for v in (1.01, 1.30, 1.02)]
    two = [report(row("p", v)) for v in (1.01, 1.30, 1.20)]
    assert gate.compare(base, one)["verdict"] == "pass"
    assert gate.compare(base, two)["points"][0]["status"] == "slower"


def test_errors_missing_points_and_nondeterministic_bits():
    base = report(row("err", 1.0), row("both", 0, error="NoEligibleImplementation: x"), row("gone", 1.0),
                  row("nondet", 1.0), row("fixed", 0, error="ValueError: y"))
    new1 = report(row("err", 0, error="RuntimeError: boom"), row("both", 0, error="NoEligibleImplementation: x"),
                  row("nondet", 1.0, "aaaa"), row("fixed", 1.0), row("added", 1.0))
    new2 = report(row("err", 0, error="RuntimeError: boom"), row("both", 0, error="NoEligibleImplementation: x"),
                  row("nondet", 1.0, "cccc"), row("fixed", 1.0), row("added", 1.0))
    res = gate.compare([base, base], [new1, new2])
    status = {p["case"]: p["status"] for p in res["points"]}
    assert status == {"err": "error", "both": "unsupported", "gone": "missing", "nondet": "nondeterministic",
                      "fixed": "base-error", "added": "new"}
    fixed = next(p for p in res["points"] if p["case"] == "fixed")
    assert fixed["reasons"] == ["fails in the baseline only, not compared: ValueError: y"] and fixed["new_bits"] == "aaaa"
    assert res["verdict"] == "fail"
    gone = next(p for p in res["points"] if p["case"] == "gone")
    assert gone["reasons"] == ["not measured by run(s) new1, new2"]
    # without the failing points the same comparison passes
    keep = {"both", "fixed", "added"}
    strip = lambda rep: report(*(r for r in rep["rows"] if r["case"] in keep))  # noqa: E731
    assert gate.compare([strip(base)] * 2, [strip(new1), strip(new2)])["verdict"] == "pass"


def test_ratio_metric_cancels_drift_between_processes():
    """Every time in the new tree's report 10 % higher, cuBLAS included: a slower clock, not a slower
    kernel. ``--metric time`` fails it, ``--metric ratio`` (each run against its own baseline)
    passes it; a kernel 10 % slower relative to its baseline fails both."""
    base = report(row("p", 1.0, ratio=1.0))
    drift = report(row("p", 1.1, ratio=1.0))
    slower = report(row("p", 1.1, ratio=1.1))
    assert gate.compare([base], [drift], metric="time")["verdict"] == "fail"
    assert gate.compare([base], [drift], metric="ratio")["verdict"] == "pass"
    assert gate.compare([base], [slower], metric="ratio")["verdict"] == "fail"
    with pytest.raises(ValueError, match="^metric: expected 'time' or 'ratio'"):
        gate.compare([base], [drift], metric="p50")


def test_no_runs_or_an_unreadable_report_fail(tmp_path):
    assert gate.compare([], [report(row("p", 1.0))])["verdict"] == "fail"
    good = write(tmp_path, "good", report(row("p", 1.0)))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = subprocess.run([sys.executable, str(TOOL), "--base-runs", str(good), "--new-runs", str(bad), "--out-dir",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unreadable report" in r.stderr


# A stand-in for the matrix script: it imports rl_engine from --impl-root (as the real one does),
# appends the tree's name to an order file and writes one row of ours from the tree's values.
FAKE_MATRIX = """
import argparse, json, os, sys
ap = argparse.ArgumentParser(); ap.add_argument("--out"); ap.add_argument("--impl-root"); ap.add_argument("--commit")
ap.add_argument("--quick", action="store_true")
a = ap.parse_args()
sys.path.insert(0, a.impl_root)
import rl_engine
with open(os.environ["GATE_ORDER"], "a") as f:
    f.write(rl_engine.NAME + "\\n")
row = {"family": "gemm", "case": "p", "mode": "graph", "implementation": "rlk.ops.gemm.linear", "role": "ours",
       "median": rl_engine.MEDIAN, "bits": rl_engine.BITS, "ratio_vs_baseline": 1.0, "error": None}
json.dump({"rows": [row], "commit": a.commit, "quick": a.quick}, open(a.out, "w"))
"""


def make_tree(root: Path, name: str, median: float, bits: str = "abcd") -> Path:
    (root / "rl_engine").mkdir(parents=True)
    (root / "rl_engine" / "__init__.py").write_text(f"NAME = {name!r}\nMEDIAN = {median}\nBITS = {bits!r}\n")
    return root


def archive(src: Path, dest: Path, commit: str) -> Path:
    """A tarball as ``git archive`` writes it: the commit in a pax global header."""
    with tarfile.open(dest, "w:gz", format=tarfile.PAX_FORMAT, pax_headers={"comment": commit}) as tar:
        tar.add(src / "rl_engine", arcname="rl_engine")
    return dest


def run_gate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "", "GATE_ORDER": str(tmp_path / "order.txt")}
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("new_median,code", [(1.04, 0), (1.06, 1)])
def test_runs_alternate_and_import_their_own_tree(tmp_path, new_median, code):
    script = tmp_path / "fake_matrix.py"
    script.write_text(FAKE_MATRIX)
    base = archive(make_tree(tmp_path / "base_src", "base", 1.0), tmp_path / "base.tgz", "0123456789abcdef" * 2 + "01234567")
    new = make_tree(tmp_path / "new", "new", new_median)
    out = tmp_path / "out"
    r = run_gate(tmp_path, "--base", f"base={base}", "--new", f"new={new}", "--rounds", "2", "--out-dir", str(out),
                 "--work", str(tmp_path / "work"), "--script", str(script), "--", "--quick")
    assert r.returncode == code, r.stdout + r.stderr
    assert (tmp_path / "order.txt").read_text().split() == ["base", "new", "new", "base"]
    summary = json.loads((out / "matrix_gate.json").read_text())
    assert summary["trees"]["base"]["commit"] == "0123456789ab" and summary["failed_runs"] == []
    assert summary["points"][0]["status"] == ("ok" if code == 0 else "slower")
    first = json.loads((out / "matrix_base1.json").read_text())
    assert first["commit"] == "0123456789ab" and first["quick"] is True


def test_a_failing_run_fails_the_gate(tmp_path):
    script = tmp_path / "fake_matrix.py"
    script.write_text(FAKE_MATRIX + "\nraise SystemExit(3)\n")
    base = make_tree(tmp_path / "base", "base", 1.0)
    new = make_tree(tmp_path / "new", "new", 1.0)
    r = run_gate(tmp_path, "--base", f"base={base}", "--new", f"new={new}", "--rounds", "1", "--out-dir",
                 str(tmp_path / "out"), "--script", str(script), "--", "--quick")
    assert r.returncode == 1 and "base1: rc=3" in r.stdout
    assert json.loads((tmp_path / "out" / "matrix_gate.json").read_text())["failed_runs"] == ["base1", "new1"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--base", "base=.", "--out-dir", "x"], "expected '--' then the matrix arguments"),
        (["--base", "base=.", "--out-dir", "x", "--", "--out", "y"], "leave out --out, --impl-root and --commit"),
        (["--base", "base=.", "--out-dir", "x", "--", "--impl-root=y"], "leave out --out, --impl-root and --commit"),
        (["--out-dir", "x", "--", "--quick"], "--base: expected NAME=PATH"),
        (["--base", "new=.", "--out-dir", "x", "--", "--quick"], "expected two trees with distinct names"),
        (["--base", "base=/nonexistent", "--out-dir", "x", "--", "--quick"], "expected a directory or a .tgz"),
        (["--base", "base=.", "--rounds", "0", "--out-dir", "x", "--", "--quick"], "--rounds: expected a positive count"),
        (["--base-runs", "a.json", "--out-dir", "x"], "--base-runs and --new-runs: expected both"),
        (["--base-runs", "a.json", "--new-runs", "b.json", "--base", "b=.", "--out-dir", "x"], "judges existing reports"),
        (["--tolerance", "1.5", "--base-runs", "a", "--new-runs", "b", "--out-dir", "x"], "--tolerance: expected a fraction"),
        (["--accept", "lmhead", "--base-runs", "a", "--new-runs", "b", "--out-dir", "x"], "--accept: expected PATTERN=REASON"),
        (["--accept", "=why", "--base-runs", "a", "--new-runs", "b", "--out-dir", "x"], "--accept: expected PATTERN=REASON"),
        (["--accept", "lm(=why", "--base-runs", "a", "--new-runs", "b", "--out-dir", "x"], "is not a regular expression"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, args, message):
    r = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr


def test_the_table_lists_failing_points_first():
    res = gate.compare([report(row("a", 1.0), row("b", 1.0))], [report(row("a", 1.0), row("b", 1.2))])
    text = gate.table(res)
    lines = text.splitlines()
    assert lines[1].startswith("slower") and " b" in lines[1] and lines[2].startswith("ok")
    assert lines[-1].startswith("verdict: FAIL (ok 1, slower 1; tolerance 5 % on time")


def test_an_accepted_trade_passes_with_its_reason_and_nothing_else_is_accepted(tmp_path):
    """``--accept PATTERN=REASON``: a slower point whose case contains the pattern passes as
    ``accepted``, the reason and its peak-memory change in the summary; a slower point the pattern
    does not name still fails, and a named point whose bits changed is not accepted (negative
    controls)."""
    lm_base = {**row("lmhead: T=4096 forward_backward", 30.0, family="lmhead"), "peak_memory_bytes": 1500}
    lm_new = {**row("lmhead: T=4096 forward_backward", 36.0, family="lmhead"), "peak_memory_bytes": 1200}
    base = report(lm_base, row("gemm m64", 1.0), row("lmhead: T=1024 forward_backward", 8.0, "aaaa"))
    new = report(lm_new, row("gemm m64", 1.2), row("lmhead: T=1024 forward_backward", 9.0, "bbbb"))
    code, summary, out = judge_cli(tmp_path, [base], [new], "--accept", "^lmhead: .*forward_backward=time for peak memory")
    assert code == 1, out
    pts = {p["case"]: p for p in summary["points"]}
    assert pts["lmhead: T=4096 forward_backward"]["status"] == "accepted"
    assert pts["lmhead: T=4096 forward_backward"]["reasons"][-1] == "accepted: time for peak memory"
    assert pts["lmhead: T=4096 forward_backward"]["peak_change"] == pytest.approx(-0.2)
    assert pts["gemm m64"]["status"] == "slower" and pts["lmhead: T=1024 forward_backward"]["status"] == "bits"
    assert summary["accepted"] == {"^lmhead: .*forward_backward": "time for peak memory"}
    assert "peak memory -20.0%" in out
    code, summary, _ = judge_cli(tmp_path, [report(lm_base)], [report(lm_new)], "--accept",
                                 "^lmhead: .*forward_backward=time for peak memory")
    assert code == 0 and summary["verdict"] == "pass" and summary["counts"] == {"accepted": 1}
    # the pattern is matched against "family: case [mode]": a gemm point of the same case is not named
    gemm_base, gemm_new = row("T=4096 forward_backward", 1.0), row("T=4096 forward_backward", 1.3)
    code, summary, _ = judge_cli(tmp_path, [report(gemm_base)], [report(gemm_new)], "--accept",
                                 "^lmhead: .*forward_backward=time for peak memory")
    assert code == 1 and summary["counts"] == {"slower": 1}
