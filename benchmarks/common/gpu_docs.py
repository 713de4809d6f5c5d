"""Generate ``docs/benchmarks/gpu.md`` (and one plot per family) from the GPU benchmarks of record.

::

    python -m benchmarks.common.gpu_docs            # rewrite the page and docs/benchmarks/img/*.png
    python -m benchmarks.common.gpu_docs --check    # exit 1 if the committed page is stale

Input: ``reports/gpu/<platform>/<family>.json``, one file per operator family and platform. Each
holds the exact ``command`` that produced it, ``device``, ``versions``, ``commit``, ``timestamp``,
the benchmark's ``rows`` as written, and a ``summary``: one entry per case with ``case``,
``metric``, ``achieved``, ``target`` (text; ``"(no target)"`` when the case is reported only)
and ``met`` (true / false / null). ``gpu_tests.json`` holds the GPU test-run summary (passed and
skipped per shard and per module) and the ``rlk check --device cuda`` results. ``matrix.json``,
when present, is the public-API benchmark matrix (``benchmarks/operators/bench_matrix_gpu.py``'s
report as written, optionally with ``miss_reasons``: ``[{"case", "reason", "evidence"}]`` naming
what the profiler showed for a missed point); it is rendered with its misses first. Another
family's record may carry ``miss_reasons`` too (``tools/benchmarking/record_gpu_report.py
--reasons``): its missed points are then listed under its table, each with its reason.

The page is text generated from those files and nothing else, so
``tests/benchmarks/test_gpu_docs.py`` regenerates it in memory and fails when the committed page
differs. The plots need matplotlib (the ``plots`` extra); the page links them by name.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "MATRIX", "load_reports", "render", "write_plots", "main"]

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "reports" / "gpu"
PAGE = ROOT / "docs" / "benchmarks" / "gpu.md"
IMG = ROOT / "docs" / "benchmarks" / "img"

#: family file stem -> section heading, in page order
FAMILIES: dict[str, str] = {
    "gemm": "GEMM (`gemm.linear`)",
    "gemm_small_m_sweep": "GEMM small-M tiles",
    "attention": "Attention",
    "logprob": "Fused LM head (`linear_token_logprobs`)",
    "rowwise": "Row-wise operators",
    "host_overhead": "Host time per eager call",
    "call_overhead": "Public-API call overhead",
    "moe": "Mixture of experts (`moe.route` + `moe.experts`)",
    "e2e_hf": "End to end: transformers Qwen3 at 8B dimensions",
}

#: the public-API benchmark matrix's file stem and section heading (rendered after the families)
MATRIX = ("matrix", "Benchmark matrix (public API)")
MATRIX_FAMILIES = {"gemm": "GEMM", "attention": "Attention, training prefill", "decode": "Attention, decode",
                   "lmhead": "Fused LM head"}

#: attention implementations as table columns (shipped paths first, then the ablations)
ATTENTION_COLUMNS: dict[str, str] = {
    "rlk.triton.blocked_online_softmax": "contiguous",
    "rlk.triton.blocked_online_softmax.paged16": "paged, 16-token pages",
    "rlk.triton.blocked_online_softmax.no_wgt": "contiguous, no transposed decode",
    "rlk.triton.blocked_online_softmax.paged16.no_wg": "paged, portable Triton only",
    "rlk.triton.blocked_online_softmax.paged16.no_wgt": "paged, no transposed decode",
    "rlk.triton.blocked_online_softmax.train_forward": "training forward",
}


def load_reports(reports: Path = REPORTS) -> dict[str, dict[str, dict[str, Any]]]:
    """``{platform: {family: report}}`` for every ``reports/gpu/<platform>/<family>.json``."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    known = {*FAMILIES, MATRIX[0], "gpu_tests"}
    for plat in sorted(p for p in reports.iterdir() if p.is_dir()):
        fams = {f.stem: json.loads(f.read_text(encoding="utf-8")) for f in sorted(plat.glob("*.json")) if f.stem in known}
        if fams:
            out[plat.name] = fams
    return out


def _num(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and abs(x) >= 100:
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}"
    return f"{x:.3f}" if isinstance(x, float) and abs(x) < 10 else str(x)


def _cell(entry: Mapping[str, Any]) -> str:
    """Achieved value: bold when it meets its target, marked ✗ when it misses it."""
    v = _num(entry["achieved"])
    if entry.get("met") is True:
        return f"**{v}**"
    if entry.get("met") is False:
        return f"{v} ✗"
    return v


def _met_count(summary: Sequence[Mapping[str, Any]]) -> str:
    judged = [s for s in summary if s.get("met") is not None]
    if not judged:
        return "Reported, no targets."
    return f"Targets met: **{sum(bool(s['met']) for s in judged)} of {len(judged)}**."


def _header(rep: Mapping[str, Any], path: str) -> list[str]:
    dev = rep["device"]
    vers = ", ".join(f"{k} {v}" for k, v in rep["versions"].items())
    lines = [rep["title"] + ".", "", "```", rep["command"], "```", "",
             "| | |", "|---|---|",
             f"| device | {dev['name']} ({dev['capability']}, {dev['sm_count']} SMs), driver {dev['driver']} |",
             f"| versions | {vers} |",
             f"| tree | commit `{rep['commit']}`, {rep['timestamp']} |",
             f"| data | `{path}` ({len(rep['rows'])} rows) |", ""]
    for note in rep.get("notes", []):
        lines += [f"* {note}"]
    if rep.get("notes"):
        lines.append("")
    return lines


def _summary_table(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["| case | metric | achieved | target |", "|---|---|---|---|"]
    for s in summary:
        extra = ""
        if "best_other" in s and s["best_other"]:
            extra = f" (best other: {s['best_other']['config']} {_num(s['best_other']['time_ratio'])})"
        if "max_us" in s:
            extra = f" (to {_num(s['max_us'])})"
        lines.append(f"| {s['case']} | {s['metric']} | {_cell(s)}{extra} | {s['target']} |")
    return lines


def _reason_text(r: Mapping[str, Any] | None, missing: str) -> str:
    """A ``miss_reasons`` entry as the page prints it: the reason, then its evidence in
    parentheses; ``missing`` when there is no entry."""
    if r is None:
        return missing
    return f"{r['reason']} ({r['evidence']})" if r.get("evidence") else r["reason"]


def _miss_lines(rep: Mapping[str, Any]) -> list[str]:
    """The family's missed points with their recorded reasons, for a record that carries
    ``miss_reasons`` (``tools/benchmarking/record_gpu_report.py --reasons``); none otherwise."""
    if "miss_reasons" not in rep:
        return []
    reasons = {r["case"]: r for r in rep["miss_reasons"]}
    missed = [s for s in rep["summary"] if s.get("met") is False]
    if not missed:
        return []
    lines = ["", "Misses and their measured reasons:", ""]
    for s in missed:
        r = reasons.get(s["case"])
        impl = f", {s['implementation']}" if s.get("implementation") else ""
        lines.append(f"* {s['case']}{impl} ({_num(s['achieved'])}, target {s['target']}): "
                     + _reason_text(r, "no reason recorded"))
    return lines


def _attention_table(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    cases: dict[str, dict[str, Mapping[str, Any]]] = {}
    for s in summary:
        cases.setdefault(s["case"], {})[s["implementation"]] = s
    cols = [c for c in ATTENTION_COLUMNS if any(c in row for row in cases.values())]
    target = next((s["target"] for s in summary if s.get("met") is not None), "")
    lines = [f"Throughput as a fraction of SDPA's; target {target} on the shipped paths (the first two "
             "columns); the other columns are ablations, reported only.", "",
             "| case | " + " | ".join(ATTENTION_COLUMNS[c] for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for case, row in cases.items():
        lines.append(f"| {case} | " + " | ".join(_cell(row[c]) if c in row else "—" for c in cols) + " |")
    return lines


def _miss_order(s: Mapping[str, Any]) -> tuple:
    """Misses first: points that could not run, then those beyond their family's limit, then by
    how far from the goal (``_score``, lowest first)."""
    score = _score(s)
    return (s.get("error") is None, s.get("within_limit") is not False, score if score is not None else 0.0)


def _score(s: Mapping[str, Any]) -> float | None:
    """Achieved as a fraction of the goal, >= 1 when met: goal / time ratio, throughput ratio / goal."""
    goal, achieved = s.get("goal"), s.get("achieved")
    if not goal or not achieved:
        return None
    return goal / achieved if s.get("ratio_metric") == "time_ratio" else achieved / goal


def _mcell(s: Mapping[str, Any]) -> str:
    """A matrix value: 3 decimals (1 from 10 up), bold when met, ✗ when missed, ``error`` for a
    point that could not run."""
    v = s.get("achieved")
    text = "error" if v is None and s.get("error") else "—" if v is None else f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return f"**{text}**" if s.get("met") is True else f"{text} ✗" if s.get("met") is False else text


def _matrix_section(rep: Mapping[str, Any], path: str, plat: str, images: bool) -> list[str]:
    """The matrix of record: counts, the misses (with the recorded reason), then every point per
    family with its graph and eager values side by side."""
    summary = rep["summary"]
    lines = [f"## {MATRIX[1]}", ""] + _header(rep, path)
    meta = rep.get("meta", {})
    if meta.get("stopped") or meta.get("partial"):
        why = (meta.get("stopped") or {}).get("reason", "the run ended early")
        lines += [f"The run measured {meta.get('points_done', '?')} of {meta.get('points', '?')} points ({why}).", ""]
    judged = [s for s in summary if s.get("met") is not None]
    by_mode = {}
    for s in judged:
        m = by_mode.setdefault(s.get("mode", "?"), [0, 0])
        m[0] += bool(s["met"])
        m[1] += 1
    modes = "; ".join(f"{mode}: {met} of {n}" for mode, (met, n) in sorted(by_mode.items()))
    over = sum(1 for s in judged if s.get("within_limit") is False)
    lines += [f"{_met_count(summary)[:-1]} ({modes}); beyond the family's limit: **{over}**. "
              "How to run it and the parity gate: [Benchmark matrix](matrix.md).", ""]
    reasons = {r["case"]: r for r in rep.get("miss_reasons", [])}
    misses = sorted((s for s in judged if not s["met"]), key=_miss_order)
    lines += ["### Misses", ""]
    if not misses:
        lines += ["None.", ""]
    else:
        lines += ["| case | achieved | target | reason |", "|---|---|---|---|"]
        for s in misses:
            r = reasons.get(s["case"])
            why = s.get("error") or _reason_text(r, "not yet profiled")
            lines.append(f"| {s['case']} | {_mcell(s)} | {s['target']} | {str(why).replace('|', '/')} |")
        lines.append("")
    points: dict[str, dict[str, dict[str, Mapping[str, Any]]]] = {}
    for s in summary:
        case = s["case"].rsplit(" [", 1)[0]
        points.setdefault(s.get("family", "?"), {}).setdefault(case, {})[s.get("mode", "?")] = s
    for fam, cases in points.items():
        lines += [f"### {MATRIX_FAMILIES.get(fam, fam)}", "", "| case | graph | eager | metric | target |",
                  "|---|---|---|---|---|"]
        for case, by in cases.items():
            any_s = next(iter(by.values()))
            cells = [_mcell(by[m]) if m in by else "—" for m in ("graph", "eager")]
            lines.append(f"| {case.split(': ', 1)[-1]} | {cells[0]} | {cells[1]} | {any_s['metric']} | {any_s['target']} |")
        lines.append("")
    if images:
        lines += [f"![matrix on {plat}](img/{plat}_{MATRIX[0]}.png)", ""]
    return lines


def _matrix_plot(plt, rep: Mapping[str, Any], plat: str, path: Path) -> None:
    """One dot per point and mode: achieved as a fraction of its goal (>= 1: met), per family."""
    colour = {True: "#2a7f3f", False: "#c0392b"}
    fams = list(MATRIX_FAMILIES)
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for s in rep["summary"]:
        score = _score(s)
        if score is None or s.get("family") not in fams:
            continue
        y = fams.index(s["family"]) + (0.15 if s.get("mode") == "eager" else -0.15)
        ax.scatter([score], [y], s=10, marker="o" if s.get("mode") == "graph" else "x", color=colour[bool(s.get("met"))])
    ax.set_yticks(range(len(fams)), [MATRIX_FAMILIES[f] for f in fams], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.6)
    ax.set_xlabel("achieved / goal (>= 1: target met); o graph, x eager", fontsize=8)
    ax.set_title(f"{MATRIX[1]} — {plat}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def _tests_section(rep: Mapping[str, Any], path: str) -> list[str]:
    dev = rep["device"]
    vers = ", ".join(f"{k} {v}" for k, v in rep["versions"].items())
    lines = ["## GPU test runs", "",
             f"Every `gpu`-marked test on {dev['name']} ({dev['capability']}), {vers}; data `{path}`. "
             "The suite runs in shards (one device call each); bounded-performance tests run alone after "
             "each shard, on an otherwise idle GPU.", "",
             "| shard | commit | passed | failed | skipped | seconds | bounded performance (passed / skipped) |",
             "|---|---|---|---|---|---|---|"]
    for sh in rep["shards"]:
        bp = sh.get("bounded_performance")  # a rerun of a few tests has no bounded-performance run
        passed = sh["tests"] - sh["failures"] - sh["errors"] - sh["skipped"]
        perf = (f"{bp['tests'] - bp['failures'] - bp['errors'] - bp['skipped']} / {bp['skipped']}" if bp
                else "not run")
        lines.append(f"| {sh['shard']} | `{sh['commit']}` | {passed} | {sh['failures'] + sh['errors']} | "
                     f"{sh['skipped']} | {sh['seconds']} | {perf} |")
    for sh in rep["shards"]:
        if sh.get("stopped"):
            lines += ["", f"Shard {sh['shard']} is partial: pytest's session time limit ended it ({sh['stopped']}) "
                      f"after {sh['tests']} tests; the tests it did not reach are in no count."]
        if sh.get("why"):
            lines += ["", f"Shard {sh['shard']}: {sh['failures'] + sh['errors']} failed ("
                      + ", ".join(f"`{n}`" for n in sh.get("failed", [])) + f"). {sh['why']}"]
    for note in rep.get("notes", []):
        lines += ["", note]
    lines += ["", "Tests per module:", "", "| module | shard | tests | skipped |", "|---|---|---|---|"]
    for sh in rep["shards"]:
        for mod, c in sh["modules"].items():
            lines.append(f"| `{mod}` | {sh['shard']} | {c['tests']} | {c['skipped']} |")
    if not rep.get("rlk_check"):
        return lines + ["", "`rlk check` on CUDA has no run of record on this platform."]
    lines += ["", "`rlk check` on CUDA (the trainer-side and generator-side log-probs of the tiny model, compared "
              "token by token):", "", "| command | compared tokens | mismatched | max abs diff | expected |",
              "|---|---|---|---|---|"]
    for c in rep["rlk_check"]:
        lines.append(f"| `{c['command']}` | {c['compared_tokens']} | {c['mismatched_tokens']} | "
                     f"{_num(c['max_abs_diff'])} | {c['expected']}{'' if check_as_expected(c) else ' ✗'} |")
    missed = [c for c in rep["rlk_check"] if not check_as_expected(c)]
    if missed:
        lines += ["", "✗: not the expected outcome — " + "; ".join(
            f"`{c['command']}`" + ("" if _expects_equal(c) else " (a negative control that found no mismatch "
                                   "cannot show, at that shape, that the check would catch one)")
            for c in missed) + "."]
    return lines


def check_as_expected(run: Mapping[str, Any]) -> bool:
    """Whether an ``rlk check`` run of record came out as its ``expected`` says: ``0 mismatches``
    for the rl-kernel plan, some mismatches for a negative control."""
    return (run["mismatched_tokens"] == 0) == _expects_equal(run)


def _expects_equal(run: Mapping[str, Any]) -> bool:
    """Whether the run is the rl-kernel plan (``expected`` as ``record_gpu_tests.py`` writes it)."""
    return run["expected"].startswith("0 mismatches")


def render(reports: Mapping[str, Mapping[str, Mapping[str, Any]]], *, images: bool = True) -> str:
    """The page's markdown, from ``load_reports()``'s value."""
    lines = ["# GPU benchmarks", "",
             "<!-- Generated by `python -m benchmarks.common.gpu_docs` from reports/gpu/*/*.json; "
             "do not edit by hand. tests/benchmarks/test_gpu_docs.py fails when this page is stale. -->", "",
             "Achieved against target for every GPU operator family, from one benchmark of record per family "
             "and platform under `reports/gpu/<platform>/`. Each file holds the exact command, the device, "
             "the software versions, the commit of the measured tree and every row the benchmark wrote. "
             "In the tables a value that meets its target is **bold**, one that misses it is marked ✗; "
             "the rest are reported without a target. Timings are medians of repeated CUDA-graph replays "
             "(host-synchronised wall time for the fused LM head and the host-time rows); points near "
             "1.0x move by a few percent between runs of the same code. How the public-API matrix and the "
             "parity gate run, and how a missed point's reason is recorded: [Benchmark matrix](matrix.md).", ""]
    for plat, fams in reports.items():
        lines += [f"Platform: **{plat}**.", ""]
        for fam, heading in FAMILIES.items():
            if fam not in fams:
                continue
            rep = fams[fam]
            path = f"reports/gpu/{plat}/{fam}.json"
            lines += [f"## {heading}", ""] + _header(rep, path)
            lines += [_met_count(rep["summary"]), ""]
            if fam == "attention":
                lines += _attention_table(rep["summary"])
            else:
                lines += _summary_table(rep["summary"])
            lines += _miss_lines(rep)
            lines.append("")
            if images:
                lines += [f"![{fam} on {plat}](img/{plat}_{fam}.png)", ""]
        if MATRIX[0] in fams:
            lines += _matrix_section(fams[MATRIX[0]], f"reports/gpu/{plat}/{MATRIX[0]}.json", plat, images) + [""]
        if "gpu_tests" in fams:
            lines += _tests_section(fams["gpu_tests"], f"reports/gpu/{plat}/gpu_tests.json") + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _plot_entries(fam: str, summary: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    if fam == "attention":
        keep = ("rlk.triton.blocked_online_softmax", "rlk.triton.blocked_online_softmax.paged16")
        return [{**s, "case": f"{s['case']} {'paged' if s['implementation'].endswith('paged16') else 'contig.'}"}
                for s in summary if s["implementation"] in keep]
    return [s for s in summary if s["metric"] != "MiB"]


def write_plots(reports: Mapping[str, Mapping[str, Mapping[str, Any]]], out: Path = IMG) -> list[Path]:
    """One horizontal bar chart per family: achieved per case, coloured by met / missed / no target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    colour = {True: "#2a7f3f", False: "#c0392b", None: "#7f8c8d"}
    for plat, fams in reports.items():
        for fam in FAMILIES:
            if fam not in fams:
                continue
            entries = _plot_entries(fam, fams[fam]["summary"])
            fig, ax = plt.subplots(figsize=(8, 0.26 * len(entries) + 1.2))
            y = range(len(entries))
            ax.barh(list(y), [e["achieved"] for e in entries], color=[colour[e.get("met")] for e in entries])
            ax.set_yticks(list(y), [e["case"] for e in entries], fontsize=7)
            ax.invert_yaxis()
            metrics = sorted({e["metric"] for e in entries})
            ax.set_xlabel("; ".join(metrics), fontsize=8)
            if fam in ("host_overhead", "call_overhead"):
                ax.set_xscale("log")
            else:
                ax.axvline(1.0, color="black", linewidth=0.6)
            ax.set_title(f"{FAMILIES[fam]} — {plat}".replace("`", ""), fontsize=9)
            fig.tight_layout()
            path = out / f"{plat}_{fam}.png"
            fig.savefig(path, dpi=90, metadata={"Software": None})
            plt.close(fig)
            written.append(path)
        if MATRIX[0] in fams:
            path = out / f"{plat}_{MATRIX[0]}.png"
            _matrix_plot(plt, fams[MATRIX[0]], plat, path)
            written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the committed page differs from the reports")
    p.add_argument("--no-plots", action="store_true", help="write the page only")
    args = p.parse_args(argv)
    reports = load_reports()
    text = render(reports)
    if args.check:
        same = PAGE.exists() and PAGE.read_text(encoding="utf-8") == text
        print(f"{PAGE.relative_to(ROOT)}: {'up to date' if same else 'stale: run python -m benchmarks.common.gpu_docs'}")
        return 0 if same else 1
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    if not args.no_plots:
        for path in write_plots(reports):
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
