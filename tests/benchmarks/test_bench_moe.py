"""The MoE benchmarks' command lines on the CPU: the CPU benchmark's quick run and the GPU
benchmark's dry run (``--device cpu --tiny``) write schema rows with a baseline ratio; bad
arguments are refused by name; the GPU benchmark without CUDA exits cleanly."""

from __future__ import annotations

import json

import pytest

from benchmarks.common.harness import ROW_KEYS
from benchmarks.operators import bench_moe_cpu, bench_moe_gpu


def _rows(path):
    doc = json.loads(path.read_text())
    assert doc["rows"] and all(ROW_KEYS <= set(r) for r in doc["rows"])
    return doc


def test_cpu_benchmark_quick_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_moe_cpu, "SHAPES", ((64, 8, 2, 32),))
    out = tmp_path / "cpu.json"
    assert bench_moe_cpu.main(["--out", str(out), "--quick", "--warmup", "0", "--repeats", "1"]) == 0
    rows = _rows(out)["rows"]
    ours = [r for r in rows if r["implementation"] == bench_moe_cpu.IMPL]
    assert len(ours) == len(rows) // 2 == 4 and all(r["ratio_vs_baseline"] > 0 for r in ours)
    assert {r["config"]["backward"] for r in ours} == {False, True}
    assert all(r["baseline"] == bench_moe_cpu.BASELINE for r in ours)


def test_gpu_benchmark_dry_run_on_cpu(tmp_path):
    out = tmp_path / "dry.json"
    assert bench_moe_gpu.main(["--out", str(out), "--device", "cpu", "--tiny", "--tokens", "3", "--warmup", "0",
                               "--repeats", "1"]) == 0
    doc = _rows(out)
    assert doc["meta"]["dry_run_on_cpu"] and doc["meta"]["baseline"] == bench_moe_gpu.baseline_name()
    ours = [r for r in doc["rows"] if r["implementation"] == bench_moe_gpu.IMPL]
    assert {r["config"]["kind"] for r in ours} == {"fwd", "fwd_bwd"} and all("ratio_vs_baseline" in r for r in ours)


@pytest.mark.parametrize("args,message", [
    (["--tokens", "0"], "--tokens: expected positive integers"),
    (["--tokens", "1,x"], "--tokens: expected positive integers"),
    (["--kinds", "fwd,bwd"], "--kinds: expected a subset of fwd,fwd_bwd"),
    (["--device", "cpu", "--modes", "graph"], "--modes: expected eager and/or graph"),
    (["--top-k", "200"], "expected positive sizes with top-k <= experts"),
    (["--device", "tpu"], "--device: expected cuda, cuda:N or cpu"),
])
def test_gpu_benchmark_refuses_bad_arguments_by_name(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        bench_moe_gpu.main(["--out", str(tmp_path / "a.json"), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_gpu_benchmark_without_cuda_exits_cleanly(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_moe_gpu.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "a.json"
    assert bench_moe_gpu.main(["--out", str(out), "--tokens", "1"]) == 2 and not out.exists()
    assert "no CUDA device visible" in capsys.readouterr().err
