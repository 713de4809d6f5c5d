"""One benchmark harness: repeated timings, robust statistics, peak memory, JSON rows.

Every benchmark script builds callables, measures them with :func:`measure` (or
:func:`measure_interleaved` when comparing an implementation with its baseline: the candidates
run round-robin, so drift in machine load hits both alike), and writes rows made by
:func:`make_row` with :func:`write_report`.

Statistics: after ``warmup`` untimed calls, ``repeats`` timed calls; the row reports the median
(p50), p20 and p80 of the samples (percentiles by linear interpolation between order statistics,
as ``numpy.percentile``'s default), plus min/max and the sample count, in milliseconds.

Peak memory: the largest amount of memory allocated by torch during one call above what was
allocated when it started (outputs included), measured in a separate, untimed call:

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``;
* CPU: the running sum of the torch profiler's allocation/free events (``profile_memory=True``);
  ``None`` when the profiler cannot report it.

A row (``schema_version`` 1)::

    {"schema_version": 1, "benchmark": "bench_cpu_ops", "op": "gemm.linear",
     "implementation": "cpu.tiled_blas", "baseline": "torch.F.linear",
     "config": {"M": 64, "K": 1024, "N": 1024, "dtype": "float32"},
     "device": {"type": "cpu", "name": "AMD EPYC", "platform": "cpu:x86_64", "threads": 2},
     "timestamp": "2026-11-29T22:50:01+00:00",
     "versions": {"torch": "2.13.0+cpu", "rl_engine": "0.1.0", "python": "3.11.7", "triton": null},
     "unit": "ms", "median": 1.23, "p20": 1.20, "p80": 1.30, "min": 1.18, "max": 1.5,
     "samples": 20, "warmup": 3, "peak_memory_bytes": 262144, "peak_memory_method": "torch.profiler"}

plus ``"ratio_vs_baseline"`` (median / baseline median, measured in the same interleaved run)
on rows that have a baseline.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform as _py_platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SCHEMA_VERSION",
    "ROW_KEYS",
    "Stats",
    "percentile",
    "summarize",
    "time_samples",
    "host_call_samples",
    "measure",
    "measure_interleaved",
    "cuda_graph_ms",
    "capture_cuda_graph",
    "peak_memory",
    "device_info",
    "versions",
    "make_row",
    "machine_load",
    "write_report",
]

SCHEMA_VERSION = 1

#: Keys every row has (tests/benchmarks freeze them).
ROW_KEYS = frozenset(
    {
        "schema_version", "benchmark", "op", "implementation", "baseline", "config", "device",
        "timestamp", "versions", "unit", "median", "p20", "p50", "p80", "min", "max", "samples",
        "warmup", "peak_memory_bytes", "peak_memory_method",
    }
)


@dataclass(frozen=True)
class Stats:
    """Summary of timing samples, in the unit of the samples."""

    n: int
    median: float
    p20: float
    p80: float
    min: float
    max: float

    def scaled(self, factor: float) -> "Stats":
        return Stats(self.n, *(v * factor for v in (self.median, self.p20, self.p80, self.min, self.max)))

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between order statistics."""
    if not samples:
        raise ValueError("samples: expected at least one sample, got none")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q: expected a percentile in [0, 100], got {q}")
    s = sorted(float(v) for v in samples)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples: Sequence[float]) -> Stats:
    """Median, p20, p80, min and max of ``samples`` (any non-empty sequence of numbers)."""
    if not samples:
        raise ValueError("samples: expected at least one sample, got none")
    if any(not math.isfinite(float(v)) for v in samples):
        raise ValueError("samples: expected finite numbers")
    return Stats(
        n=len(samples),
        median=percentile(samples, 50.0),
        p20=percentile(samples, 20.0),
        p80=percentile(samples, 80.0),
        min=float(min(samples)),
        max=float(max(samples)),
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed_call(fn: Callable[[], Any], device: str) -> float:
    """Seconds one call takes, the device synchronised before and after."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def time_samples(fn: Callable[[], Any], *, warmup: int = 3, repeats: int = 20, device: str = "cpu") -> list[float]:
    """``repeats`` timings (seconds) of ``fn()`` after ``warmup`` untimed calls."""
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup: expected >= 0, got {warmup}")
    for _ in range(warmup):
        fn()
    _sync(device)
    return [_timed_call(fn, device) for _ in range(repeats)]


def host_call_samples(fn: Callable[[], Any], *, calls: int = 200, repeats: int = 15, warmup: int = 20,
                      device: str = "cpu") -> list[float]:
    """Host time per call, in milliseconds: ``repeats`` loops of ``calls`` calls each (after
    ``warmup`` untimed calls), one sample per loop (its time / ``calls``).

    On CUDA the stream is first given a sleep longer than the loop, so the kernels queue behind
    it and the loop times what the host does per call (checks, dispatch, launches). A call that
    synchronises waits for that sleep instead, so a host synchronisation shows up as a time far
    above the others rather than hiding in device time."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(repeats):
        if cuda:
            torch.cuda._sleep(int(2e9 * max(0.02, calls * 2e-4)))  # ~2 GHz: longer than the loop
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        _sync(device)
        out.append((t1 - t0) * 1e3 / calls)
    return out


def cprofile_text(fn: Callable[[], Any], calls: int, *, top: int = 30, warmup: int = 20, device: str = "cpu",
                  ahead_s_per_call: float = 0.0) -> str:
    """``cProfile`` of ``calls`` calls of ``fn`` after ``warmup`` untimed ones: the ``top``
    functions by own time, then by cumulative time. On CUDA, ``ahead_s_per_call`` > 0 first queues
    that much device sleep per call, so the GPU stays ahead and the profile is of the host alone."""
    import cProfile
    import io
    import pstats

    for _ in range(warmup):
        fn()
    _sync(device)
    if ahead_s_per_call > 0 and torch.device(device).type == "cuda":
        torch.cuda._sleep(int(2e9 * calls * ahead_s_per_call))  # ~2 GHz
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    _sync(device)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def capture_cuda_graph(fn: Callable[[], Any], *, calls: int = 1) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` captured ``calls`` times in one CUDA graph after one eager call on a side stream
    (what capture needs: lazy initialisation and compilation happen outside the graph); returns
    the graph, not yet replayed, and what the last captured call returned (tensors the replays
    write)."""
    if calls < 1:
        raise ValueError(f"calls: expected >= 1, got {calls}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph, out


def cuda_graph_ms(fn: Callable[[], Any], *, calls: int, repeats: int, warmup: int = 1) -> list[float]:
    """Per-call device time (ms) of ``fn`` captured ``calls`` times in one CUDA graph: one sample
    per replay, ``repeats`` replays, after ``warmup`` eager calls and one call on a side stream
    (what capture needs). Free of Python launch overhead; time measured by CUDA events."""
    return cuda_graphs_interleaved_ms({"fn": fn}, calls=calls, repeats=repeats, warmup=warmup)["fn"]


def cuda_graphs_interleaved_ms(fns: Mapping[str, Callable[[], Any]], *, calls: int, repeats: int,
                               warmup: int = 1) -> dict[str, list[float]]:
    """``cuda_graph_ms`` of several callables, replayed round-robin: each is warmed up and captured
    (``calls`` times in one graph) first, then round ``r`` replays every graph once, starting at a
    rotating offset, so that clock and temperature drift over the run falls on all candidates
    alike (timed one after another, the last ones ran on a hotter GPU). Returns per-call device
    times (ms), ``repeats`` samples each."""
    if calls < 1 or repeats < 1:
        raise ValueError(f"calls, repeats: expected >= 1, got {calls}, {repeats}")
    if not fns:
        raise ValueError("fns: expected at least one callable")
    names = list(fns)
    graphs = {}
    for name in names:
        for _ in range(warmup):
            fns[name]()
        torch.cuda.synchronize()
        graphs[name] = capture_cuda_graph(fns[name], calls=calls)[0]
        graphs[name].replay()
        torch.cuda.synchronize()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graphs[name].replay()
            e1.record()
            e1.synchronize()
            samples[name].append(e0.elapsed_time(e1) / calls)
    return samples


def measure(fn: Callable[[], Any], *, warmup: int = 3, repeats: int = 20, device: str = "cpu") -> Stats:
    """Timing statistics of ``fn()`` in **milliseconds**."""
    return summarize(time_samples(fn, warmup=warmup, repeats=repeats, device=device)).scaled(1e3)


def measure_interleaved(
    fns: Mapping[str, Callable[[], Any]], *, warmup: int = 3, repeats: int = 20, device: str = "cpu"
) -> dict[str, Stats]:
    """Statistics (ms) of several callables timed round-robin.

    Round ``r`` runs every callable once, starting at a rotating offset, so slow phases of a
    shared machine and cache effects of call order fall on all candidates alike; their ratios
    are then fair even when absolute times drift.
    """
    if not fns:
        raise ValueError("fns: expected at least one callable")
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats}")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    _sync(device)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            samples[name].append(_timed_call(fns[name], device))
    return {n: summarize(s).scaled(1e3) for n, s in samples.items()}


def _cpu_peak_from_profiler(fn: Callable[[], Any]) -> int | None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:  # pragma: no cover - profiler internals moved
        return None
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    peak = current = 0
    for _, nbytes in mem:
        current += nbytes
        peak = max(peak, current)
    return peak


def peak_memory(fn: Callable[[], Any], *, device: str = "cpu") -> tuple[int | None, str | None]:
    """``(bytes, method)``: peak memory torch allocated during one call of ``fn`` above what was
    allocated before it (outputs included); ``(None, None)`` where not measurable."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base), "torch.cuda.max_memory_allocated"
    if device == "cpu":
        try:
            peak = _cpu_peak_from_profiler(fn)
        except Exception:  # pragma: no cover - a profiler that cannot run here
            return None, None
        return (peak, "torch.profiler") if peak is not None else (None, None)
    return None, None


def versions() -> dict[str, str | None]:
    """Versions recorded in every row: torch, rl_engine, python, triton (None if absent)."""
    import rl_engine
    from rl_engine.platforms import platform_of

    return {
        "torch": torch.__version__,
        "rl_engine": rl_engine.__version__,
        "python": _py_platform.python_version(),
        "triton": platform_of("cpu").triton_version,
    }


def portable_command(script: str, argv: Sequence[str], drop: Sequence[str] = ("--out",)) -> str:
    """``python3 <script> <argv>`` for a report's ``command``, without the options in ``drop`` and
    their values (``--opt value`` or ``--opt=value``): those name the measuring machine's files and
    limits, not what was measured."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = True
            continue
        if a.split("=", 1)[0] in drop and "=" in a:
            continue
        out.append(a)
    return " ".join(["python3", script, *out])


def device_info(device: str = "cpu") -> dict[str, Any]:
    """``{"type", "name", "platform", "threads"}`` of ``device``."""
    from rl_engine.platforms import platform_of

    plat = platform_of(device)
    return {
        "type": torch.device(device).type,
        "name": plat.device_name,
        "platform": plat.key,
        "threads": torch.get_num_threads(),
    }


def make_row(
    *,
    benchmark: str,
    op: str,
    implementation: str,
    config: Mapping[str, Any],
    stats: Stats,
    warmup: int,
    device: Mapping[str, Any],
    versions: Mapping[str, Any],
    peak_memory_bytes: int | None = None,
    peak_memory_method: str | None = None,
    baseline: str | None = None,
    timestamp: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One JSON row (see module docstring); ``stats`` in milliseconds."""
    row: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": benchmark,
        "op": op,
        "implementation": implementation,
        "baseline": baseline,
        "config": dict(config),
        "device": dict(device),
        "timestamp": timestamp or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": dict(versions),
        "unit": "ms",
        "median": stats.median,
        "p20": stats.p20,
        "p50": stats.median,
        "p80": stats.p80,
        "min": stats.min,
        "max": stats.max,
        "samples": stats.n,
        "warmup": warmup,
        "peak_memory_bytes": peak_memory_bytes,
        "peak_memory_method": peak_memory_method,
    }
    if extra:
        clash = set(extra) & set(row)
        if clash:
            raise ValueError(f"extra: keys {sorted(clash)} would overwrite standard row keys")
        row.update(extra)
    return row


def machine_load() -> dict[str, Any]:
    """1/5/15-minute load averages and this process's nice value (``None`` where unsupported):
    a benchmark on a shared machine records how busy it was."""
    try:
        load: list[float] | None = [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):  # pragma: no cover - Windows
        load = None
    try:
        nice: int | None = os.nice(0)
    except (AttributeError, OSError):  # pragma: no cover
        nice = None
    return {"loadavg": load, "nice": nice, "cpu_count": os.cpu_count()}


def write_report(
    rows: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    command: str | None = None,
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``{"schema_version", "command", "meta", "rows": [...]}`` to ``path`` (parents created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema_version": SCHEMA_VERSION,
        "command": command if command is not None else " ".join([Path(sys.executable).name, *sys.argv]),
        "meta": dict(meta or {}),
        "rows": [dict(r) for r in rows],
    }
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return out
