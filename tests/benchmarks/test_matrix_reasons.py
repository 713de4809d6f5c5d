"""``tools/benchmarking/matrix_reasons.py``: every missed point of a matrix report gets the reason
its evidence supports — a reasons file's pattern first, then a profiled reason an earlier record
gave the same case, then, for an eager miss, its graph twin (met: host-bound; missed: the
kernel) — and a miss with no evidence gets none; a malformed reasons file is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "benchmarking" / "matrix_reasons.py"


def _tool():
    return load_script("tools/benchmarking/matrix_reasons.py")


def _s(case, met):
    return {"case": case, "met": met}


REPORT = {"family": "matrix", "platform": "h200", "summary": [
    _s("gemm: a M=1 [graph]", True), _s("gemm: a M=1 [eager]", False),          # host-bound
    _s("gemm: b M=1 [graph]", False), _s("gemm: b M=1 [eager]", False),         # kernel; the graph miss: no reason
    _s("lmhead: c fwd_bwd [eager]", False),                                     # the reasons file
    _s("decode: d [graph]", False),                                             # kept from the earlier record
    _s("decode: e [graph]", None), _s("decode: e [eager]", False),              # twin not judged: no reason
    _s("gemm: f M=4 [eager]", True)]}


def test_each_miss_gets_the_reason_its_evidence_supports():
    tool = _tool()
    rules = [{"cases": "lmhead: * fwd_bwd *", "reason": "peak memory over Liger's", "evidence": "peak_memory_bytes"}]
    kept = {"decode: d [graph]": {"case": "decode: d [graph]", "reason": "occupancy", "evidence": "ncu",
                                  "source": "profile"}}
    got = {r["case"]: (r["reason"], r["source"]) for r in tool.miss_reasons(REPORT, rules, kept, "host.json")}
    assert got == {
        "gemm: a M=1 [eager]": (tool.HOST_REASON, "graph twin"),
        "gemm: b M=1 [eager]": (tool.KERNEL_REASON, "graph twin"),
        "lmhead: c fwd_bwd [eager]": ("peak memory over Liger's", "profile"),
        "decode: d [graph]": ("occupancy", "profile"),
    }


def test_cli_writes_the_record_and_carries_profiled_reasons(tmp_path):
    raw, reasons, out = tmp_path / "raw.json", tmp_path / "reasons.json", tmp_path / "matrix.json"
    raw.write_text(json.dumps(REPORT))
    reasons.write_text(json.dumps([{"cases": "decode: d *", "reason": "occupancy", "evidence": "ncu.csv"}]))
    run = [sys.executable, str(TOOL), str(raw), "--out", str(out)]
    assert subprocess.run(run + ["--reasons", str(reasons), "--note", "n"], capture_output=True, text=True).returncode == 0
    first = json.loads(out.read_text())
    assert first["notes"] == ["n"] and len(first["miss_reasons"]) == 3
    r = subprocess.run(run + ["--keep-from", str(out)], capture_output=True, text=True)  # no reasons file this time
    assert r.returncode == 0, r.stderr
    again = {m["case"]: m["evidence"] for m in json.loads(out.read_text())["miss_reasons"]}
    assert again["decode: d [graph]"] == "ncu.csv"


@pytest.mark.parametrize("content,message", [
    ({"cases": "x"}, "expected a JSON list"),
    ([{"cases": "x", "reason": "r"}], "entry 0: expected exactly non-empty 'cases', 'reason' and 'evidence'"),
    ([{"cases": "x", "reason": "", "evidence": "e"}], "entry 0"),
])
def test_a_malformed_reasons_file_is_refused_by_name(tmp_path, content, message):
    raw, reasons = tmp_path / "raw.json", tmp_path / "reasons.json"
    raw.write_text(json.dumps(REPORT))
    reasons.write_text(json.dumps(content))
    r = subprocess.run([sys.executable, str(TOOL), str(raw), "--out", str(tmp_path / "matrix.json"), "--reasons",
                        str(reasons)], capture_output=True, text=True)
    assert r.returncode == 2 and "--reasons" in r.stderr and message in r.stderr, r.stderr


def test_out_must_be_the_matrix_record(tmp_path):
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(REPORT))
    r = subprocess.run([sys.executable, str(TOOL), str(raw), "--out", str(tmp_path / "m.json")], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "expected a file named matrix.json" in r.stderr


def _part(cases, command, *, commit="abc1234", points_done=None, timestamp="2026-01-01T00:00:00+00:00"):
    return {"family": "matrix", "platform": "h200", "commit": commit, "device": {"name": "NVIDIA H200"},
            "versions": {"torch": "2.11", "triton": "3.6"}, "command": command, "timestamp": timestamp,
            "summary": [_s(c, False) for c in cases], "rows": [{"case": c} for c in cases],
            "meta": {"partial": False, "stopped": None, "points": len(cases), "points_done": points_done or len(cases),
                     "elapsed_s": 10.0}}


def test_disjoint_parts_merge_into_one_record(tmp_path):
    a = _part(["decode: x [graph]", "decode: x [eager]"], "bench --families decode")
    b = _part(["gemm: y M=1 [graph]"], "bench --families gemm", timestamp="2026-01-02T00:00:00+00:00")
    paths = []
    for i, part in enumerate((a, b)):
        paths.append(tmp_path / f"raw{i}.json")
        paths[-1].write_text(json.dumps(part))
    out = tmp_path / "matrix.json"
    r = subprocess.run([sys.executable, str(TOOL), *map(str, paths), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    assert [s["case"] for s in rec["summary"]] == ["decode: x [graph]", "decode: x [eager]", "gemm: y M=1 [graph]"]
    assert [row["case"] for row in rec["rows"]] == [s["case"] for s in rec["summary"]]
    assert rec["command"] == "bench --families decode ; bench --families gemm"
    assert rec["timestamp"] == "2026-01-02T00:00:00+00:00"
    assert rec["meta"]["points"] == 3 and rec["meta"]["points_done"] == 3 and len(rec["meta"]["parts"]) == 2
    # the eager miss of the merged record finds its graph twin in the other part's summary order too
    assert {m["case"] for m in rec["miss_reasons"]} == {"decode: x [eager]"}


@pytest.mark.parametrize("second,message", [
    (_part(["gemm: y [graph]"], "c", commit="def5678"), "commit 'def5678' differs"),
    (_part(["decode: x [graph]"], "c"), "case 'decode: x [graph]' is in raw reports 0 and 1"),
])
def test_parts_of_other_commits_or_overlapping_cases_are_refused(tmp_path, second, message):
    first = _part(["decode: x [graph]"], "c")
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    paths[0].write_text(json.dumps(first))
    paths[1].write_text(json.dumps(second))
    out = tmp_path / "matrix.json"
    r = subprocess.run([sys.executable, str(TOOL), *map(str, paths), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and not out.exists(), r.stderr


def test_carry_keeps_the_earlier_points_the_new_parts_do_not_measure(tmp_path):
    """``--carry``: the earlier record's points that the new parts do not measure stay, with their
    profiled reasons and their commit named in ``meta.carried`` and a note; a point measured again
    takes the new measurement. Negative control: a record of another device is refused by name."""
    old = dict(_part(["decode: x [graph]", "decode: z [graph]", "lmhead: w [graph]"], "bench --families decode,lmhead",
                     commit="0ld0ld0"), miss_reasons=[{"case": "lmhead: w [graph]", "reason": "4 products",
                                                       "evidence": "ncu", "source": "profile"}])
    new = _part(["decode: z [graph]", "gemm: y M=1 [graph]"], "bench --families gemm --presets d256")
    paths = {n: tmp_path / f"{n}.json" for n in ("old", "new")}
    paths["old"].write_text(json.dumps(old))
    paths["new"].write_text(json.dumps(new))
    out = tmp_path / "matrix.json"
    r = subprocess.run([sys.executable, str(TOOL), str(paths["new"]), "--out", str(out), "--carry", str(paths["old"])],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    assert [s["case"] for s in rec["summary"]] == ["decode: z [graph]", "gemm: y M=1 [graph]", "decode: x [graph]",
                                                   "lmhead: w [graph]"]
    assert [row["case"] for row in rec["rows"]] == [s["case"] for s in rec["summary"]]
    assert rec["commit"] == "abc1234" and [c["commit"] for c in rec["meta"]["carried"]] == ["0ld0ld0"]
    # a benchmark's rows hold family, case and mode apart: they travel with their summary entry
    real = dict(old, rows=[{"family": "decode", "case": "x", "mode": "graph", "role": role} for role in ("ours", "baseline")]
                + [{"family": "decode", "case": "z", "mode": "graph", "role": "ours"}])
    paths["real"] = tmp_path / "real.json"
    paths["real"].write_text(json.dumps(real))
    out_real = tmp_path / "real" / "matrix.json"
    out_real.parent.mkdir()
    r = subprocess.run([sys.executable, str(TOOL), str(paths["new"]), "--out", str(out_real), "--carry", str(paths["real"])],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert [row.get("role") for row in json.loads(out_real.read_text())["rows"][2:]] == ["ours", "baseline"]
    assert rec["meta"]["carried"][0]["points"] == 2 and rec["meta"]["carried"][0]["families"] == ["decode", "lmhead"]
    assert any("carried over from the run at 0ld0ld0" in n for n in rec["notes"])
    assert {m["case"]: m["reason"] for m in rec["miss_reasons"]}["lmhead: w [graph]"] == "4 products"
    assert {s["case"]: s.get("measured_at") for s in rec["summary"]}["decode: x [graph]"] == "0ld0ld0"
    # a second generation: carried from that record, each point keeps the run that measured it
    newer = _part(["gemm: y M=1 [graph]", "lmhead: w [graph]"], "bench --families gemm,lmhead", commit="n3wn3w0")
    paths["newer"] = tmp_path / "newer.json"
    paths["newer"].write_text(json.dumps(newer))
    out2 = tmp_path / "g2" / "matrix.json"
    out2.parent.mkdir()
    r = subprocess.run([sys.executable, str(TOOL), str(paths["newer"]), "--out", str(out2), "--carry", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rec2 = json.loads(out2.read_text())
    assert {s["case"]: s.get("measured_at") for s in rec2["summary"]} == {
        "gemm: y M=1 [graph]": None, "lmhead: w [graph]": None, "decode: z [graph]": "abc1234", "decode: x [graph]": "0ld0ld0"}
    assert [(c["commit"], c["points"]) for c in rec2["meta"]["carried"]] == [("abc1234", 1), ("0ld0ld0", 1)]
    assert sum("carried over from the run at" in n for n in rec2["notes"]) == 2
    # negative control: a record of the single-origin form whose entries carry no stamps is ambiguous
    legacy = dict(rec, meta=dict(rec["meta"], carried=rec["meta"]["carried"][0]),
                  summary=[{k: v for k, v in e.items() if k != "measured_at"} for e in rec["summary"]])
    paths["legacy"] = tmp_path / "legacy.json"
    paths["legacy"].write_text(json.dumps(legacy))
    r = subprocess.run([sys.executable, str(TOOL), str(paths["newer"]), "--out", str(tmp_path / "g3" / "matrix.json"),
                        "--carry", str(paths["legacy"])], capture_output=True, text=True)
    assert r.returncode == 2 and "measured_at" in r.stderr, r.stderr
    paths["old"].write_text(json.dumps(dict(old, device={"name": "NVIDIA H100"})))
    r = subprocess.run([sys.executable, str(TOOL), str(paths["new"]), "--out", str(tmp_path / "x" / "matrix.json"),
                        "--carry", str(paths["old"])], capture_output=True, text=True)
    assert r.returncode == 2 and "--carry: device" in r.stderr, r.stderr
