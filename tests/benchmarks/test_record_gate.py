"""``tools/benchmarking/record_gate.py``: gate summaries recorded under their names with one
verdict — pass only when every point that failed in a gate passes in a later gate that measured
it again — the device and versions from the run's ``env.txt``, no device-local paths; gates of
different baselines are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "benchmarking" / "record_gate.py"

ENV = """== env 2026-12-05T04:24:47Z
name, driver_version, memory.total [MiB]
NVIDIA H200, 580.159.04, 143771 MiB
torch 2.11.0+cu130 cuda 13.0 triton 3.6.0 pydantic 2.14.4 hypothesis 6.168.3 pytest 9.1.1
"""


def _tool():
    return load_script("tools/benchmarking/record_gate.py")


def _point(case, status):
    return {"family": "gemm", "case": case, "mode": "graph", "implementation": "rlk", "status": status}


def _gate(verdict, points, base="96557b4ffb83"):
    return {"script": ["/tmp/x/benchmarks/operators/bench_matrix_gpu.py", "--quick"],
            "trees": {"base": {"path": ".whl/base.tgz", "commit": base}, "new": {"path": ".", "commit": None}},
            "runs_written": {"base": ["/tmp/b1.json"]}, "verdict": verdict, "points": points}


def test_a_failing_point_must_pass_in_a_later_gate():
    tool = _tool()
    first = _gate("fail", [_point("a", "ok"), _point("b", "slower")])
    assert tool.combined_verdict([first, _gate("pass", [_point("b", "ok")])]) == "pass"
    # controls: the point not measured again, measured again and still slower, or the last gate failing
    assert tool.combined_verdict([first, _gate("pass", [_point("a", "ok")])]) == "fail"
    assert tool.combined_verdict([first, _gate("fail", [_point("b", "slower")])]) == "fail"
    assert tool.combined_verdict([first]) == "fail"
    assert tool.combined_verdict([_gate("pass", [_point("a", "accepted")])]) == "pass"


def test_env_gives_device_and_versions():
    device, versions = _tool().parse_env(ENV)
    assert device == {"name": "NVIDIA H200", "driver": "580.159.04"}
    assert versions == {"torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0"}
    with pytest.raises(ValueError, match="torch X cuda Y triton Z"):
        _tool().parse_env(ENV.splitlines()[0] + "\n" + ENV.splitlines()[1] + "\n" + ENV.splitlines()[2])


def test_cli_writes_the_record_without_device_paths(tmp_path):
    g1, g2, env = tmp_path / "g1.json", tmp_path / "g2.json", tmp_path / "env.txt"
    g1.write_text(json.dumps(_gate("fail", [_point("b", "slower")])))
    g2.write_text(json.dumps(_gate("pass", [_point("b", "ok")])))
    env.write_text(ENV)
    out = tmp_path / "h200" / "matrix_gate.json"
    out.parent.mkdir()
    r = subprocess.run([sys.executable, str(TOOL), "--gate", f"one={g1}", "--gate", f"two={g2}", "--env", str(env),
                        "--new-commit", "1cbf85f", "--note", "n", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    assert (rec["platform"], rec["base"], rec["new"], rec["verdict"], rec["notes"]) == ("h200", "96557b4", "1cbf85f",
                                                                                         "pass", ["n"])
    assert list(rec["gates"]) == ["one", "two"]
    one = rec["gates"]["one"]
    assert "runs_written" not in one and one["script"][0] == "benchmarks/operators/bench_matrix_gpu.py"
    assert one["trees"]["new"] == {"path": "the working tree at 1cbf85f", "commit": "1cbf85f"}


def test_gates_of_different_baselines_are_refused(tmp_path):
    g1, g2, env = tmp_path / "g1.json", tmp_path / "g2.json", tmp_path / "env.txt"
    g1.write_text(json.dumps(_gate("pass", [])))
    g2.write_text(json.dumps(_gate("pass", [], base="0123456789ab")))
    env.write_text(ENV)
    out = tmp_path / "matrix_gate.json"
    r = subprocess.run([sys.executable, str(TOOL), "--gate", f"one={g1}", "--gate", f"two={g2}", "--env", str(env),
                        "--new-commit", "1cbf85f", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "different baseline commits" in r.stderr and not out.exists(), r.stderr
