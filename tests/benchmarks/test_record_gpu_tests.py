"""``tools/benchmarking/record_gpu_tests.py``: a shard record from pytest's junit XML (counts, modules,
failed node ids), replacing the shard of the same name; failures without a stated cause are refused."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import load_script

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
 skipped="1" tests="3" time="12.5" timestamp="2026-01-01T00:00:00">
<testcase classname="tests.a.test_x" name="test_one" time="1"/>
<testcase classname="tests.a.test_x" name="test_two" time="1"><failure message="boom"/></testcase>
<testcase classname="tests.b.test_y" name="test_three" time="1"><skipped message="no"/></testcase>
</testsuite></testsuites>"""


def _tool():
    return load_script("tools/benchmarking/record_gpu_tests.py")


def test_shard_from_junit_replaces_the_named_shard(tmp_path):
    xml = tmp_path / "pytest_gpu.xml"
    xml.write_text(XML)
    report = tmp_path / "gpu_tests.json"
    report.write_text(json.dumps({"shards": [{"shard": "rest", "tests": 1}, {"shard": "attention", "tests": 2}]}))
    assert _tool().main(["rest", str(xml), "--commit", "abc", "--command", "pytest", "--why", "a cause",
                         "--report", str(report)]) == 0
    shards = {s["shard"]: s for s in json.loads(report.read_text())["shards"]}
    rest = shards["rest"]
    assert (rest["tests"], rest["failures"], rest["skipped"], rest["seconds"]) == (3, 1, 1, 12.5)
    assert rest["failed"] == ["tests/a/test_x.py::test_two"] and rest["why"] == "a cause"
    assert rest["modules"] == {"tests/a/test_x.py": {"tests": 2, "skipped": 0}, "tests/b/test_y.py": {"tests": 1, "skipped": 1}}
    assert shards["attention"] == {"shard": "attention", "tests": 2}


def test_failures_need_a_cause(tmp_path):
    xml = tmp_path / "pytest_gpu.xml"
    xml.write_text(XML)
    with pytest.raises(SystemExit, match="--why"):
        _tool().shard("rest", xml, commit="abc", command="pytest")


def test_a_run_ended_by_the_session_time_limit_is_marked_stopped(tmp_path):
    """The driver's ``--session-timeout`` ends a run with its junit XML written; the log's line
    marks the shard partial. Control: a log without that line leaves the shard unmarked."""
    xml = tmp_path / "pytest_gpu.xml"
    xml.write_text(XML)
    log = tmp_path / "pytest_gpu.log"
    log.write_text("...\n!!!!!!!! xdist.dsession.Interrupted: session-timeout: 380.0 sec exceeded !!!!!!!!!\n")
    got = _tool().shard("attention", xml, commit="abc", command="pytest", why="a cause", log=log)
    assert got["stopped"] == "session-timeout: 380.0 sec exceeded"
    log.write_text("3 passed in 12.50s\n")
    assert "stopped" not in _tool().shard("attention", xml, commit="abc", command="pytest", why="a cause", log=log)


def test_the_log_beside_the_xml_is_read_by_default(tmp_path):
    """The CLI reads ``pytest_gpu.log`` beside ``pytest_gpu.xml`` (as the driver writes them)
    without ``--log``; a named log that does not exist is refused."""
    xml = tmp_path / "pytest_gpu.xml"
    xml.write_text(XML)
    (tmp_path / "pytest_gpu.log").write_text("Interrupted: session-timeout: 50.0 sec exceeded\n")
    report = tmp_path / "gpu_tests.json"
    report.write_text(json.dumps({"shards": []}))
    args = ["rest", str(xml), "--commit", "abc", "--command", "pytest", "--why", "a cause", "--report", str(report)]
    assert _tool().main(args) == 0
    assert json.loads(report.read_text())["shards"][0]["stopped"] == "session-timeout: 50.0 sec exceeded"
    with pytest.raises(SystemExit):
        _tool().main(args + ["--log", str(tmp_path / "missing.log")])


def test_a_platforms_first_shard_starts_its_report(tmp_path):
    """With no report yet, ``--env`` (the driver's env.txt) and ``--device-from`` (a record of the
    same machine) start one; control: without them the missing report is refused, and a record
    without its platform or an env.txt without the version line is refused by name."""
    xml = tmp_path / "pytest_gpu.xml"
    xml.write_text(XML)
    env = tmp_path / "env.txt"
    env.write_text("== env\nNVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\n"
                   "torch 2.11.0+cu130 cuda 13.0 triton 3.6.0 pydantic 2.14.4 hypothesis 6.168.3 pytest 9.1.1\n")
    device = {"name": "NVIDIA H100 80GB HBM3", "capability": "sm90", "sm_count": 132, "driver": "580.159.04",
              "memory_mib": 81079}
    record = tmp_path / "bench_matrix_gpu.json"
    record.write_text(json.dumps({"platform": "h100", "device": device, "versions": {"python": "3.12.3"}}))
    report = tmp_path / "h100" / "gpu_tests.json"
    report.parent.mkdir()
    args = ["rest", str(xml), "--commit", "abc", "--command", "pytest", "--why", "a cause", "--report", str(report)]
    with pytest.raises(SystemExit):
        _tool().main(args)
    assert not report.exists()
    assert _tool().main(args + ["--env", str(env), "--device-from", str(record)]) == 0
    rep = json.loads(report.read_text())
    assert (rep["platform"], rep["device"], rep["family"]) == ("h100", device, "gpu_tests")
    assert rep["versions"] == {"torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0", "pydantic": "2.14.4",
                               "hypothesis": "6.168.3", "pytest": "9.1.1", "python": "3.12.3"}
    assert [s["shard"] for s in rep["shards"]] == ["rest"]
    report.unlink()
    record.write_text(json.dumps({"device": device}))
    with pytest.raises(SystemExit, match="--device-from"):
        _tool().main(args + ["--env", str(env), "--device-from", str(record)])
    env.write_text("== env\n")
    with pytest.raises(SystemExit, match="--env"):
        _tool().main(args + ["--env", str(env), "--device-from", str(record)])


def test_rlk_check_runs_are_recorded_with_their_command_and_expectation(tmp_path):
    """``--check`` turns ``rlk check --device cuda --json`` outputs into ``rlk_check`` entries: the
    command rebuilt from the run's settings, the production plan expected to mismatch (the
    negative control); a rerun of the same command replaces its entry; a CPU run is refused."""
    xml = tmp_path / "pytest_gpu.xml"
    xml.write_text(XML)
    report = tmp_path / "gpu_tests.json"
    report.write_text(json.dumps({"shards": []}))
    base = {"device": "cuda", "dtype": "bfloat16", "model": "qwen3-0.6b", "extra_prompt_tokens": 1000,
            "kv_cache": "paged", "plan": "R/R", "compared_tokens": 1404, "mismatched_tokens": 0, "max_abs_diff": 0.0,
            "bits_digest": "ab"}
    rr, pp = tmp_path / "rr.json", tmp_path / "pp.json"
    rr.write_text(json.dumps(base))
    pp.write_text(json.dumps(base | {"model": "tiny", "extra_prompt_tokens": 0, "kv_cache": "contiguous",
                                     "plan": "P/P", "mismatched_tokens": 37, "max_abs_diff": 0.01}))
    args = ["rest", str(xml), "--commit", "abc", "--command", "pytest", "--why", "a cause", "--report", str(report)]
    assert _tool().main(args + ["--check", str(rr), "--check", str(pp), "--check", str(rr)]) == 0
    checks = json.loads(report.read_text())["rlk_check"]
    assert [(c["command"], c["mismatched_tokens"], c["expected"]) for c in checks] == [
        ("rlk check --device cuda --dtype bfloat16 --plan P/P --json", 37,
         "mismatches (negative control: both sides on the production plan)"),
        ("rlk check --device cuda --dtype bfloat16 --preset qwen3-0.6b --extra-prompt-tokens 1000 --kv-cache paged "
         "--json", 0, "0 mismatches")]
    rr.write_text(json.dumps(base | {"device": "cpu"}))
    with pytest.raises(SystemExit, match="--check"):
        _tool().main(args + ["--check", str(rr)])
