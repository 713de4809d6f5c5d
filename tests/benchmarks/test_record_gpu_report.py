"""``tools/benchmarking/record_gpu_report.py``: a raw GPU benchmark JSON becomes a complete benchmark
of record (the fields the generated page and its completeness test need), each family's targets
judged from the rows; a ratio past its target or an installed row with mismatched bits is a miss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

DEVICE = {"name": "NVIDIA H200", "sm_count": 132, "capability": "sm90", "driver": "580", "memory_mib": 143771}


def _tool():
    return load_script("tools/benchmarking/record_gpu_report.py")


def _row(op, impl, median, **extra):
    return {"op": op, "implementation": impl, "median": median, "timestamp": "t", "device": {"name": "NVIDIA H200"},
            "versions": {"torch": "2.11", "rl_engine": "0.1.0", "trl": None}, "config": extra.pop("config", {}), **extra}


def _platform(tmp_path: Path) -> Path:
    plat = tmp_path / "h200"
    plat.mkdir()
    (plat / "gpu_tests.json").write_text(json.dumps({"device": DEVICE}))
    return plat


def test_moe_targets_by_token_count(tmp_path):
    rows = [_row("moe.layer", "triton.grouped", 1.0, ratio_vs_baseline=1.05, baseline="torch._grouped_mm",
                 config={"tokens": 4096, "kind": "fwd", "mode": "graph"}),
            _row("moe.layer", "triton.grouped", 1.0, ratio_vs_baseline=1.15, baseline="torch._grouped_mm",
                 config={"tokens": 16, "kind": "fwd", "mode": "eager"}),
            _row("moe.layer", "triton.grouped", 1.0, ratio_vs_baseline=1.15, baseline="torch._grouped_mm",
                 config={"tokens": 1024, "kind": "fwd_bwd", "mode": "graph"})]
    rep = _tool().record("moe", {"command": "c", "rows": rows}, commit="abc", out=_platform(tmp_path) / "moe.json", notes=[])
    assert [s["met"] for s in rep["summary"]] == [True, True, False]  # 1.15 misses 1/0.9 at 1,024 tokens
    assert rep["device"] == DEVICE and rep["platform"] == "h200" and "trl" not in rep["versions"]
    assert {"schema_version", "family", "title", "command", "commit", "timestamp", "summary", "rows"} <= set(rep)


def test_e2e_needs_both_the_ratio_and_zero_mismatches(tmp_path):
    gen = {"mode": "eager", "sampling": "greedy"}
    rows = [_row("generate", "transformers", 10.0, config=gen, mismatched=900, compared=1000),
            _row("generate", "rl_engine", 11.0, config=gen, ratio_vs_baseline=1.1, mismatched=0, compared=1000),
            _row("generate", "rl_engine (transformers DynamicCache)", 11.0, config=gen, ratio_vs_baseline=1.1,
                 mismatched=3, compared=1000),
            _row("train_step", "rl_engine", 1.0, config={"layout": "packed"}, ratio_vs_baseline=1.2,
                 layout_mismatched=0, layout_compared=10),
            _row("trl_grpo_step", "rl_engine", 5.0, config={"layers": 2, "generations": 8, "completion_len": 64},
                 ratio_vs_baseline=7.0, mismatched=0, compared=1024)]
    rep = _tool().record("e2e_hf", {"rows": rows}, commit="abc", out=_platform(tmp_path) / "e2e_hf.json", notes=[])
    got = {s["case"]: s["met"] for s in rep["summary"]}
    assert got == {"generate eager greedy": True, "generate eager greedy (transformers DynamicCache)": False,
                   "train step, packed": False, "TRL GRPO step (2 layers, 8 × 64 tokens)": None}  # no time target


def test_call_overhead_reads_the_benchmarks_own_summary(tmp_path):
    sm = {"public_us": 30.0, "native_us": 5.0, "impl_us": 20.0, "overhead_us": 10.0, "excess_us": 25.0,
          "target_us": 15.0, "target_on": "overhead_us", "meets_target": True}
    rows = [_row("linear", "native", 0.005, summary=sm), _row("linear", "public", 0.03),
            _row("paged_attention_step", "native", 0.07, summary={**sm, "target_on": "excess_us", "target_us": 40.0})]
    rep = _tool().record("call_overhead", {"rows": rows}, commit="abc", out=_platform(tmp_path) / "call_overhead.json",
                         notes=[])
    assert [(s["achieved"], s["met"]) for s in rep["summary"]] == [(10.0, True), (25.0, True)]


def test_refuses_a_platform_without_a_device_record(tmp_path):
    rows = [_row("moe.layer", "x", 1.0, ratio_vs_baseline=1.0, baseline="b", config={"tokens": 1, "kind": "fwd", "mode": "graph"})]
    (tmp_path / "h200").mkdir()
    with pytest.raises(SystemExit, match="no device record"):
        _tool().record("moe", {"rows": rows}, commit="abc", out=tmp_path / "h200" / "moe.json", notes=[])


def test_merge_keeps_the_sections_a_run_did_not_measure(tmp_path):
    """A run of one generate setting replaces that setting's rows and keeps the others (training,
    other modes), each row naming the commit it was measured at; a record of another family is
    refused."""
    out = _platform(tmp_path) / "e2e_hf.json"
    train = _row("train_step", "rl_engine", 1.0, config={"layout": "packed"}, ratio_vs_baseline=0.9,
                 layout_mismatched=0, layout_compared=10)
    old_gen = _row("generate", "rl_engine", 1.0, config={"mode": "eager", "sampling": "greedy"}, ratio_vs_baseline=3.0,
                   mismatched=0, compared=10)
    tool = _tool()
    existing = tool.record("e2e_hf", {"rows": [train, old_gen]}, commit="old", out=out, notes=[])
    gen = _row("generate", "rl_engine", 1.0, config={"mode": "static-compiled", "sampling": "greedy"},
               ratio_vs_baseline=1.0, mismatched=0, compared=10)
    rep = tool.merge(tool.record("e2e_hf", {"rows": [gen]}, commit="new", out=out, notes=[]), existing)
    assert [(r["op"], r["config"].get("mode"), r["measured_commit"]) for r in rep["rows"]] == [
        ("generate", "static-compiled", "new"), ("train_step", None, "old"), ("generate", "eager", "old")]
    assert {s["case"] for s in rep["summary"]} == {"generate static-compiled greedy", "generate eager greedy",
                                                   "train step, packed"}
    assert rep["commit"] == "new (generate); old (generate, train_step)"
    # a later run of the same setting replaces it
    again = tool.merge(tool.record("e2e_hf", {"rows": [dict(gen, ratio_vs_baseline=0.98)]}, commit="newer", out=out,
                                   notes=[]), rep)
    assert [(r["config"].get("mode"), r["measured_commit"]) for r in again["rows"]] == [
        ("static-compiled", "newer"), (None, "old"), ("eager", "old")]
    # a run of every setting keeps nothing, and its rows still name their commit
    whole = tool.merge(tool.record("e2e_hf", {"rows": [train, old_gen]}, commit="all", out=out, notes=[]), existing)
    assert [r["measured_commit"] for r in whole["rows"]] == ["all", "all"] and whole["commit"] == "all (generate, train_step)"
    with pytest.raises(SystemExit, match="family"):
        tool.merge(rep, dict(existing, family="moe"))


def test_host_overhead_rows_become_untargeted_entries_and_keep_the_profiles(tmp_path):
    """The host-overhead tool's flat rows (device name and versions inline) and its cProfile texts;
    a row that synchronises is marked as host + device time."""
    env = {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0", "cuda": "13.0", "timestamp": "t"}
    rows = [{**env, "case": "cublas", "p50_us": 22.3, "min_us": 22.1, "host_only": True},
            {**env, "case": "public_nan", "p50_us": 134.1, "min_us": 131.5, "host_only": False}]
    rep = _tool().record("host_overhead", {"rows": rows, "cprofile": {"kernels": "text"}}, commit="abc",
                         out=_platform(tmp_path) / "host_overhead.json", notes=[], command="python x.py --profile kernels")
    assert [(s["case"], s["achieved"], s["met"], s.get("host_and_device")) for s in rep["summary"]] == [
        ("cublas", 22.3, None, None), ("public_nan", 134.1, None, True)]
    assert rep["versions"] == {"torch": "2.11", "triton": "3.6.0", "cuda": "13.0"} and rep["device"] == DEVICE
    assert rep["cprofile"] == {"kernels": "text"} and rep["command"] == "python x.py --profile kernels"


def _e2e_record(tmp_path: Path) -> Path:
    gen = {"mode": "eager", "sampling": "greedy"}
    rows = [_row("generate", "transformers", 10.0, config=gen, mismatched=900, compared=1000),
            _row("generate", "rl_engine", 25.0, config=gen, ratio_vs_baseline=2.5, mismatched=0, compared=1000),
            _row("train_step", "rl_engine", 1.0, config={"layout": "packed"}, ratio_vs_baseline=1.0,
                 layout_mismatched=0, layout_compared=10)]
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"command": "c", "rows": rows}))
    out = _platform(tmp_path) / "e2e_hf.json"
    assert _tool().main(["e2e_hf", str(raw), "--commit", "abc", "--out", str(out)]) == 0
    return out


def test_reasons_name_each_missed_point_and_update_a_record_in_place(tmp_path, capsys):
    """``--reasons`` gives each missed point the first matching rule's reason (met points get
    none); without a raw report it rewrites only the record's ``miss_reasons``."""
    out = _e2e_record(tmp_path)
    before = json.loads(out.read_text())
    assert "miss_reasons" not in before
    rules = tmp_path / "reasons.json"
    rules.write_text(json.dumps([{"cases": "generate eager *", "reason": "host-bound launches", "evidence": "host.json"},
                                 {"cases": "*", "reason": "never used for a met point", "evidence": "x"}]))
    assert _tool().main(["e2e_hf", "--reasons", str(rules), "--out", str(out)]) == 0
    after = json.loads(out.read_text())
    assert after["miss_reasons"] == [{"case": "generate eager greedy", "reason": "host-bound launches",
                                      "evidence": "host.json"}]
    assert {k: v for k, v in after.items() if k != "miss_reasons"} == before
    assert "1 misses with a reason" in capsys.readouterr().out
    # negative control: a rule that matches no miss leaves the miss unexplained, and says so
    rules.write_text(json.dumps([{"cases": "train *", "reason": "r", "evidence": "e"}]))
    assert _tool().main(["e2e_hf", "--reasons", str(rules), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["miss_reasons"] == []
    assert "no reason for the missed point 'generate eager greedy'" in capsys.readouterr().out


def test_reasons_arguments_are_checked(tmp_path, capsys):
    out = _e2e_record(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"cases": "*", "reason": ""}]))
    for argv, msg in ((["e2e_hf", "--out", str(out)], "raw: expected"),
                      (["e2e_hf", "--reasons", str(bad), "--out", str(out)], "--reasons:"),
                      (["e2e_hf", "--reasons", str(bad), "--out", str(out), "--commit", "abc"], "raw: expected"),
                      (["e2e_hf", str(tmp_path / "raw.json"), "--out", str(out)], "--commit: expected"),
                      (["moe", "--reasons", str(bad), "--out", str(out.with_name("moe.json"))], "raw: expected"),
                      (["gemm", str(tmp_path / "raw.json"), "--commit", "a", "--out", str(out.with_name("gemm.json"))],
                       "family: expected one of")):
        with pytest.raises(SystemExit):
            _tool().main(argv)
        assert msg in capsys.readouterr().err


def test_merge_keeps_the_reasons_of_kept_points_only(tmp_path):
    """A run that measures generate again drops generate's old reason (its new point has none
    until --reasons), and keeps the reason of the training point it did not measure."""
    out = _e2e_record(tmp_path)
    rec = json.loads(out.read_text())
    rec["summary"] = [dict(s, met=False) if s["case"] == "train step, packed" else s for s in rec["summary"]]
    rows = [dict(r, ratio_vs_baseline=1.5) if r["op"] == "train_step" else r for r in rec["rows"]]
    rec["rows"] = rows
    rec["miss_reasons"] = [{"case": "generate eager greedy", "reason": "old", "evidence": "e"},
                           {"case": "train step, packed", "reason": "kept", "evidence": "e"}]
    out.write_text(json.dumps(rec))
    gen = {"mode": "eager", "sampling": "greedy"}
    raw = tmp_path / "gen.json"
    raw.write_text(json.dumps({"command": "c", "rows": [
        _row("generate", "transformers", 10.0, config=gen, mismatched=900, compared=1000),
        _row("generate", "rl_engine", 30.0, config=gen, ratio_vs_baseline=3.0, mismatched=0, compared=1000)]}))
    assert _tool().main(["e2e_hf", str(raw), "--commit", "def", "--out", str(out), "--merge"]) == 0
    merged = json.loads(out.read_text())
    assert merged["miss_reasons"] == [{"case": "train step, packed", "reason": "kept", "evidence": "e"}]
