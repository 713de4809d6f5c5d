"""``benchmarks/common/gpu_docs.py`` renders the public-API matrix of record
(``reports/gpu/<platform>/matrix.json``): counts per mode, the misses first (points that could not
run, then those beyond their family's limit, then the rest, each with its recorded reason), then
every point per family with graph and eager side by side, and a plot."""

from __future__ import annotations

import json

from benchmarks.common import gpu_docs


def entry(family: str, case: str, mode: str, achieved, met, *, within=True, error=None, goal=1.05,
          metric="time_ratio", target="time <= 1.05x cuBLAS (none above 1.10x)") -> dict:
    return {"case": f"{family}: {case} [{mode}]", "family": family, "mode": mode, "implementation": "rlk.ops.x",
            "metric": "time vs torch.F.linear", "achieved": achieved, "target": target, "met": met,
            "within_limit": within, "goal": goal, "ratio_metric": metric, "baseline": "torch.F.linear",
            "bits": "0123456789abcdef", "error": error}


def matrix_report(**meta) -> dict:
    summary = [
        entry("gemm", "qwen3-8b.qkv K=4096 N=6144 M=1", "graph", 0.98, True),
        entry("gemm", "qwen3-8b.qkv K=4096 N=6144 M=1", "eager", 1.07, False),
        entry("gemm", "qwen3-8b.down K=12288 N=4096 M=64", "graph", 1.20, False, within=False),
        entry("attention", "qwen3-8b Hq=32 Hkv=8 D=128 4x4096 forward", "graph", None, False, within=None,
              error="not capturable: synchronises with the host", goal=0.9, metric="throughput_ratio",
              target="throughput >= 0.90x baseline (none below 0.85x)"),
        entry("attention", "qwen3-8b Hq=32 Hkv=8 D=128 4x4096 forward", "eager", 0.95, True, goal=0.9,
              metric="throughput_ratio", target="throughput >= 0.90x baseline (none below 0.85x)"),
        entry("lmhead", "qwen3-8b H=4096 V=151936 T=4096 forward_backward", "eager", None, None, within=None,
              goal=None, target="(no target: liger_kernel not importable)"),
    ]
    return {"schema_version": 1, "family": "matrix", "platform": "h200", "title": "Benchmark matrix",
            "command": "python benchmarks/operators/bench_matrix_gpu.py --quick --out m.json", "commit": "abc1234",
            "device": {"name": "NVIDIA H200", "capability": "sm90", "sm_count": 132, "driver": "580", "memory_mib": 1},
            "versions": {"torch": "2.11"}, "timestamp": "2026-12-03T00:00:00+00:00",
            "meta": {"partial": False, "stopped": None, "points": 4, "points_done": 4, **meta},
            "summary": summary, "rows": [{"role": "ours"}],
            "miss_reasons": [{"case": "gemm: qwen3-8b.down K=12288 N=4096 M=64 [graph]",
                              "reason": "one wave of 64 tiles leaves half the SMs idle",
                              "evidence": "ncu: sm__throughput 48 %, tools/benchmarking/ncu_sass_summary.py"}]}


def test_the_matrix_section_lists_the_misses_first():
    reports = {"h200": {"matrix": matrix_report()}}
    text = gpu_docs.render(reports)
    sec = text[text.index("## Benchmark matrix (public API)"):]
    assert "Targets met: **2 of 5** (eager: 1 of 2; graph: 1 of 3); beyond the family's limit: **1**." in sec
    misses = sec[sec.index("### Misses"):sec.index("### GEMM")]
    order = [line.split(" | ")[0] for line in misses.splitlines() if line.startswith("| ") and "[" in line]
    assert order == ["| attention: qwen3-8b Hq=32 Hkv=8 D=128 4x4096 forward [graph]",  # could not run
                     "| gemm: qwen3-8b.down K=12288 N=4096 M=64 [graph]",  # beyond the limit
                     "| gemm: qwen3-8b.qkv K=4096 N=6144 M=1 [eager]"]
    assert "error ✗ | throughput >= 0.90x baseline (none below 0.85x) | not capturable: synchronises" in misses
    assert "one wave of 64 tiles leaves half the SMs idle (ncu: sm__throughput 48 %" in misses
    assert "1.070 ✗ | time <= 1.05x cuBLAS (none above 1.10x) | not yet profiled" in misses
    assert "| qwen3-8b.qkv K=4096 N=6144 M=1 | **0.980** | 1.070 ✗ |" in sec
    assert "| qwen3-8b Hq=32 Hkv=8 D=128 4x4096 forward | error ✗ | **0.950** |" in sec
    assert "| qwen3-8b H=4096 V=151936 T=4096 forward_backward | — | — |" in sec
    assert "![matrix on h200](img/h200_matrix.png)" in sec and "[Benchmark matrix](matrix.md)" in sec
    # a report of record as test_gpu_docs requires of every family
    assert all((s["met"] is None) == s["target"].startswith("(") for s in matrix_report()["summary"])


def test_a_run_cut_short_says_so_and_nothing_missed_says_none():
    rep = matrix_report(partial=True, stopped={"reason": "--max-seconds 200 spent"}, points=9, points_done=4)
    rep["summary"] = [s for s in rep["summary"] if s["met"] is not False]
    sec = gpu_docs.render({"h200": {"matrix": rep}})
    assert "The run measured 4 of 9 points (--max-seconds 200 spent)." in sec
    assert "### Misses\n\nNone." in sec


def test_the_matrix_file_is_loaded_and_plotted(tmp_path):
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "matrix.json").write_text(json.dumps(matrix_report()))
    (tmp_path / "h200" / "unrelated.json").write_text("{}")
    reports = gpu_docs.load_reports(tmp_path)
    assert list(reports["h200"]) == ["matrix"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = tmp_path / "m.png"
    gpu_docs._matrix_plot(plt, reports["h200"]["matrix"], "h200", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
