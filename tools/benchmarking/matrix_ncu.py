"""Nsight Compute counters for the benchmark matrix's missed points: ours next to each baseline.

``--command`` prints the ncu command line that runs ``benchmarks/operators/bench_matrix_gpu.py
--profile`` over the selected points — by default the graph-mode misses of a matrix record
(``--record``), narrowed to ``--families`` — with ``--profile-from-start off --nvtx
--print-nvtx-rename kernel``: the benchmark calls ours and each baseline once per point between
``cudaProfilerStart``/``Stop`` inside an NVTX range ``"<case> | <side>"``, so every profiled
kernel comes out named by its point and side. The counters are those of
:data:`benchmarks.common.ncu.NCU_METRICS` (device time, SM / DRAM / tensor-pipe shares of peak,
occupancy, registers, warp stall reasons).

``--summary CSV [CSV ...] --out JSON`` reads ncu's ``--csv`` outputs and writes, per point and
side, every launch's counters and the side's device time; it prints one line per side: device
time, launches, and the longest launch's SM, DRAM and tensor-pipe shares, active warps,
registers per thread and its two largest stall reasons — what ``matrix_reasons.py --reasons``
cites as the measured reason of a miss. ``--reasons-out FILE --evidence PATH --device NAME``
writes those lines as that reasons file: one ``{cases, reason, evidence}`` entry per profiled
point (its graph row), the reason giving both sides' device time and launches and each side's
longest launch's counters.

``--within PATTERNS`` narrows the record's misses to the case labels that match one of the
comma-separated shell-style patterns (``"*M=256,*M=1024"``: the GEMM misses at two M values).
``--kernels REGEX`` profiles only the kernels whose function name matches: ncu fails on cuDNN's
fused SDPA kernel (``==ERROR== Failed to profile "cudnn_generated_fort_native_sdpa..."``) and then
writes no CSV at all, so the attention and decode families run with ``"rlk_|flash_fwd|..."`` and
their reasons give our side's counters alone.

A record (``reports/gpu/<platform>/matrix_ncu.json``) is a list of ``runs`` (sources, commit,
command, device, kernel pattern) and ``points`` (family, case, the run that profiled it, sides);
``--merge RECORD`` adds this summary's run to a record, its points replacing the record's of the
same family and case.

    eval "$(python3 tools/benchmarking/matrix_ncu.py --command --families gemm)" > gemm_ncu.csv
    python3 tools/benchmarking/matrix_ncu.py --summary gemm=gemm_ncu.csv --out matrix_ncu.json \\
        --commit "$(git rev-parse --short HEAD)" --device "NVIDIA H100 80GB HBM3" \\
        --reasons-out reasons.json --evidence reports/gpu/h100/matrix_ncu.json
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.ncu import NCU_METRICS, STALLS, read_launches  # noqa: E402

BENCH = "benchmarks/operators/bench_matrix_gpu.py"
SEP = " | "


def record_misses(record: dict, families: list[str] | None = None, mode: str = "graph") -> list[str]:
    """The case labels (``bench_matrix_gpu.py --cases`` patterns) of the record's points that miss
    their target in ``mode``, in the record's order, of ``families`` (all when None)."""
    out = []
    for s in record.get("summary", []):
        if s.get("mode") != mode or s.get("met") is not False or (families and s.get("family") not in families):
            continue
        case = s["case"]
        prefix, suffix = f"{s['family']}: ", f" [{mode}]"
        if case.startswith(prefix):
            case = case[len(prefix):]
        if case.endswith(suffix):
            case = case[: -len(suffix)]
        if case not in out:
            out.append(case)
    return out


def command(cases: list[str], metrics: str, families: list[str] | None, python: str,
            kernels: str | None = None) -> list[str]:
    """The ncu command line over ``bench_matrix_gpu.py --profile --cases ...``; ``kernels``, a
    regular expression on the kernel's function name, profiles only the launches it matches (ncu
    fails on some library kernels, such as cuDNN's fused SDPA, and then writes no CSV at all)."""
    cmd = ["ncu", "--target-processes", "all", "--profile-from-start", "off", "--clock-control", "none", "--nvtx",
           "--print-nvtx-rename", "kernel", "--csv", "--print-units", "base", "--metrics", metrics]
    if kernels:
        cmd += ["--kernel-name-base", "function", "--kernel-name", f"regex:{kernels}"]
    cmd += [python, BENCH, "--profile", "--cases", ",".join(cases)]
    if families:
        cmd += ["--families", ",".join(families)]
    return cmd


def summarize(parts: list[tuple[str | None, Path]]) -> dict:
    """Per point of each ``(family, csv)`` part, per side: launches (id, kernel, grid, block,
    counters) and the device time in µs; one run (``runs[0]``), its sources the CSVs.

    ncu renames a kernel ``"<case> | <side>/<kernel>"`` (the innermost NVTX range, then the
    kernel's own name). NVTX ranges belong to the thread that pushed them, so a backward's kernels
    — launched from autograd's device thread — come out unnamed; each profiled call runs alone
    between ``cudaProfilerStart`` and ``cudaProfilerStop``, so an unnamed launch belongs to the
    named launch before it in the same output (``"thread": "other"``). Unnamed launches before any
    named one stay ``unattributed``."""
    points: dict[tuple[str | None, str], dict] = {}
    unattributed: list[dict] = []
    for family, path in parts:
        current: tuple[str, str] | None = None
        for launch in read_launches(path):
            name = launch["kernel"] or ""
            thread = "range"
            if SEP in name:
                case, rest = name.rsplit(SEP, 1)
                side, _, kernel = rest.partition("/")
                current = (case, side)
            elif current is not None:
                (case, side), kernel, thread = current, name, "other"
            else:
                unattributed.append(dict(launch, run=0))
                continue
            entry = points.setdefault((family, case), {"case": case, "family": family, "run": 0, "sides": {}})
            s = entry["sides"].setdefault(side, {"launches": [], "device_us": 0.0})
            s["launches"].append({"id": launch["id"], "kernel": kernel, "thread": thread, "grid": launch["grid"],
                                  "block": launch["block"], "metrics": launch["metrics"]})
            t = launch["metrics"].get("gpu__time_duration.sum")
            if isinstance(t, float):
                s["device_us"] += t / 1000.0  # ncu's base unit: ns
    return {"schema_version": 2, "family": "matrix_ncu", "metrics": list(NCU_METRICS),
            "runs": [{"sources": [str(p) for _, p in parts]}], "points": list(points.values()), "unattributed": unattributed}


def merge(old: dict, new: dict) -> dict:
    """``new`` (one run) added to the record ``old``: ``old``'s points that ``new`` profiles again
    (same family and case) give way to ``new``'s; the others keep their own run. Runs keep their
    order, so a point's ``run`` index stays valid."""
    if old.get("schema_version") != 2 or not isinstance(old.get("runs"), list):
        raise ValueError("expected a matrix_ncu record of schema_version 2 (with 'runs')")
    if old.get("metrics") != new["metrics"]:
        raise ValueError("the record's metrics differ from this profile's: profile again with the record's --metrics")
    devices = {r.get("device") for r in old["runs"] + new["runs"] if r.get("device")}
    if len(devices) > 1:
        raise ValueError(f"one record per device: the runs name {sorted(devices)}")
    base = len(old["runs"])
    fresh = {(p["family"], p["case"]) for p in new["points"]}
    points = [p for p in old["points"] if (p["family"], p["case"]) not in fresh]
    points += [dict(p, run=p["run"] + base) for p in new["points"]]
    unattributed = old["unattributed"] + [dict(x, run=x["run"] + base) for x in new["unattributed"]]
    return dict(old, runs=old["runs"] + new["runs"], points=points, unattributed=unattributed)


#: the shares of peak a side's line gives, by the summary's short metric names
SHARES = {"sm": "sm__throughput%el", "dram": "dram__throughput%el", "tensor": "sm__pipe_tensor_cycles_active%act",
          "warps": "sm__warps_active%act"}


def longest_counters(s: dict) -> tuple[dict, dict[str, float | None], int | None, list[tuple[str, float]]]:
    """The side's launch of the longest device time, its shares of peak (``SHARES``; ``None``
    where ncu gave none), its registers per thread and its two largest stall reasons."""
    main = max(s["launches"], key=lambda x: x["metrics"].get("gpu__time_duration.sum") or 0.0)
    m = main["metrics"]
    shares = {k: (m.get(v) if isinstance(m.get(v), float) else None) for k, v in SHARES.items()}
    regs = m.get("launch__registers_per_thread")
    stalls = sorted(((m.get(f"stall_{k}"), k) for k in STALLS if isinstance(m.get(f"stall_{k}"), float)), reverse=True)
    return main, shares, int(regs) if isinstance(regs, float) else None, [(k, v) for v, k in stalls[:2]]


def side_line(side: str, s: dict) -> str:
    """One printed line: device time, launches and the longest launch's counters."""
    main, sh, regs, stalls = longest_counters(s)
    pct = {k: f"{v:5.1f}" if v is not None else "    -" for k, v in sh.items()}
    top = ", ".join(f"{k} {v:.2f}" for k, v in stalls)
    return (f"  {side:18s} {s['device_us']:9.1f} us  {len(s['launches']):2d} launches | longest {main['kernel'][:40]} "
            f"grid {main['grid']}: SM {pct['sm']}%  DRAM {pct['dram']}%  tensor {pct['tensor']}%  "
            f"warps {pct['warps']}%  regs {regs if regs is not None else '-'}  stalls: {top}")


def side_counters(s: dict) -> str:
    """The longest launch's counters of one side, as a reason's clause."""
    main, sh, regs, stalls = longest_counters(s)
    pct = {k: f"{v:.1f} %" if v is not None else "-" for k, v in sh.items()}
    top = ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in stalls) or "-"
    return (f"{kernel_label(main['kernel'])} grid {main['grid']}, SM {pct['sm']} of peak, DRAM {pct['dram']}, "
            f"tensor pipe {pct['tensor']} active, warps {pct['warps']} active, "
            f"{regs if regs is not None else '-'} registers, stalls per issue: {top}")


def kernel_label(name: str) -> str:
    """A kernel's name without its C++ template arguments and parameter list
    (``void cublasLt::splitKreduce_kernel<...>(...)`` -> ``cublasLt::splitKreduce_kernel``)."""
    name = name.split("(", 1)[0].split("<", 1)[0].strip()
    return name.removeprefix("void ").strip() or name


def kernels(s: dict) -> str:
    """A side's distinct kernels, in launch order."""
    return ", ".join(dict.fromkeys(kernel_label(x["kernel"]) for x in s["launches"]))


def reasons(rep: dict, evidence: str) -> list[dict[str, str]]:
    """``matrix_reasons.py --reasons`` entries for every point of the one-run summary ``rep`` with
    our side and at least one baseline (the graph row of ``<family>: <case>``); where the run
    profiled only some kernels (its ``kernels`` pattern) and no baseline launch matched, our side
    alone."""
    (run,) = rep["runs"]
    device, commit = run["device"], f", {run['commit']}" if run.get("commit") else ""
    out = []
    for point in rep["points"]:
        sides = point["sides"]
        if "ours" not in sides:
            continue
        ours = sides["ours"]
        cases = glob.escape(f"{point['family']}: {point['case']} [graph]")
        mine = f"ours {ours['device_us']:.1f} us in {len(ours['launches'])} launch(es) ({kernels(ours)})"
        if len(sides) < 2:
            if run.get("kernels"):
                out.append({"cases": cases,
                            "reason": (f"ncu on the {device}, profiling only the kernels whose name matches "
                                       f"{run['kernels']!r} (no baseline kernel matched): {mine}. Ours, longest "
                                       f"launch: {side_counters(ours)}."),
                            "evidence": f"{evidence} (ncu{commit}): ours {ours['device_us']:.1f} us"})
            continue
        base_name, base = min(((n, s) for n, s in sides.items() if n != "ours"), key=lambda x: x[1]["device_us"])
        text = (f"ncu on the {device}: {mine}, {base_name} {base['device_us']:.1f} us in {len(base['launches'])} "
                f"launch(es) ({kernels(base)}). Ours, longest launch: {side_counters(ours)}. {base_name}, longest "
                f"launch: {side_counters(base)}.")
        out.append({"cases": cases, "reason": text,
                    "evidence": f"{evidence} (ncu{commit}): {ours['device_us']:.1f} us vs {base['device_us']:.1f} us"})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--command", action="store_true", help="print the ncu command line and exit")
    ap.add_argument("--record", type=Path, default=Path("reports/gpu/h200/matrix.json"),
                    help="matrix record whose graph-mode misses are profiled (with --command)")
    ap.add_argument("--cases", default=None, help="comma-separated case patterns instead of the record's misses")
    ap.add_argument("--families", default=None, help="comma-separated families to keep (gemm, attention, decode, lmhead)")
    ap.add_argument("--within", default=None,
                    help="comma-separated shell-style patterns: keep the record's misses whose case matches one")
    ap.add_argument("--metrics", default=",".join(NCU_METRICS), help="ncu metrics (comma-separated)")
    ap.add_argument("--python", default=sys.executable, help="interpreter ncu launches")
    ap.add_argument("--kernels", default=None, metavar="REGEX",
                    help="profile only kernels whose function name matches REGEX (with --command); with --summary: "
                         "the REGEX the profile used, recorded, and points without a baseline launch get our side's reason")
    ap.add_argument("--summary", nargs="+", default=None, metavar="[FAMILY=]CSV",
                    help="ncu --csv outputs to summarise, each FAMILY=CSV or a CSV of --family's points")
    ap.add_argument("--out", type=Path, default=None, help="JSON summary (with --summary)")
    ap.add_argument("--merge", type=Path, default=None, metavar="RECORD",
                    help="with --summary --out: add this run to RECORD (a matrix_ncu record), whose points it does not "
                         "profile again keep their own run")
    ap.add_argument("--commit", default=None, help="the profiled tree's commit, recorded in the run")
    ap.add_argument("--run-command", default=None, help="the command that made the CSVs, recorded in the run")
    ap.add_argument("--reasons-out", type=Path, default=None,
                    help="with --summary: write matrix_reasons.py --reasons entries for the profiled points")
    ap.add_argument("--family", default=None, help="with --summary: the family of the points of a CSV given without FAMILY=")
    ap.add_argument("--evidence", default=None, help="with --reasons-out: where the summary is kept (the record)")
    ap.add_argument("--device", default=None, help="with --summary: the profiled device's name, recorded in the run")
    a = ap.parse_args(argv)
    families = [f for f in a.families.split(",") if f] if a.families else None
    if a.command == (a.summary is not None):
        ap.error("expected exactly one of --command and --summary")
    if a.within and (not a.command or a.cases):
        ap.error("--within: narrows the record's misses (with --command, without --cases)")
    if a.reasons_out is not None and (a.command or not (a.evidence and a.device)):
        ap.error("--reasons-out: with --summary, and --evidence and --device too")
    if a.merge is not None and (a.command or a.out is None):
        ap.error("--merge: with --summary and --out")
    if a.command:
        if a.cases:
            cases = [c for c in a.cases.split(",") if c]
        else:
            if not a.record.is_file():
                ap.error(f"--record: no such file {str(a.record)!r}")
            cases = record_misses(json.loads(a.record.read_text(encoding="utf-8")), families)
            if a.within:
                pats = [p for p in a.within.split(",") if p]
                cases = [c for c in cases if any(fnmatch.fnmatchcase(c, p) for p in pats)]
        if not cases:
            ap.error("no points to profile: the record has no graph-mode miss in these families (or --cases is empty)")
        print(shlex.join(command(cases, a.metrics, families, a.python, a.kernels)))
        return 0
    parts = []
    for item in a.summary:
        family, sep, path = item.partition("=")
        if not (sep and family.isidentifier()):  # a bare CSV path (which may itself hold '=')
            family, path = a.family, item
        if not family:
            ap.error(f"--summary: {item!r} names no family: give FAMILY=CSV, or --family")
        parts.append((family, Path(path)))
    missing = [str(p) for _, p in parts if not p.is_file()]
    if missing:
        ap.error(f"--summary: no such file {', '.join(missing)}")
    rep = summarize(parts)
    rep["runs"][0].update(commit=a.commit, command=a.run_command, device=a.device, kernels=a.kernels)
    for point in rep["points"]:
        print(point["case"])
        for side, s in point["sides"].items():
            print(side_line(side, s))
    if rep["unattributed"]:
        print(f"{len(rep['unattributed'])} launches before any '<case> | <side>' range (not attributed)")
    if not rep["points"] and not rep["unattributed"]:
        print("no ncu launches in " + ", ".join(map(str, a.summary)))
    if a.out is not None:
        record = rep
        if a.merge is not None:
            try:
                record = merge(json.loads(a.merge.read_text(encoding="utf-8")), rep)
            except (OSError, ValueError) as exc:
                ap.error(f"--merge: {exc}")
        a.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {a.out}: {len(record['points'])} points")
    if a.reasons_out is not None:
        rules = reasons(rep, a.evidence)
        a.reasons_out.write_text(json.dumps(rules, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {a.reasons_out}: {len(rules)} reasons")
    return 0 if rep["points"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
