"""tools/benchmarking/matrix_ncu.py: the ncu command over a matrix record's graph misses, and the
summary of ncu's CSV per point and side (kernels named ``"<case> | <side>"`` by NVTX renaming)."""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import shlex

import pytest

from benchmarks.common.ncu import read_launches, short_name
from tests.helpers.scripts import load_script

tool = load_script("tools/benchmarking/matrix_ncu.py")

RECORD = {"summary": [
    {"case": "gemm: qwen3-8b.qkv K=4096 N=6144 M=64 [graph]", "family": "gemm", "mode": "graph", "met": False},
    {"case": "gemm: qwen3-8b.qkv K=4096 N=6144 M=64 [eager]", "family": "gemm", "mode": "eager", "met": False},
    {"case": "gemm: qwen3-8b.down K=12288 N=4096 M=1 [graph]", "family": "gemm", "mode": "graph", "met": True},
    {"case": "decode: qwen3-8b B=1 ctx=1024 contiguous [graph]", "family": "decode", "mode": "graph", "met": False},
]}


def _csv(launches):
    """ncu's --csv details page: one row per launch and metric (application output lines mixed in)."""
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(["ID", "Kernel Name", "Grid Size", "Block Size", "Metric Name", "Metric Unit", "Metric Value"])
    for i, (name, metrics) in enumerate(launches):
        for k, v in metrics.items():
            w.writerow([i, name, "(132, 1, 1)", "(256, 1, 1)", k, "", v])
    return "gemm: qwen3-8b.qkv K=4096 N=6144 M=64\n==PROF== Disconnected\n" + buf.getvalue()


def test_record_misses_are_the_graph_mode_misses_as_case_patterns():
    assert tool.record_misses(RECORD) == ["qwen3-8b.qkv K=4096 N=6144 M=64", "qwen3-8b B=1 ctx=1024 contiguous"]
    assert tool.record_misses(RECORD, ["decode"]) == ["qwen3-8b B=1 ctx=1024 contiguous"]
    assert tool.record_misses(RECORD, ["lmhead"]) == []


def test_command_profiles_from_the_ranges_and_renames_kernels(tmp_path, capsys):
    rec = tmp_path / "matrix.json"
    rec.write_text(json.dumps(RECORD))
    assert tool.main(["--command", "--record", str(rec), "--families", "gemm", "--python", "python3"]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert cmd[0] == "ncu" and "--profile-from-start" in cmd and cmd[cmd.index("--print-nvtx-rename") + 1] == "kernel"
    assert cmd[cmd.index("--cases") + 1] == "qwen3-8b.qkv K=4096 N=6144 M=64"
    assert cmd[cmd.index("--families") + 1] == "gemm" and "--profile" in cmd
    with pytest.raises(SystemExit):
        tool.main(["--command", "--record", str(rec), "--families", "lmhead"])
    assert "no points to profile" in capsys.readouterr().err


def test_summary_groups_launches_by_point_and_side(tmp_path, capsys):
    """ncu names a kernel ``"<case> | <side>/<kernel>"``; a launch from another thread (autograd's
    backward) has no range and belongs to the named launch before it; one before any stays
    unattributed."""
    path = tmp_path / "gemm.csv"
    t = "gpu__time_duration.sum"
    case = "qwen3-8b.qkv K=4096 N=6144 M=64"
    path.write_text(_csv([
        ("warmup_kernel", {t: "500"}),
        (f"{case} | ours/rlk_linear_fwd_tma", {t: "30000", "sm__throughput.avg.pct_of_peak_sustained_elapsed": "40.5",
                                               "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": "2.5",
                                               "launch__registers_per_thread": "168"}),
        ("rlk_attn_bwd_dq", {t: "2000"}),
        (f"{case} | torch.F.linear/nvjet_sm90", {t: "25,000"}),
    ]))
    out = tmp_path / "s.json"
    assert tool.main(["--summary", f"gemm={path}", "--out", str(out), "--commit", "abc1234"]) == 0
    rep = json.loads(out.read_text())
    assert rep["runs"] == [{"sources": [str(path)], "commit": "abc1234", "command": None, "device": None, "kernels": None}]
    (point,) = rep["points"]
    assert (point["family"], point["run"]) == ("gemm", 0)
    ours = point["sides"]["ours"]
    assert point["case"] == case and ours["device_us"] == 32.0
    assert [(x["kernel"], x["thread"]) for x in ours["launches"]] == [("rlk_linear_fwd_tma", "range"),
                                                                       ("rlk_attn_bwd_dq", "other")]
    assert point["sides"]["torch.F.linear"]["device_us"] == 25.0
    assert [x["kernel"] for x in rep["unattributed"]] == ["warmup_kernel"]
    printed = capsys.readouterr().out
    assert "SM  40.5%" in printed and "regs 168" in printed and "wait 2.50" in printed
    assert "1 launches before any '<case> | <side>' range" in printed


def test_summary_of_an_output_without_metric_rows_fails(tmp_path, capsys):
    path = tmp_path / "empty.csv"
    path.write_text("==PROF== Connected to process\n==ERROR== the profiler could not start\n")
    assert read_launches(path) == []
    assert tool.main(["--summary", str(path), "--family", "gemm"]) == 1
    assert "no ncu launches" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tool.main(["--summary", str(path)])
    assert "names no family" in capsys.readouterr().err
    odd = tmp_path / "run=1"
    odd.mkdir()
    (odd / "empty.csv").write_text(path.read_text())
    assert tool.main(["--summary", str(odd / "empty.csv"), "--family", "gemm"]) == 1  # '=' in a path is no family


def test_short_names_and_argument_errors(capsys):
    assert short_name("smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio") == "stall_long_scoreboard"
    assert short_name("dram__throughput.avg.pct_of_peak_sustained_elapsed") == "dram__throughput%el"
    with pytest.raises(SystemExit):
        tool.main([])
    assert "exactly one of --command and --summary" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["--summary", "gemm=/nonexistent.csv"])
    assert "no such file" in capsys.readouterr().err


def test_within_narrows_the_record_misses(tmp_path, capsys):
    rec = tmp_path / "matrix.json"
    record = {"summary": RECORD["summary"] + [
        {"case": "gemm: qwen3-8b.qkv K=4096 N=6144 M=256 [graph]", "family": "gemm", "mode": "graph", "met": False}]}
    rec.write_text(json.dumps(record))
    assert tool.main(["--command", "--record", str(rec), "--families", "gemm", "--within", "*M=256,*M=1024"]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert cmd[cmd.index("--cases") + 1] == "qwen3-8b.qkv K=4096 N=6144 M=256"
    # negative control: without --within the M = 64 miss is profiled too
    assert tool.main(["--command", "--record", str(rec), "--families", "gemm"]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert cmd[cmd.index("--cases") + 1].split(",") == ["qwen3-8b.qkv K=4096 N=6144 M=64", "qwen3-8b.qkv K=4096 N=6144 M=256"]
    with pytest.raises(SystemExit):
        tool.main(["--command", "--record", str(rec), "--families", "gemm", "--within", "*M=4096"])
    assert "no points to profile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["--command", "--cases", "x", "--within", "*M=256"])
    assert "--within" in capsys.readouterr().err


def test_reasons_out_gives_each_profiled_point_both_sides_counters(tmp_path, capsys):
    """The reasons file matches each point's graph row (and no other row: brackets are literal)
    and cites both sides' device time, launches and longest launch's counters."""
    path = tmp_path / "gemm.csv"
    t = "gpu__time_duration.sum"
    case = "qwen3-8b.qkv K=4096 N=6144 M=256"
    path.write_text(_csv([
        (f"{case} | ours/rlk_linear_fwd_tma", {t: "30000", "sm__throughput.avg.pct_of_peak_sustained_elapsed": "40.5",
                                               "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": "2.5",
                                               "launch__registers_per_thread": "168"}),
        (f"{case} | torch.F.linear/nvjet_sm90_splitK", {t: "20000"}),
        (f"{case} | torch.F.linear/void cublasLt::splitKreduce_kernel<(int)32, float>(cublasLt::Params<T6>, const T4 *)",
         {t: "1000"}),
        ("other case | ours/rlk_linear_fwd_tma", {t: "1000"}),  # no baseline side: no reason
    ]))
    out = tmp_path / "reasons.json"
    args = ["--summary", f"gemm={path}", "--commit", "abc1234", "--reasons-out", str(out),
            "--evidence", "reports/gpu/h100/matrix_ncu.json", "--device", "H100"]
    assert tool.main(args) == 0
    (rule,) = json.loads(out.read_text())
    assert fnmatch.fnmatchcase(f"gemm: {case} [graph]", rule["cases"])
    assert not fnmatch.fnmatchcase(f"gemm: {case} [eager]", rule["cases"])
    assert not fnmatch.fnmatchcase(f"gemm: {case} g", rule["cases"])
    assert "ours 30.0 us in 1 launch(es) (rlk_linear_fwd_tma)" in rule["reason"]
    assert "torch.F.linear 21.0 us in 2 launch(es) (nvjet_sm90_splitK, cublasLt::splitKreduce_kernel)" in rule["reason"]
    assert "SM 40.5 % of peak" in rule["reason"] and "168 registers" in rule["reason"] and "wait 2.50" in rule["reason"]
    assert rule["evidence"] == "reports/gpu/h100/matrix_ncu.json (ncu, abc1234): 30.0 us vs 21.0 us"
    # the reasons file is what matrix_reasons.py reads
    reasons_tool = load_script("tools/benchmarking/matrix_reasons.py")
    assert reasons_tool.load_rules(out)[0]["cases"] == rule["cases"]
    with pytest.raises(SystemExit):
        tool.main(["--summary", f"gemm={path}", "--reasons-out", str(out), "--device", "H100"])
    assert "--reasons-out" in capsys.readouterr().err


def test_kernels_narrows_the_profile_and_gives_our_side_its_reason(tmp_path, capsys):
    """``--kernels`` puts ncu's kernel-name filter on the command line; a point of such a run with
    no baseline launch gets a reason of our side alone, naming the filter (without the filter, a
    point with one side gets none: the negative control)."""
    rec = tmp_path / "matrix.json"
    rec.write_text(json.dumps(RECORD))
    assert tool.main(["--command", "--record", str(rec), "--families", "decode", "--kernels", "rlk_|flash_fwd"]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert cmd[cmd.index("--kernel-name") + 1] == "regex:rlk_|flash_fwd"
    assert cmd[cmd.index("--kernel-name-base") + 1] == "function" and cmd.index("--kernel-name") < cmd.index("--profile")
    path = tmp_path / "decode.csv"
    case = "qwen3-8b B=1 ctx=1024 contiguous"
    path.write_text(_csv([(f"{case} | ours/rlk_attn_split_wgt", {"gpu__time_duration.sum": "11000"})]))
    out = tmp_path / "reasons.json"
    common = ["--summary", f"decode={path}", "--reasons-out", str(out), "--evidence", "E", "--device", "H100"]
    assert tool.main(common + ["--kernels", "rlk_|flash_fwd", "--commit", "abc1234"]) == 0
    (rule,) = json.loads(out.read_text())
    assert fnmatch.fnmatchcase(f"decode: {case} [graph]", rule["cases"])
    assert "only the kernels whose name matches 'rlk_|flash_fwd'" in rule["reason"]
    assert "ours 11.0 us in 1 launch(es) (rlk_attn_split_wgt)" in rule["reason"]
    assert rule["evidence"] == "E (ncu, abc1234): ours 11.0 us"
    assert tool.main(common) == 0
    assert json.loads(out.read_text()) == []


def test_merge_adds_a_run_and_replaces_the_points_it_profiles_again(tmp_path, capsys):
    """``--merge``: the record's points of another family or case keep their run; a point
    profiled again takes the new run's counters; a record of another device or of other metrics
    is refused and the output is not written."""
    t = "gpu__time_duration.sum"
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    first.write_text(_csv([("p1 | ours/rlk_a", {t: "1000"}), ("p2 | ours/rlk_a", {t: "2000"})]))
    second.write_text(_csv([("p2 | ours/rlk_a", {t: "5000"}), ("p3 | ours/rlk_b", {t: "3000"})]))
    rec, out = tmp_path / "record.json", tmp_path / "merged.json"
    assert tool.main(["--summary", f"gemm={first}", "--out", str(rec), "--commit", "c1", "--device", "H100"]) == 0
    assert tool.main(["--summary", f"gemm={second}", "--out", str(out), "--merge", str(rec), "--commit", "c2",
                      "--device", "H100", "--run-command", "STEPS=matrix_ncu ..."]) == 0
    merged = json.loads(out.read_text())
    assert [r["commit"] for r in merged["runs"]] == ["c1", "c2"] and merged["runs"][1]["command"] == "STEPS=matrix_ncu ..."
    got = {p["case"]: (p["run"], p["sides"]["ours"]["device_us"]) for p in merged["points"]}
    assert got == {"p1": (0, 1.0), "p2": (1, 5.0), "p3": (1, 3.0)}
    # the same case of another family is another point
    assert tool.main(["--summary", f"attention={second}", "--out", str(out), "--merge", str(rec), "--device", "H100"]) == 0
    assert len(json.loads(out.read_text())["points"]) == 4
    out.unlink()
    with pytest.raises(SystemExit):
        tool.main(["--summary", f"gemm={second}", "--out", str(out), "--merge", str(rec), "--device", "H200"])
    assert "one record per device" in capsys.readouterr().err and not out.exists()
    old = json.loads(rec.read_text())
    rec.write_text(json.dumps(dict(old, metrics=old["metrics"][:3])))
    with pytest.raises(SystemExit):
        tool.main(["--summary", f"gemm={second}", "--out", str(out), "--merge", str(rec), "--device", "H100"])
    assert "metrics differ" in capsys.readouterr().err and not out.exists()
    rec.write_text(json.dumps(dict(old, schema_version=1)))
    with pytest.raises(SystemExit):
        tool.main(["--summary", f"gemm={second}", "--out", str(out), "--merge", str(rec)])
    assert "schema_version 2" in capsys.readouterr().err
