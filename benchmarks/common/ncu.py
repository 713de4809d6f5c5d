"""Nsight Compute helpers shared by the profiling tools: the counter set they collect and a reader
of ``ncu --csv`` output (the default ``details`` page: one row per launch and metric).

The counters answer "why is this kernel slower than that one" with measurements: device time, SM
and DRAM throughput as a share of peak, tensor-pipe activity (all MMA kinds, and HMMA), the FP32
FMA pipe, achieved occupancy, registers per thread and the occupancy they allow, and the warp
stall reasons in cycles per issued instruction (the breakdown of ncu's WarpStateStats section).
"""

from __future__ import annotations

import csv
from pathlib import Path

__all__ = ["STALLS", "NCU_METRICS", "read_launches", "short_name"]

STALLS = ("long_scoreboard", "short_scoreboard", "wait", "barrier", "mio_throttle", "math_pipe_throttle",
          "lg_throttle", "not_selected", "no_instruction", "dispatch_stall")

NCU_METRICS = (
    "gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active", "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread", "launch__occupancy_limit_registers",
    *(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS),
)

_SHORT = (("smsp__average_warps_issue_stalled_", "stall_"), ("_per_issue_active.ratio", ""),
          (".avg.pct_of_peak_sustained_elapsed", "%el"), (".avg.pct_of_peak_sustained_active", "%act"))


def short_name(metric: str) -> str:
    """``smsp__average_warps_issue_stalled_wait_per_issue_active.ratio`` → ``stall_wait`` (and the
    ``%el`` / ``%act`` suffixes of the throughput shares)."""
    for a, b in _SHORT:
        metric = metric.replace(a, b)
    return metric


def read_launches(path: str | Path) -> list[dict]:
    """The launches of an ``ncu --csv`` output in launch order: ``{"id", "kernel", "grid", "block",
    "metrics": {short name: float or str}}``. Lines that are not CSV rows (the application's own
    output, ncu's ``==PROF==`` lines) are skipped; an output without metric rows gives ``[]``."""
    lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.startswith('"')]
    rows = list(csv.DictReader(lines))
    if not rows or "Metric Name" not in rows[0]:
        return []
    launches: dict[tuple, dict] = {}
    order: list[tuple] = []
    for r in rows:
        key = (r.get("ID"), r.get("Kernel Name"))
        if key not in launches:
            launches[key] = {"id": r.get("ID"), "kernel": r.get("Kernel Name"), "grid": r.get("Grid Size"),
                             "block": r.get("Block Size"), "metrics": {}}
            order.append(key)
        value = (r.get("Metric Value") or "").replace(",", "")
        try:
            parsed: float | str = float(value)
        except ValueError:
            parsed = value
        launches[key]["metrics"][short_name(r["Metric Name"])] = parsed
    return [launches[k] for k in order]
