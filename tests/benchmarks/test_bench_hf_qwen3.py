"""``benchmarks/e2e/bench_hf_qwen3.py`` on the CPU with ``--tiny``: the JSON rows it writes and the
bit checks it asserts in the run (never timing-gated).

The negative control runs the rl_engine rows without the install: the same run must then fail
its checks (exit 1) and say which."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common.harness import ROW_KEYS
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "e2e" / "bench_hf_qwen3.py"


def run(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "e2e.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--threads", "1", "--repeats", "1", "--out", str(out),
                        *args], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert out.exists(), r.stderr[-3000:]
    return r, json.loads(out.read_text())


def _rows(doc, op, **config):
    return [r for r in doc["rows"] if r["op"] == op and all(r["config"].get(k) == v for k, v in config.items())]


def test_tiny_run_writes_rows_and_passes_its_bit_checks(tmp_path):
    r, doc = run(tmp_path, "--modes", "eager", "--warmup", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert doc["meta"]["failures"] == [] and doc["command"]
    for row in doc["rows"]:
        assert ROW_KEYS <= set(row), sorted(ROW_KEYS - set(row))
        assert row["benchmark"] == "bench_hf_qwen3" and row["device"]["type"] == "cpu" and row["samples"] == 1
        assert row["versions"]["transformers"] and row["config"]["num_hidden_layers"] == 2
    for layout in ("padded", "packed"):
        rows = {x["implementation"]: x for x in _rows(doc, "train_step", layout=layout)}
        assert set(rows) == {"transformers", "rl_engine"}
        assert rows["rl_engine"]["layout_mismatched"] == 0 and rows["rl_engine"]["bits_check"] == "pass"
        assert rows["rl_engine"]["baseline"] == "transformers" and rows["rl_engine"]["ratio_vs_baseline"] > 0
    assert sum(x["layout_mismatched"] for x in _rows(doc, "train_step") if x["implementation"] == "transformers") > 0
    gen = _rows(doc, "generate", mode="eager")
    assert {(x["config"]["sampling"], x["implementation"]) for x in gen} == {
        (s, i) for s in ("greedy", "sampled") for i in ("transformers", "rl_engine", "rl_engine (transformers DynamicCache)")}
    for x in gen:
        assert x["compared"] == 4 * 8
        if x["implementation"].startswith("rl_engine"):
            assert x["mismatched"] == 0 and x["bits_check"] == "pass", x
    assert sum(x["mismatched"] for x in gen if x["implementation"] == "transformers") > 0  # the negative control bites
    assert {x["config"]["cache"] for x in gen if x["implementation"] == "rl_engine"} == {"RlkCache dynamic"}


def test_negative_control_without_the_install_fails_the_checks(tmp_path):
    r, doc = run(tmp_path, "--sections", "generate", "--modes", "eager", "--samplings", "greedy", "--no-fallback",
                 "--warmup", "0", "--negative-control")
    assert r.returncode == 1
    assert {x["config"]["sampling"] for x in doc["rows"]} == {"greedy"}  # --samplings picks the settings
    assert "FAILED: generate eager greedy [rl_engine]" in r.stderr and "expected 0" in r.stderr
    assert doc["meta"]["negative_control"] and doc["meta"]["failures"]
    assert all(x["bits_check"] == "FAIL" for x in doc["rows"] if x["implementation"] == "rl_engine")


def test_negative_controls_rule():
    """Per operation, transformers rows that never mismatch are reported (the checker must bite)."""
    mod = load_script("benchmarks/e2e/bench_hf_qwen3.py")
    rows = [{"op": "generate", "implementation": "transformers", "mismatched": 0},
            {"op": "generate", "implementation": "transformers", "mismatched": 3},
            {"op": "train_step", "implementation": "transformers", "layout_mismatched": 0}]
    assert mod.negative_controls(rows) == ["train_step [transformers]: 0 mismatched tokens in every row, expected > 0 "
                                           "(negative control)"]


@pytest.mark.slow
def test_tiny_static_compiled_and_trl(tmp_path):
    """The static-cache + compiled decode rows (aot_eager on the CPU) and the TRL GRPO section. (The
    eager rows come along: at this size transformers' compiled decode happens to match its training
    forward, so the generate negative control needs them.)"""
    r, doc = run(tmp_path, "--sections", "generate", "--modes", "eager,static-compiled", "--no-fallback", "--trl",
                 "--warmup", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    gen = _rows(doc, "generate", mode="static-compiled")
    assert len(gen) == 4 and all(x["config"]["compile"]["backend"] == "aot_eager" for x in gen)
    assert all(x["mismatched"] == 0 for x in gen if x["implementation"] == "rl_engine")
    trl = {x["implementation"]: x for x in _rows(doc, "trl_grpo_step")}
    assert set(trl) == {"transformers", "rl_engine"}
    assert trl["rl_engine"]["mismatched"] == 0 and trl["rl_engine"]["compared"] > 0
    assert trl["transformers"]["mismatched"] > 0
