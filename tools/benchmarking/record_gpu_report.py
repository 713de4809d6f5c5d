"""Turn a GPU benchmark's raw JSON into the benchmark of record ``reports/gpu/<platform>/<family>.json``.

The raw report (``{"command", "meta", "rows"}`` from :func:`benchmarks.common.harness.write_report`)
keeps every row; this adds what the generated page needs: the family, the title, the measured
commit, the device (name, capability, SMs and driver, which the rows do not carry: taken from the
platform's ``gpu_tests.json`` when its device name matches) and one summary entry per judged
point — ``case``, ``metric``, ``achieved``, ``target`` and ``met`` (``None`` with a target text in
parentheses where the issue sets none).

Families and their targets:

* ``call_overhead`` (``benchmarks/operators/bench_call_overhead.py --device cuda``): host µs per
  call that the public entry point adds over the implementation it dispatches to (``public −
  impl``), ≤ 15 µs (≤ 40 µs for the attention step APIs, whose rows compare with SDPA instead).
* ``e2e_hf`` (``benchmarks/e2e/bench_hf_qwen3.py``): rl_engine-installed time over plain
  transformers' time, training step ≤ 1.10×, ``generate`` ≤ 1.20×, with the raw-bit mismatch
  count of each row (installed rows must have none); the TRL GRPO step is reported without a
  time target.
* ``moe`` (``benchmarks/operators/bench_moe_gpu.py``): rl-kernel time over the grouped-GEMM
  baseline's time; at ≥ 1,024 tokens ≥ 0.90× its throughput (time ratio ≤ 1/0.9), below it ≤ 1.2×.
* ``host_overhead`` (``tools/benchmarking/host_overhead_gpu.py``): host µs per eager call, per
  case, no target (where the per-call cost goes); the tool's cProfile texts are kept (``cprofile``).

    python tools/benchmarking/record_gpu_report.py moe OUT/bench_moe_gpu.json --commit 28d01d4 \\
        --out reports/gpu/h200/moe.json
    python tools/benchmarking/record_gpu_report.py e2e_hf OUT/bench_hf_qwen3.json --commit eef99fc \\
        --out reports/gpu/h200/e2e_hf.json --merge    # a generate-only run keeps the training rows

A missed point's measured reason goes in with ``--reasons FILE`` (``matrix_reasons.py``'s format: a
JSON list of ``{"cases": PATTERN, "reason", "evidence"}``, the first shell-style pattern that matches
a missed point's case gives its reason), written as the record's ``miss_reasons``, which the
generated page prints under the family's table. Without a raw report, ``--reasons`` updates the
reasons of the existing ``--out`` record of any family (``gemm`` and ``attention`` included, whose
records other tools write) and changes nothing else:

    python tools/benchmarking/record_gpu_report.py e2e_hf --reasons reasons.json --out reports/gpu/h200/e2e_hf.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from matrix_reasons import load_rules, rule_for  # noqa: E402 - the reasons file: format, validation, matching

TITLES = {
    "call_overhead": "Host cost of one small call through the public API on the GPU (decode-sized rows, bf16)",
    "e2e_hf": "transformers' Qwen3 at 8B dimensions (36 layers, random bf16 weights), plain against rl_engine "
              "installed: training step and generate",
    "moe": "Routed-expert layer at Qwen3-30B-A3B dimensions (hidden 2,048, 128 experts, top-8, intermediate 768), "
           "rl-kernel against a non-invariant grouped GEMM",
    "host_overhead": "Host time per eager call at decode sizes (qkv M=1 GEMM layers, decode-step operators, "
                     "attention step)",
}


def _met(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def call_overhead(rows: list[dict]) -> list[dict]:
    """The benchmark's own per-op summary (on its ``native`` row): ``public − impl``, or for the
    attention step APIs ``public − native`` (the cached step per layer, fixed plan cost apart)."""
    out = []
    for r in rows:
        sm = r.get("summary")
        if r["implementation"] != "native" or not sm:
            continue
        on = sm["target_on"]
        v = sm[on]
        out.append({"case": r["op"], "metric": "µs over the implementation" if on == "overhead_us" else "µs over SDPA",
                    "achieved": round(v, 1), "target": f"≤ {sm['target_us']:g}", "met": _met(v, sm["target_us"]),
                    "public_us": round(sm["public_us"], 1), "native_us": round(sm["native_us"], 1)})
    return out


def e2e_hf(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["implementation"] == "transformers" or r.get("ratio_vs_baseline") is None:
            continue
        c = r["config"]
        if r["op"] == "train_step":
            case, limit = f"train step, {c['layout']}", 1.10
            mism, comp = r.get("layout_mismatched"), r.get("layout_compared")
        elif r["op"] == "trl_grpo_step":  # the issue sets no time target: reported, judged on bits only
            case, limit = f"TRL GRPO step ({c['layers']} layers, {c['generations']} × {c['completion_len']} tokens)", None
            mism, comp = r.get("mismatched"), r.get("compared")
        else:
            case = f"generate {c.get('mode', '')} {c.get('sampling', '')}".strip()
            limit = 1.20
            mism, comp = r.get("mismatched"), r.get("compared")
        if r["implementation"] != "rl_engine":
            case += f" ({r['implementation'].removeprefix('rl_engine').strip(' ()')})"
        v = r["ratio_vs_baseline"]
        target, met = ("(no time target; 0 mismatches)", None) if limit is None else (f"≤ {limit:.2f}", _met(v, limit) and mism == 0)
        out.append({"case": case, "metric": "time vs plain HF (×)", "achieved": round(v, 3), "target": target, "met": met,
                    "mismatched": mism, "compared": comp})
    return out


def moe(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        v = r.get("ratio_vs_baseline")
        if v is None:
            continue
        c = r["config"]
        limit = 1 / 0.9 if c["tokens"] >= 1024 else 1.2
        out.append({"case": f"T={c['tokens']} {c['kind']} [{c['mode']}]", "metric": f"time vs {r['baseline']} (×)",
                    "achieved": round(v, 3), "target": "≥ 0.90× throughput" if c["tokens"] >= 1024 else "≤ 1.20× time",
                    "met": _met(v, limit)})
    return out


def host_overhead(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        entry = {"case": r["case"], "metric": "us per call (p50)", "achieved": r["p50_us"], "target": "(no target)",
                 "met": None, "min_us": r["min_us"]}
        if not r.get("host_only", True):
            entry["host_and_device"] = True
        out.append(entry)
    return out


SUMMARIES: dict[str, Callable[[list[dict]], list[dict]]] = {"call_overhead": call_overhead, "e2e_hf": e2e_hf, "moe": moe,
                                                            "host_overhead": host_overhead}


def _row_device_name(row: dict) -> str:
    dev = row["device"]
    return dev if isinstance(dev, str) else dev["name"]


def _row_versions(row: dict) -> dict[str, Any]:
    if "versions" in row:
        return row["versions"]
    return {k: row[k] for k in ("torch", "triton", "cuda") if k in row}


def _device(rows: list[dict], platform_dir: Path) -> dict[str, Any]:
    name = _row_device_name(rows[0])
    tests = platform_dir / "gpu_tests.json"
    if tests.exists():
        dev = json.loads(tests.read_text(encoding="utf-8"))["device"]
        if dev.get("name") == name:
            return dev
    raise SystemExit(f"--out: {tests} has no device record for {name!r} (SM count, driver); record a GPU test run first")


def record(family: str, raw: dict, *, commit: str, out: Path, notes: list[str], command: str | None = None) -> dict:
    rows = raw["rows"]
    if not rows:
        raise SystemExit("raw report: no rows")
    summary = SUMMARIES[family](rows)
    if not summary:
        raise SystemExit(f"raw report: no row of family {family!r} carries a ratio to judge")
    versions = {k: v for k, v in _row_versions(rows[0]).items() if v is not None and k != "rl_engine"}
    rep = {"schema_version": 1, "family": family, "platform": out.parent.name, "title": TITLES[family],
           "command": (command or raw.get("command") or COMMANDS.get(family, "")).replace("/tmp/rlk_gpu_work/", ""),
           "commit": commit,
           "device": _device(rows, out.parent), "versions": versions, "timestamp": rows[-1]["timestamp"],
           "notes": notes, "summary": summary, "rows": rows, "meta": raw.get("meta", {})}
    if "cprofile" in raw:
        rep["cprofile"] = raw["cprofile"]
    return rep


#: The command of a family whose raw report does not carry one.
COMMANDS = {"host_overhead": "python tools/benchmarking/host_overhead_gpu.py --out host_overhead.json"}

#: The config entries that tell one setting of a family's rows from another (the implementations
#: of a setting are replaced together).
SETTING_KEYS = ("mode", "sampling", "layout", "tokens", "kind")


def _setting(row: dict) -> tuple:
    return (row["op"], *(row["config"].get(k) for k in SETTING_KEYS))


def merge(rep: dict, existing: dict) -> dict:
    """``rep`` with the rows of ``existing`` (the same family's record) for the settings ``rep``
    did not measure (operation, mode, sampling, layout, tokens, kind) — a run that measured one
    section or one setting replaces only those rows. Every row says the commit it was measured at
    (``measured_commit``), the report's ``commit`` lists the commits by operation, and the existing
    notes follow the run's own; a kept point that misses in the merged summary keeps its ``miss_reasons`` entry."""
    if existing.get("family") != rep["family"]:
        raise SystemExit(f"--merge: the existing record is of family {existing.get('family')!r}, not {rep['family']!r}")
    new_ops = {r["op"] for r in rep["rows"]}
    measured = {_setting(r) for r in rep["rows"]}
    kept = [dict(r, measured_commit=r.get("measured_commit", existing["commit"])) for r in existing["rows"]
            if _setting(r) not in measured]
    rows = [dict(r, measured_commit=rep["commit"]) for r in rep["rows"]] + kept
    summary = SUMMARIES[rep["family"]](rows)
    by_commit: dict[str, set[str]] = {rep["commit"]: set(new_ops)}
    for r in kept:
        by_commit.setdefault(r["measured_commit"], set()).add(r["op"])
    commit = "; ".join(f"{c} ({', '.join(sorted(ops))})" for c, ops in by_commit.items())
    notes = list(rep["notes"]) + [n for n in existing.get("notes", []) if n not in rep["notes"]]
    out = dict(rep, rows=rows, summary=summary, commit=commit, notes=notes)
    # a kept point that misses in the merged summary keeps its recorded reason; a point this run measured has none
    # until --reasons gives it one
    measured_cases = {s["case"] for s in rep["summary"]}
    missed = {s["case"] for s in summary if s.get("met") is False}
    kept_reasons = [r for r in existing.get("miss_reasons", []) if r["case"] in missed and r["case"] not in measured_cases]
    if kept_reasons:
        out["miss_reasons"] = kept_reasons
    return out


def attach_reasons(rep: dict, rules: list[dict[str, str]]) -> list[str]:
    """Set ``rep["miss_reasons"]``: one ``{case, reason, evidence}`` entry per missed summary point
    that a rule matches (the first rule whose pattern matches its case), in the summary's order;
    returns the missed cases no rule matches."""
    out, unexplained = [], []
    for s in rep["summary"]:
        if s.get("met") is not False:
            continue
        rule = rule_for(s["case"], rules)
        if rule is None:
            unexplained.append(s["case"])
        else:
            out.append({"case": s["case"], "reason": rule["reason"], "evidence": rule["evidence"]})
    rep["miss_reasons"] = out
    return unexplained


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family", help=f"the record's family: {', '.join(sorted(SUMMARIES))} with a raw report; any "
                                   "family's record with --reasons alone")
    ap.add_argument("raw", type=Path, nargs="?", default=None,
                    help="the benchmark's JSON as the device run wrote it (omitted: --reasons updates the --out record)")
    ap.add_argument("--commit", default=None, help="commit of the measured tree (with the raw report)")
    ap.add_argument("--out", type=Path, required=True, help="reports/gpu/<platform>/<family>.json")
    ap.add_argument("--note", action="append", default=[], help="a sentence for the page (repeatable)")
    ap.add_argument("--command", default=None, help="the command the device ran (default: the raw report's)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the existing record's rows of the settings this run did not measure (e.g. the "
                         "training step and the eager rows when the run measured static-compiled generate only)")
    ap.add_argument("--reasons", type=Path, default=None,
                    help="JSON list of {cases, reason, evidence}: the measured reason of each missed point")
    a = ap.parse_args(argv)
    if a.out.stem != a.family:
        ap.error(f"--out: expected a file named {a.family}.json, got {a.out.name}")
    if a.merge and not a.out.exists():
        ap.error(f"--merge: {a.out} does not exist")
    if a.raw is None and (a.reasons is None or a.merge or a.note or a.command or a.commit or not a.out.exists()):
        ap.error("raw: expected the device run's JSON, or --reasons alone to update an existing --out record")
    if a.raw is not None and a.family not in SUMMARIES:
        ap.error(f"family: expected one of {', '.join(sorted(SUMMARIES))} with a raw report, got {a.family!r}")
    if a.raw is not None and not a.commit:
        ap.error("--commit: expected the measured tree's commit with a raw report")
    try:
        rules = load_rules(a.reasons) if a.reasons is not None else None
    except (OSError, ValueError) as exc:
        ap.error(f"--reasons: {exc}")
    if a.raw is None:
        rep = json.loads(a.out.read_text(encoding="utf-8"))
        if rep.get("family") != a.family:
            ap.error(f"--out: the record is of family {rep.get('family')!r}, not {a.family!r}")
    else:
        rep = record(a.family, json.loads(a.raw.read_text(encoding="utf-8")), commit=a.commit, out=a.out,
                     notes=a.note, command=a.command)
        if a.merge:
            rep = merge(rep, json.loads(a.out.read_text(encoding="utf-8")))
    if rules is not None:
        for case in attach_reasons(rep, rules):
            print(f"no reason for the missed point {case!r}")
    a.out.write_text(json.dumps(rep, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    met = [s["met"] for s in rep["summary"] if s["met"] is not None]
    print(f"wrote {a.out}: {len(rep['rows'])} rows, targets met {sum(met)} of {len(met)}, "
          f"{len(rep.get('miss_reasons', []))} misses with a reason")
    return 0


if __name__ == "__main__":
    sys.exit(main())
