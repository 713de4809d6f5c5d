"""Markdown tables from a benchmark report (the tables in docs/benchmarks/ are generated so).

::

    python -m benchmarks.common.tables reports/cpu/bench_cpu_ops.json

prints, per operator, one row per configuration: the native median, the rl-kernel median and
ratio with the entry point's NaN scan (as users call it) and without it
(``nan_policy("propagate")``), the p20–p80 spread of the rl-kernel timing, and the peak memory
torch allocated during one call (outputs included) for the native call and the entry point.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["comparison_rows", "markdown_tables"]

#: the ``nan_policy`` labels of the entry point timed with its scan of host activations: the
#: default ``"auto"``, or ``"raise"``, which scans them alike
SCANNED = ("auto", "raise")


def _key(config: Mapping[str, Any]) -> tuple:
    return tuple(sorted((k, v) for k, v in config.items() if k != "nan_policy"))


def comparison_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Pair each native row with the rl-kernel rows of the same op and config, per operator: the
    entry point as users call it (``"scanned"``: a row labelled with one of :data:`SCANNED`) and
    under ``nan_policy("propagate")`` (``"propagate"``)."""
    native: dict[tuple, Mapping[str, Any]] = {}
    ours: dict[tuple, dict[str, Mapping[str, Any]]] = defaultdict(dict)
    for r in rows:
        k = (r["op"], _key(r["config"]))
        if r.get("baseline") is None:
            native[k] = r
        elif r["config"].get("nan_policy") in SCANNED + ("propagate",):
            ours[k]["scanned" if r["config"]["nan_policy"] in SCANNED else "propagate"] = r
        # other rows with a baseline are reference points (e.g. the fixed-BLAS-tile GEMM), tabulated apart
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (op, cfg), nat in native.items():
        mine = ours.get((op, cfg), {})
        out[op].append({"config": dict(nat["config"]), "native": nat, "scanned": mine.get("scanned"), "propagate": mine.get("propagate")})
    return dict(out)


def _ms(v: float) -> str:
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _mib(v: int | None) -> str:
    return "–" if v is None else f"{v / 2**20:.2f}"


def markdown_tables(rows: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for op, entries in comparison_rows(rows).items():
        cfg_keys = [k for k in entries[0]["config"]]
        head = [
            *cfg_keys, "native ms", "rl-kernel ms", "ratio", "ratio without NaN scan", "rl-kernel p20–p80 ms",
            "peak MiB native / rl-kernel", "impl",
        ]
        lines = [f"### `{op}`", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for e in entries:
            nat, r, p = e["native"], e["scanned"], e["propagate"]
            cells = [str(e["config"][k]) for k in cfg_keys]
            cells.append(_ms(nat["median"]))
            cells.append(_ms(r["median"]) if r else "–")
            cells.append(f"{r['ratio_vs_baseline']:.2f}×" if r else "–")
            cells.append(f"{p['ratio_vs_baseline']:.2f}×" if p else "–")
            cells.append(f"{_ms(r['p20'])}–{_ms(r['p80'])}" if r else "–")
            cells.append(f"{_mib(nat['peak_memory_bytes'])} / {_mib(r['peak_memory_bytes']) if r else '–'}")
            cells.append(f"`{r['implementation']}`" if r else "–")
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.common.tables REPORT.json", file=sys.stderr)
        return 2
    doc = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    sys.stdout.write(markdown_tables(doc["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
