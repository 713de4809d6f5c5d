"""Give each missed point of a benchmark-matrix report its measured reason, and write the record.

``benchmarks/operators/bench_matrix_gpu.py`` writes a complete report (command, device, versions,
summary, rows); the record ``reports/gpu/<platform>/matrix.json`` adds ``miss_reasons`` —
``[{"case", "reason", "evidence"}]``, which the generated page prints next to each miss — and
``notes``. A reason comes from, in this order:

1. ``--reasons FILE``: a JSON list of ``{"cases": PATTERN, "reason": TEXT, "evidence": TEXT}``,
   ``PATTERN`` a shell-style pattern on the case label (``"lmhead: * fwd_bwd *"``); the first
   pattern that matches a missed case gives its reason. This is where a profile's finding goes
   (the counters that explain a kernel's miss, the peak memory of a point), with the file that
   holds the measurement as evidence;
2. ``--keep-from RECORD``: the reason an earlier record gave the same case, when that reason came
   from a reasons file (``"source": "profile"``);
3. for an eager point, its graph twin in the same report: when the graph row meets its target
   the eager miss is host time (the per-call launch cost, ``--host-evidence``); when the graph
   row misses too, the kernel misses and the eager call adds the host cost.

A miss with none of these is left without a reason (the page says "not yet profiled").

``--carry RECORD`` keeps an earlier record's points that none of the raw parts measures (its
summary entries and rows, and their profiled reasons), for a run that measures only some families
again: the earlier record must be of the same platform, device and versions; its points keep
their own commit, which the record names in ``meta.carried`` and in a note the page prints.

The full matrix takes more than one device call, so it runs family by family
(``MATRIX_ARGS="--families decode,lmhead"``, then the others); several raw reports given together
are merged into one record: they must share the platform, the measured commit, the device and
the versions, and no case may appear in two of them. The record's command lists each part's, and
``meta.parts`` keeps each part's own meta.

    python tools/benchmarking/matrix_reasons.py OUT/bench_matrix_gpu.json --out reports/gpu/h200/matrix.json \\
        --reasons reasons.json --keep-from reports/gpu/h200/matrix.json --note "..."
    python tools/benchmarking/matrix_reasons.py decode_lmhead.json attention.json gemm.json --out ... --keep-from ...
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path
from typing import Any

HOST_REASON = ("host-bound: the graph row of this point meets its target, so the eager call's extra time is the "
               "host's per-call cost (Triton's Python launch path and the entry point's checks)")
KERNEL_REASON = "the kernel misses under CUDA graphs too (the graph row), and the eager call adds the host's per-call cost"


def _twin(case: str) -> str | None:
    return case[: -len("[eager]")] + "[graph]" if case.endswith("[eager]") else None


def load_rules(path: Path) -> list[dict[str, str]]:
    """The reasons file, validated: a list of objects with non-empty ``cases``, ``reason`` and ``evidence``."""
    rules = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(rules, list):
        raise ValueError(f"{path}: expected a JSON list of {{cases, reason, evidence}} objects")
    for i, r in enumerate(rules):
        if not isinstance(r, dict) or set(r) != {"cases", "reason", "evidence"} or not all(
                isinstance(r[k], str) and r[k].strip() for k in r):
            raise ValueError(f"{path}: entry {i}: expected exactly non-empty 'cases', 'reason' and 'evidence' strings, "
                             f"got {r!r}")
    return rules


def rule_for(case: str, rules: list[dict[str, str]]) -> dict[str, str] | None:
    """The first rule whose ``cases`` pattern (shell-style) matches ``case``, or None."""
    return next((r for r in rules if fnmatch.fnmatchcase(case, r["cases"])), None)


def miss_reasons(report: dict[str, Any], rules: list[dict[str, str]], kept: dict[str, dict[str, Any]],
                 host_evidence: str) -> list[dict[str, Any]]:
    """One entry per missed point that has a reason (module docstring), in the summary's order."""
    by_case = {s["case"]: s for s in report["summary"]}
    out = []
    for s in report["summary"]:
        if s.get("met") is not False:
            continue
        case = s["case"]
        rule = rule_for(case, rules)
        if rule is not None:
            out.append({"case": case, "reason": rule["reason"], "evidence": rule["evidence"], "source": "profile"})
            continue
        if case in kept:
            out.append(dict(kept[case]))
            continue
        twin = by_case.get(_twin(case) or "")
        if twin is not None and twin.get("met") is True:
            out.append({"case": case, "reason": HOST_REASON, "evidence": f"the graph row; {host_evidence}",
                        "source": "graph twin"})
        elif twin is not None and twin.get("met") is False:
            out.append({"case": case, "reason": KERNEL_REASON, "evidence": "the graph row", "source": "graph twin"})
    return out


#: what every part of a merged record must share
SHARED = ("family", "platform", "commit", "device", "versions")


def merge_reports(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from the raw reports of disjoint parts of the matrix, measured at one commit on
    one device with one set of versions (``ValueError`` naming the field or the case otherwise).

    Summary entries and rows keep their parts' order; ``command`` joins the parts' commands with
    ``" ; "``, ``timestamp`` is the latest, and ``meta`` adds up the points and keeps each part's
    meta under ``parts``."""
    if not parts:
        raise ValueError("expected at least one raw report")
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        for key in SHARED:
            if part.get(key) != first.get(key):
                raise ValueError(f"raw report {i}: {key} {part.get(key)!r} differs from the first report's "
                                 f"{first.get(key)!r}; a merged record is one commit on one device")
    seen: dict[str, int] = {}
    for i, part in enumerate(parts):
        for s in part["summary"]:
            if s["case"] in seen:
                raise ValueError(f"case {s['case']!r} is in raw reports {seen[s['case']]} and {i}: the parts must "
                                 "be disjoint")
            seen[s["case"]] = i
    merged = dict(first)
    merged["summary"] = [s for part in parts for s in part["summary"]]
    merged["rows"] = [r for part in parts for r in part["rows"]]
    merged["command"] = " ; ".join(part["command"] for part in parts)
    merged["timestamp"] = max(part["timestamp"] for part in parts)
    metas = [part.get("meta", {}) for part in parts]
    merged["meta"] = {
        "partial": any(m.get("partial") for m in metas),
        "stopped": next((m["stopped"] for m in metas if m.get("stopped")), None),
        "points": sum(m.get("points", 0) for m in metas),
        "points_done": sum(m.get("points_done", 0) for m in metas),
        "elapsed_s": sum(m.get("elapsed_s", 0.0) for m in metas),
        "parts": metas,
    }
    return merged


#: what a carried record must share with the new parts (its commit may be an earlier one)
CARRY_SHARED = ("family", "platform", "device", "versions")


def row_label(row: dict[str, Any]) -> str | None:
    """The summary label of a report row: ``"<family>: <case> [<mode>]"`` (a row holds its family,
    case and mode apart; one without them is labelled by its ``case``)."""
    if "family" in row and "mode" in row and "case" in row:
        return f"{row['family']}: {row['case']} [{row['mode']}]"
    return row.get("case")


def _origins(old: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``commit -> {command, timestamp}`` of every run whose points ``old`` holds: its own and those
    it carried (``meta.carried``: one origin, or a list of them)."""
    out = {old["commit"]: {"command": old["command"], "timestamp": old["timestamp"]}}
    carried = old.get("meta", {}).get("carried") or []
    for c in [carried] if isinstance(carried, dict) else carried:
        out[c["commit"]] = {"command": c["command"], "timestamp": c["timestamp"]}
    return out


def carry_over(report: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """``report`` with the points of the earlier record ``old`` that it does not measure: their
    summary entries, each stamped ``measured_at`` (the commit of the run that measured it: ``old``'s
    own for its unstamped entries, kept where ``old`` carried it from an earlier run), and rows
    appended; ``meta.carried`` has one entry per such run (commit, command, timestamp, the carried
    cases' count and families). Nothing carried: ``report`` unchanged.

    Raises:
        ValueError: ``old`` is of another platform, device or versions (naming the field), or it
            carries points of several runs without stamping which run measured each.
    """
    for key in CARRY_SHARED:
        if old.get(key) != report.get(key):
            raise ValueError(f"{key} {old.get(key)!r} differs from the raw reports' {report.get(key)!r}; only "
                             "points of the same platform, device and versions carry over")
    measured = {s["case"] for s in report["summary"]}
    summary = [s for s in old["summary"] if s["case"] not in measured]
    if not summary:
        return report
    origins = _origins(old)
    legacy = old.get("meta", {}).get("carried")
    if isinstance(legacy, dict) and not any("measured_at" in s for s in old["summary"]):
        # a record without measured_at stamps: its own and its carried entries look alike
        raise ValueError(f"the earlier record carries points of {sorted(origins)} but its summary entries do not say "
                         "which run measured each (measured_at)")
    summary = [dict(s, measured_at=s.get("measured_at", old["commit"])) for s in summary]
    unknown = sorted({s["measured_at"] for s in summary} - set(origins))
    if unknown:
        raise ValueError(f"summary entries measured at {unknown}, a run the earlier record does not name")
    cases = {s["case"] for s in summary}
    out = dict(report)
    out["summary"] = report["summary"] + summary
    out["rows"] = report["rows"] + [r for r in old["rows"] if row_label(r) in cases]
    carried = []
    for commit in dict.fromkeys(s["measured_at"] for s in summary):
        mine = [s for s in summary if s["measured_at"] == commit]
        carried.append(dict(commit=commit, **origins[commit], points=len(mine),
                            families=sorted({s["case"].split(":", 1)[0] for s in mine})))  # "decode: ..." -> decode
    out["meta"] = dict(report.get("meta", {}), carried=carried)
    return out


def carried_notes(report: dict[str, Any]) -> list[str]:
    """The page's sentences on the carried points, one per run they come from."""
    carried = report.get("meta", {}).get("carried") or []
    return [(f"{c['points']} points of the {', '.join(c['families'])} famil{'y' if len(c['families']) == 1 else 'ies'} "
             f"are carried over from the run at {c['commit']} ({c['timestamp']}), not measured again at "
             f"{report['commit']}.") for c in ([carried] if isinstance(carried, dict) else carried)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path, nargs="+",
                    help="bench_matrix_gpu.py's report as the device run wrote it; several: disjoint parts, merged")
    ap.add_argument("--out", type=Path, required=True, help="reports/gpu/<platform>/matrix.json")
    ap.add_argument("--reasons", type=Path, default=None, help="JSON list of {cases, reason, evidence}")
    ap.add_argument("--keep-from", type=Path, default=None, help="an earlier record whose profiled reasons carry over")
    ap.add_argument("--host-evidence", default=None,
                    help="where the host cost is measured (default: reports/gpu/<platform>/host_overhead.json)")
    ap.add_argument("--note", action="append", default=[], help="a sentence for the page (repeatable)")
    ap.add_argument("--carry", type=Path, default=None,
                    help="an earlier record whose points the raw parts do not measure are kept, at their commit")
    a = ap.parse_args(argv)
    if a.out.name != "matrix.json":
        ap.error(f"--out: expected a file named matrix.json, got {a.out.name}")
    parts = []
    for raw in a.raw:
        part = json.loads(raw.read_text(encoding="utf-8"))
        if part.get("family") != "matrix" or "summary" not in part:
            ap.error(f"raw: {raw} is not a benchmark-matrix report (family {part.get('family')!r})")
        parts.append(part)
    try:
        report = merge_reports(parts)
    except ValueError as exc:
        ap.error(f"raw: {exc}")
    try:
        rules = load_rules(a.reasons) if a.reasons else []
    except (ValueError, json.JSONDecodeError) as exc:
        ap.error(f"--reasons: {exc}")
    earlier = {name: json.loads(path.read_text(encoding="utf-8"))
               for name, path in (("keep_from", a.keep_from), ("carry", a.carry)) if path is not None}
    kept = {r["case"]: r for old in earlier.values() for r in old.get("miss_reasons", [])
            if r.get("source") == "profile"}
    if "carry" in earlier:
        try:
            report = carry_over(report, earlier["carry"])
        except ValueError as exc:
            ap.error(f"--carry: {exc}")
    host = a.host_evidence or f"reports/gpu/{report['platform']}/host_overhead.json"
    report["miss_reasons"] = miss_reasons(report, rules, kept, host)
    report["notes"] = list(a.note) + carried_notes(report)
    a.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    misses = sum(1 for s in report["summary"] if s.get("met") is False)
    print(f"wrote {a.out}: {misses} misses, {len(report['miss_reasons'])} with a reason")
    return 0


if __name__ == "__main__":
    sys.exit(main())
