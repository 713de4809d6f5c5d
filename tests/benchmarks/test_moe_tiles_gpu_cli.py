"""``tools/benchmarking/moe_tiles_gpu.py`` on the CPU: the table it builds from measurements
(fastest accepted candidate per load, rows merged and bounded by the largest measured load; a
rejected candidate is never picked) validates and loads, also rebuilt from a report; bad arguments are refused by name before any device work; a
machine without CUDA gets a clear exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "benchmarking" / "moe_tiles_gpu.py"


def _tool():
    return load_script("tools/benchmarking/moe_tiles_gpu.py")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "", "PYTHONPATH": str(ROOT)})


def test_table_from_measurements_picks_the_fastest_accepted_and_merges(tmp_path):
    from rl_engine.backends.triton.moe import tiles

    tool = _tool()
    ref, a, b = tool.candidates("dx")[:3]

    def m(cfg, ms, ok=True):
        return {"cfg": cfg, "config": cfg.key, "accepted": ok, "ms": ms if ok else None}

    results = {"dx": {1: [m(ref, 2.0), m(a, 1.0), m(b, 0.5, ok=False)],   # b is faster but its bits differ
                      16: [m(ref, 3.0), m(a, 1.5), m(b, 2.0)],
                      1024: [m(ref, 9.0), m(a, 8.0), m(b, 4.0)]},
               "dact": {1: [m(ref, 2.0), m(a, 1.0)], 16: [m(ref, 1.0), m(a, 1.5)]}}  # the reference last: no row
    tab = tool.table(results, "smX", {"command": "test"})
    tiles.TileTable.model_validate(tab)
    _, E, K, _ = tool.DIMS
    assert [(r["role"], r["max_slots_per_expert"], r["config"]["block_m"]) for r in tab["rows"]] == [
        ("dx", 16 * K / E, a.block_m), ("dx", 1024 * K / E, b.block_m), ("dact", 1 * K / E, a.block_m)]
    assert tab["rows"][0]["ms"] == 1.5 and tab["rows"][0]["default_ms"] == 3.0
    path = tmp_path / "smX.json"
    path.write_text(json.dumps(tab))
    rows = tiles.load_table(path)[("dx", torch.bfloat16)]
    assert [cfg for _, cfg in rows] == [a, b]


def test_rebuild_writes_the_table_of_an_earlier_report_without_a_gpu(tmp_path):
    tool = _tool()
    ref, a = tool.candidates("dw_down")[:2]
    rows = [{"config": ref.key, "accepted": True, "ms": 2.0}, {"config": a.key, "accepted": True, "ms": 1.0}]
    report = tmp_path / "moe_tiles.json"
    report.write_text(json.dumps({"arch": "smX", "source": {"command": "c", "commit": "old"},
                                  "measurements": {"dw_down": {"16": rows}}}))
    out = tmp_path / "smX.json"
    r = run("--rebuild", str(report), "--table", str(out), "--commit", "abc1234")
    assert r.returncode == 0, r.stderr
    tab = json.loads(out.read_text())
    assert tab["source"]["commit"] == "abc1234" and [row["config"]["sorted_operands"] for row in tab["rows"]] == [True]


def test_every_role_measures_the_reference_first():
    from rl_engine.backends.triton.moe import tiles

    tool = _tool()
    for role in tiles.ROLES:
        cands = tool.candidates(role)
        assert cands[0] == tiles.DEFAULT and len(set(cands)) == len(cands)
        assert any(c.w_transposed for c in cands) == (role in ("dx", "dact"))
        assert any(c.sorted_operands for c in cands) == role.startswith("dw_")
        assert any(c.masked_loads for c in cands) == (role in ("dx", "dact") or role.startswith("dw_"))


@pytest.mark.parametrize("args,message", [
    (["--out", "x.json", "--commit", "abc", "--roles", "dx,dz"], "--roles: expected some of gate_up, down, dx, dact, dw_gate_up, dw_down"),
    (["--out", "x.json", "--commit", "abc", "--tokens", "16,0"], "--tokens: expected positive token counts"),
    (["--out", "x.json", "--commit", "abc", "--tokens", "a"], "--tokens: expected positive token counts"),
    (["--out", "x.json", "--commit", "abc", "--repeats", "0"], "--repeats: expected a positive count"),
    (["--out", "x.json"], "--commit: required, the commit of the measured tree"),
])
def test_bad_arguments_are_refused_by_name(args, message):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


def test_without_cuda_exit_cleanly(tmp_path):
    r = run("--out", str(tmp_path / "t.json"), "--commit", "abc")
    assert r.returncode == 1, r.stderr
    assert "moe_tiles_gpu: needs a CUDA device" in r.stderr and "Traceback" not in r.stderr
