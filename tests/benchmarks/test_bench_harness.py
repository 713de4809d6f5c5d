"""The benchmark harness: statistics, peak memory, row schema (never timing-gated)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks.common import harness
from benchmarks.common.harness import ROW_KEYS, Stats, make_row, percentile, summarize


@pytest.mark.parametrize("n", [1, 2, 5, 10, 101])
def test_percentiles_match_numpy_linear_interpolation(n):
    samples = list(np.random.default_rng(n).lognormal(size=n))
    for q in (0, 20, 50, 80, 100):
        assert percentile(samples, q) == pytest.approx(float(np.percentile(samples, q)), rel=1e-12, abs=0)


def test_summarize_known_values():
    s = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert s == Stats(n=5, median=3.0, p20=1.8, p80=4.2, min=1.0, max=5.0)
    assert summarize([7.0]) == Stats(1, 7.0, 7.0, 7.0, 7.0, 7.0)
    assert s.scaled(1e3).median == 3000.0 and s.scaled(1e3).n == 5


def test_summarize_is_order_independent():
    data = [0.3, 0.1, 0.9, 0.5, 0.7, 0.2]
    assert summarize(data) == summarize(sorted(data)) == summarize(data[::-1])


def test_bad_samples_are_rejected():
    with pytest.raises(ValueError, match="^samples: expected at least one sample"):
        summarize([])
    with pytest.raises(ValueError, match="^samples: expected finite"):
        summarize([1.0, float("nan")])
    with pytest.raises(ValueError, match="^q: expected a percentile"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="^repeats"):
        harness.time_samples(lambda: None, repeats=0)


def test_warmup_and_repeats_are_counted():
    calls = []
    samples = harness.time_samples(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(samples) == 5 and len(calls) == 7 and all(s >= 0 for s in samples)
    stats = harness.measure(lambda: None, warmup=0, repeats=4)
    assert stats.n == 4 and stats.min <= stats.p20 <= stats.median <= stats.p80 <= stats.max


def test_interleaved_runs_round_robin_with_rotating_start():
    order: list[str] = []
    fns = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    stats = harness.measure_interleaved(fns, warmup=1, repeats=3)
    assert set(stats) == {"a", "b", "c"} and all(s.n == 3 for s in stats.values())
    warm, timed = order[:3], order[3:]
    assert warm == ["a", "b", "c"]
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_cpu_peak_memory_sees_a_known_allocation():
    n = 1 << 20  # 4 MiB of fp32, plus a same-sized temporary freed before the end

    def fn():
        tmp = torch.ones(n)
        out = tmp * 2
        del tmp
        return out

    peak, method = harness.peak_memory(fn, device="cpu")
    assert method == "torch.profiler"
    assert 2 * 4 * n <= peak < 3 * 4 * n


def test_row_schema():
    stats = Stats(n=3, median=2.0, p20=1.5, p80=2.5, min=1.0, max=3.0)
    row = make_row(
        benchmark="b", op="gemm.linear", implementation="cpu.exact_sum", config={"M": 64}, stats=stats,
        warmup=1, device=harness.device_info("cpu"), versions=harness.versions(), peak_memory_bytes=10,
        peak_memory_method="torch.profiler", baseline="torch.nn.functional.linear",
    )
    assert set(row) == ROW_KEYS
    assert row["schema_version"] == harness.SCHEMA_VERSION == 1
    assert (row["median"], row["p50"], row["p20"], row["p80"], row["samples"], row["unit"]) == (2.0, 2.0, 1.5, 2.5, 3, "ms")
    assert set(row["versions"]) == {"torch", "rl_engine", "python", "triton"}
    assert row["versions"]["torch"] == torch.__version__
    assert set(row["device"]) == {"type", "name", "platform", "threads"} and row["device"]["type"] == "cpu"
    assert row["timestamp"].endswith("+00:00")
    extra = make_row(benchmark="b", op="o", implementation="i", config={}, stats=stats, warmup=0, device={},
                     versions={}, extra={"ratio_vs_baseline": 1.5})
    assert extra["ratio_vs_baseline"] == 1.5
    with pytest.raises(ValueError, match="overwrite standard row keys"):
        make_row(benchmark="b", op="o", implementation="i", config={}, stats=stats, warmup=0, device={},
                 versions={}, extra={"median": 0.0})


def test_write_report_round_trip(tmp_path):
    rows = [{"a": 1}, {"b": [1, 2]}]
    path = harness.write_report(rows, tmp_path / "sub" / "r.json", command="python x.py --quick")
    doc = json.loads(path.read_text())
    assert doc == {"schema_version": 1, "command": "python x.py --quick", "meta": {}, "rows": rows}
    load = harness.machine_load()
    assert set(load) == {"loadavg", "nice", "cpu_count"}
    harness.write_report(rows, path, meta={"load_start": load})
    assert json.loads(path.read_text())["meta"]["load_start"]["cpu_count"] == load["cpu_count"]


def test_bench_cpu_ops_quick_writes_schema_rows(tmp_path):
    """A smoke run of the CPU benchmark script: rows have the schema (times are not judged)."""
    from benchmarks.operators import bench_cpu_ops

    out = tmp_path / "bench.json"
    assert bench_cpu_ops.main(["--quick", "--ops", "gemm.linear", "--dtypes", "float32", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4  # rl_engine (NaN scan on), rl_engine (NaN scan off), native, fixed BLAS tiles
    for row in rows:
        assert ROW_KEYS <= set(row) and row["op"] == "gemm.linear" and row["samples"] == 3
    tiles = [r for r in rows if r["implementation"].startswith("fixed BLAS tiles")]
    assert len(tiles) == 1 and tiles[0]["ratio_vs_baseline"] > 0
    ours = [r for r in rows if r["baseline"] is not None and r not in tiles]
    assert {r["config"]["nan_policy"] for r in ours} == {"auto", "propagate"}
    assert all(r["implementation"] == "cpu.exact_sum" and r["ratio_vs_baseline"] > 0 for r in ours)


@pytest.mark.parametrize("scanned", ["auto", "raise"])
def test_markdown_tables_pair_rows_by_config(scanned):
    """The scanned row pairs under either label: ``"auto"`` (the default policy) or ``"raise"``
    (which scans host activations alike); an unknown label is not paired."""
    from benchmarks.common.tables import comparison_rows, markdown_tables

    stats = Stats(n=5, median=2.0, p20=1.9, p80=2.1, min=1.8, max=2.2)
    native = Stats(n=5, median=1.0, p20=0.9, p80=1.1, min=0.8, max=1.2)
    common = dict(benchmark="b", op="gemm.linear", warmup=1, device={}, versions={})
    rows = [
        make_row(implementation="cpu.exact_sum", config={"M": 64, "dtype": "float32", "nan_policy": scanned}, stats=stats,
                 baseline="F.linear", extra={"ratio_vs_baseline": 2.0}, **common),
        make_row(implementation="cpu.exact_sum", config={"M": 64, "dtype": "float32", "nan_policy": "propagate"},
                 stats=stats.scaled(0.6), baseline="F.linear", extra={"ratio_vs_baseline": 1.2}, **common),
        make_row(implementation="F.linear", config={"M": 64, "dtype": "float32"}, stats=native, **common),
    ]
    paired = comparison_rows(rows)
    assert list(paired) == ["gemm.linear"] and len(paired["gemm.linear"]) == 1
    text = markdown_tables(rows)
    assert "| M | dtype | native ms | rl-kernel ms | ratio | ratio without NaN scan |" in text
    assert "| 64 | float32 | 1.000 | 2.000 | 2.00× | 1.20× | 1.900–2.100 | – / – | `cpu.exact_sum` |" in text
    rows[0]["config"]["nan_policy"] = "strict"  # the control: a label that is not the scanned call's
    assert comparison_rows(rows)["gemm.linear"][0]["scanned"] is None


def test_cuda_graph_ms_rejects_bad_counts():
    with pytest.raises(ValueError, match="calls, repeats"):
        harness.cuda_graphs_interleaved_ms({"a": lambda: None}, calls=1, repeats=0)
    with pytest.raises(ValueError, match="fns"):
        harness.cuda_graphs_interleaved_ms({}, calls=1, repeats=3)
    with pytest.raises(ValueError, match="calls, repeats"):
        harness.cuda_graph_ms(lambda: None, calls=0, repeats=3)


@pytest.mark.gpu
def test_cuda_graph_ms_times_each_replay_per_call():
    x = torch.randn(1 << 20, device="cuda")
    one = harness.cuda_graph_ms(lambda: x.mul_(1.0), calls=1, repeats=5)
    ten = harness.cuda_graph_ms(lambda: x.mul_(1.0), calls=10, repeats=5)
    assert len(one) == len(ten) == 5 and all(t > 0 for t in one + ten)
    # per-call time: ten captured calls are not ten times one call's time
    assert sorted(ten)[2] < 5 * sorted(one)[2]


@pytest.mark.gpu
def test_cuda_graphs_interleaved_ms_times_every_callable_per_call():
    small, big = torch.randn(1 << 16, device="cuda"), torch.randn(1 << 24, device="cuda")
    got = harness.cuda_graphs_interleaved_ms({"small": lambda: small.mul_(1.0), "big": lambda: big.mul_(1.0)},
                                             calls=4, repeats=7)
    assert set(got) == {"small", "big"} and all(len(v) == 7 and min(v) > 0 for v in got.values())
    # 256x the bytes: the medians must order (a broken pairing of names and graphs would not)
    assert sorted(got["big"])[3] > 4 * sorted(got["small"])[3]


def test_cprofile_text_lists_the_profiled_calls_by_own_and_cumulative_time():
    from benchmarks.common.harness import cprofile_text

    calls = []

    def fn():
        calls.append(1)
        return torch.randn(16).sum()

    text = cprofile_text(fn, 7, top=5, warmup=3)
    assert len(calls) == 10  # warm-up calls are made but not profiled
    assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text
    fn_rows = [ln.split() for ln in text.splitlines() if ln.rstrip().endswith("(fn)")]
    assert fn_rows and all(r[0] == "7" for r in fn_rows)  # fn profiled 7 times, in both listings


def test_portable_command_drops_the_machine_local_options_only():
    """``portable_command``: the options named in ``drop`` leave with their values, in either
    spelling; every other argument stays in order (the control: ``--commit`` is kept)."""
    from benchmarks.common.harness import portable_command

    argv = ["--out", "/tmp/x.json", "--ms", "256,1024", "--max-seconds=250", "--commit", "abc1234"]
    assert portable_command("tools/t.py", argv, ("--out", "--max-seconds")) == \
        "python3 tools/t.py --ms 256,1024 --commit abc1234"
    assert portable_command("tools/t.py", argv) == "python3 tools/t.py --ms 256,1024 --max-seconds=250 --commit abc1234"
