"""``docs/benchmarks/gpu.md`` is generated from ``reports/gpu/<platform>/*.json``: the committed page
equals the page regenerated in memory (``python -m benchmarks.common.gpu_docs`` rewrites it), every
benchmark of record carries its command, device, versions and rows, and every plot the page links
exists. A changed report (negative control) makes the page stale."""

from __future__ import annotations

import copy
import re

from benchmarks.common import gpu_docs

REQUIRED = ("schema_version", "family", "platform", "title", "command", "commit", "device", "versions",
            "timestamp", "summary", "rows")


def test_committed_page_matches_the_reports():
    text = gpu_docs.render(gpu_docs.load_reports())
    assert gpu_docs.PAGE.read_text(encoding="utf-8") == text, (
        "docs/benchmarks/gpu.md is stale: run python -m benchmarks.common.gpu_docs")


def test_every_benchmark_of_record_is_complete():
    reports = gpu_docs.load_reports()
    assert reports, "no reports/gpu/<platform>/*.json"
    for plat, fams in reports.items():
        assert "gpu_tests" in fams, plat
        for fam, rep in fams.items():
            if fam == "gpu_tests":
                assert rep["shards"] and all(s["tests"] > 0 for s in rep["shards"]), plat
                continue
            missing = [k for k in REQUIRED if k not in rep]
            assert not missing, (plat, fam, missing)
            assert rep["family"] == fam and rep["platform"] == plat
            assert rep["rows"] and rep["summary"], (plat, fam)
            for s in rep["summary"]:
                assert {"case", "metric", "achieved", "target", "met"} <= set(s), (plat, fam, s)
                assert (s["met"] is None) == (s["target"].startswith("(")), (plat, fam, s)


def test_linked_plots_exist():
    text = gpu_docs.PAGE.read_text(encoding="utf-8")
    links = re.findall(r"\]\((img/[^)]+\.png)\)", text)
    assert links
    for link in links:
        assert (gpu_docs.PAGE.parent / link).is_file(), link


def test_a_changed_report_makes_the_page_stale():
    reports = gpu_docs.load_reports()
    changed = copy.deepcopy(reports)
    plat = next(p for p, fams in changed.items() if "gemm" in fams)
    entry = changed[plat]["gemm"]["summary"][0]
    entry["achieved"] = entry["achieved"] + 0.5
    assert gpu_docs.render(changed) != gpu_docs.render(reports)


def test_a_shard_stopped_by_the_session_limit_is_called_partial():
    """A shard that pytest's session time limit ended is named partial on the page, with pytest's
    line; the shards of record (none stopped: the control) have no such sentence."""
    reports = gpu_docs.load_reports()
    plat = next(p for p, fams in reports.items() if "gpu_tests" in fams)
    assert "is partial" not in gpu_docs.render(reports)
    changed = copy.deepcopy(reports)
    sh = changed[plat]["gpu_tests"]["shards"][0]
    sh["stopped"] = "session-timeout: 380.0 sec exceeded"
    text = gpu_docs.render(changed)
    assert f"Shard {sh['shard']} is partial: pytest's session time limit ended it (session-timeout: 380.0 sec " \
           f"exceeded) after {sh['tests']} tests" in text


def test_a_shard_without_a_bounded_performance_run_says_not_run():
    """A rerun of a few tests records no bounded-performance run: its row says "not run" where a
    shard with one (the control) gives passed / skipped."""
    reports = gpu_docs.load_reports()
    plat = next(p for p, fams in reports.items() if "gpu_tests" in fams)
    changed = copy.deepcopy(reports)
    shards = changed[plat]["gpu_tests"]["shards"]
    with_perf = next(s for s in shards if "bounded_performance" in s)
    rerun = dict(with_perf, shard="a rerun")
    del rerun["bounded_performance"]
    shards.append(rerun)
    text = gpu_docs.render(changed)
    row = next(line for line in text.splitlines() if line.startswith("| a rerun |"))
    assert row.endswith("| not run |")
    control = next(line for line in text.splitlines() if line.startswith(f"| {with_perf['shard']} |"))
    assert "not run" not in control and control.rstrip(" |").split("|")[-1].strip().count("/") == 1


def test_a_platform_without_an_rlk_check_run_says_so():
    """A platform whose test record holds no ``rlk check`` on CUDA gets a sentence saying so instead
    of the table; a record with runs (the control) gets the table."""
    reports = gpu_docs.load_reports()
    plat = next(p for p, fams in reports.items() if fams["gpu_tests"].get("rlk_check"))
    with_runs = gpu_docs.render({plat: reports[plat]})
    assert "| command | compared tokens |" in with_runs and "no run of record" not in with_runs
    changed = copy.deepcopy(reports[plat])
    del changed["gpu_tests"]["rlk_check"]
    text = gpu_docs.render({plat: changed})
    assert "`rlk check` on CUDA has no run of record on this platform." in text
    assert "| command | compared tokens |" not in text


def test_an_rlk_check_run_off_its_expected_outcome_is_marked():
    """A negative control (``P/P``) that found no mismatch, or an rl-kernel run that found some, is
    marked ✗ with a sentence; the runs as expected (the control) carry no mark."""
    reports = gpu_docs.load_reports()
    plat = next(p for p, fams in reports.items() if fams["gpu_tests"].get("rlk_check"))
    changed = copy.deepcopy(reports[plat])
    runs = changed["gpu_tests"]["rlk_check"]
    runs[:] = [dict(runs[0], command="rlk check --device cuda --json", expected="0 mismatches", mismatched_tokens=0),
               dict(runs[0], command="rlk check --device cuda --plan P/P --json",
                    expected="mismatches (negative control: both sides on the production plan)", mismatched_tokens=12)]
    text = gpu_docs.render({plat: changed})
    assert "not the expected outcome" not in text and " ✗ |" not in text.split("`rlk check` on CUDA")[-1]
    runs[1]["mismatched_tokens"] = 0
    runs[0]["mismatched_tokens"] = 3
    text = gpu_docs.render({plat: changed})
    assert "production plan) ✗ |" in text and "| 0 mismatches ✗ |" in text
    assert "a negative control that found no mismatch cannot show" in text


def test_a_family_with_miss_reasons_lists_its_misses_with_their_reasons():
    """A record with ``miss_reasons`` gets its missed points listed under its table, each with its
    reason or "no reason recorded"; without the key (the control) no such list appears."""
    reports = gpu_docs.load_reports()
    changed = copy.deepcopy(reports)
    plat, fam = next((p, f) for p, fams in changed.items() for f, rep in fams.items()
                     if f not in ("gpu_tests", "matrix") and any(s.get("met") is False for s in rep["summary"]))
    rep = changed[plat][fam]
    rep.pop("miss_reasons", None)
    without = gpu_docs.render(changed, images=False)
    missed = [s for s in rep["summary"] if s.get("met") is False]
    rep["miss_reasons"] = [{"case": missed[0]["case"], "reason": "a planted reason", "evidence": "planted.json"}]
    text = gpu_docs.render(changed, images=False)
    assert "a planted reason (planted.json)" in text and "a planted reason" not in without
    assert text.count("Misses and their measured reasons:") == without.count("Misses and their measured reasons:") + 1
    if len(missed) > 1:
        assert f"* {missed[1]['case']} (" in text and "no reason recorded" in text


def _unexplained(rep) -> list[str]:
    reasons = {r["case"] for r in rep.get("miss_reasons", [])}
    return [s["case"] for s in rep.get("summary", []) if s.get("met") is False and s["case"] not in reasons]


def test_every_missed_point_of_record_has_a_measured_reason():
    """Each point a benchmark of record misses carries its measured reason (``miss_reasons``), so
    the page never shows a miss without one; a planted miss without a reason (negative control)
    is found."""
    reports = gpu_docs.load_reports()
    missing = {(plat, fam): _unexplained(rep) for plat, fams in reports.items() for fam, rep in fams.items()
               if fam != "gpu_tests" and _unexplained(rep)}
    assert not missing, missing
    plat, fams = next(iter(reports.items()))
    fam, rep = next((f, r) for f, r in fams.items() if f != "gpu_tests")
    planted = copy.deepcopy(rep)
    planted["summary"].append({"case": "planted", "metric": "m", "achieved": 2.0, "target": "≤ 1", "met": False})
    assert _unexplained(planted) == ["planted"]
