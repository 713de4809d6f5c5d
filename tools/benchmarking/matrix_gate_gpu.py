"""Parity gate: the benchmark matrix of a change against its baseline revision, in one GPU job.

The matrix (``benchmarks/operators/bench_matrix_gpu.py`` of the ``--new`` tree, so both sides run
the same points and the same harness) runs once per tree per round, each run in its own process
importing ``rl_engine`` from its tree (``--impl-root``); the trees alternate and the order flips
every round (base, new, new, base, ...), so clock and thermal drift over the job fall on both
sides alike. Then every point of ours (rows ``role == "ours"``) is compared:

* **slower**: the median over the rounds of the new tree's per-run medians is more than
  ``--tolerance`` (default 5 %) above the baseline's (``--metric ratio``: the same on each run's
  ratio to its in-run baseline — cuBLAS, SDPA, ... — which cancels drift between processes);
* **bits**: the output's bits digest differs from the baseline's, or between rounds of one tree
  (**nondeterministic**);
* **error**: the point failed in the new tree (a point that fails in both is reported as
  ``unsupported``, one that fails in the baseline only as ``base-error``; neither is gated);
  **missing**: a point not measured by every run (a run cut short, or a point the new tree no
  longer has).

Any of these makes the exit status 1, except a **slower** point that ``--accept PATTERN=REASON``
names (``PATTERN``, a regular expression, is found in its label ``family: case [mode]``): a
reviewed trade — time given for something the point's
target also counts, such as peak memory — reported as ``accepted`` with the reason in the
summary; bits, errors and missing runs are never accepted. Points whose rows carry a peak memory
also report its change (``peak_change``). A summary table is printed and written, with every
run's report, to ``--out-dir`` (``matrix_gate.json``; runs ``matrix_<tree><round>.json`` and
``.log``).

Trees are ``NAME=PATH``: a directory (``.`` for the working tree) or a ``.tgz`` of one, such as
``git archive --format=tar.gz -o .whl/base.tgz BASE rl_engine`` (only ``rl_engine`` is read from
the baseline; the commit recorded in the archive is reported).

    python tools/benchmarking/matrix_gate_gpu.py --base base=.whl/base.tgz --new new=. --rounds 2 \\
        --out-dir $OUT/gate -- --quick --modes graph
    # judge runs made earlier (no GPU): the same comparison on existing reports
    python tools/benchmarking/matrix_gate_gpu.py --base-runs b1.json b2.json --new-runs n1.json n2.json --out-dir d

Exit status: 0 when every point passes, 1 when a point fails or a run failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trees_ab_gpu import _materialise, _parse_tree  # noqa: E402 - the A/B tool's tree handling

SCRIPT = "benchmarks/operators/bench_matrix_gpu.py"
TOLERANCE = 0.05
FAILING = ("slower", "bits", "nondeterministic", "error", "missing")

Key = tuple[str, str, str, str]


def _key(row: Mapping[str, Any]) -> Key:
    return (str(row.get("family")), str(row.get("case")), str(row.get("mode")), str(row.get("implementation")))


def ours_rows(report: Mapping[str, Any]) -> dict[Key, Mapping[str, Any]]:
    """The report's rows of ours, by (family, case, mode, implementation)."""
    return {_key(r): r for r in report.get("rows", []) if r.get("role") == "ours"}


def _value(row: Mapping[str, Any], metric: str) -> float | None:
    v = row.get("median") if metric == "time" else row.get("ratio_vs_baseline")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def judge_point(base: Sequence[Mapping[str, Any] | None], new: Sequence[Mapping[str, Any] | None], *,
                tolerance: float, metric: str) -> dict[str, Any]:
    """One point's verdict from its row in each base run and each new run (None where a run
    lacks it): ``status`` (the first failing reason, or ``ok`` / ``unsupported`` / ``new`` /
    ``base-error``, which pass),
    every reason, the medians over rounds and the change."""
    out: dict[str, Any] = {"base": None, "new": None, "change": None, "base_bits": None, "new_bits": None,
                           "peak_change": None, "reasons": []}
    reasons: list[tuple[str, str]] = []
    if all(r is None for r in base) and all(r is not None for r in new):
        out["status"] = "new"  # a point the baseline does not have: not gated
        out["reasons"] = ["not in the baseline's matrix"]
        return out
    absent = [f"base{i + 1}" for i, r in enumerate(base) if r is None] + [f"new{i + 1}" for i, r in enumerate(new) if r is None]
    if absent:
        reasons.append(("missing", f"not measured by run(s) {', '.join(absent)}"))
    b = [r for r in base if r is not None]
    n = [r for r in new if r is not None]
    b_err = [r["error"] for r in b if r.get("error")]
    n_err = [r["error"] for r in n if r.get("error")]
    if n_err and b and len(b_err) == len(b):
        out["status"] = "unsupported"
        out["reasons"] = [f"fails in both trees: {n_err[0]}"]
        return out
    if n_err:
        reasons.append(("error", f"fails in the new tree: {n_err[0]}"))
    b_ok = [r for r in b if not r.get("error")]
    n_ok = [r for r in n if not r.get("error")]
    if b_err and not b_ok and not reasons:
        # the change runs a point its baseline cannot: nothing to compare, nothing regressed
        out["status"] = "base-error"
        out["reasons"] = [f"fails in the baseline only, not compared: {b_err[0]}"]
        out["new_bits"] = ",".join(sorted({str(r.get("bits")) for r in n_ok})) or None
        return out
    b_bits = sorted({str(r.get("bits")) for r in b_ok})
    n_bits = sorted({str(r.get("bits")) for r in n_ok})
    out["base_bits"], out["new_bits"] = ",".join(b_bits) or None, ",".join(n_bits) or None
    if len(n_bits) > 1:
        reasons.append(("nondeterministic", f"the new tree's rounds give different bits: {n_bits}"))
    if len(b_bits) > 1:
        reasons.append(("nondeterministic", f"the baseline's rounds give different bits: {b_bits}"))
    if len(b_bits) == 1 and len(n_bits) == 1 and b_bits != n_bits:
        reasons.append(("bits", f"bits differ: base {b_bits[0]}, new {n_bits[0]}"))
    bv = [v for v in (_value(r, metric) for r in b_ok) if v is not None]
    nv = [v for v in (_value(r, metric) for r in n_ok) if v is not None]
    if bv and nv:
        out["base"], out["new"] = statistics.median(bv), statistics.median(nv)
        out["change"] = out["new"] / out["base"] - 1.0
        if out["change"] > tolerance:
            reasons.append(("slower", f"{100 * out['change']:+.1f} % ({metric}), more than {100 * tolerance:g} %"))
    elif b_ok and n_ok:
        reasons.append(("missing", f"no {metric} value to compare"))
    bp = [float(r["peak_memory_bytes"]) for r in b_ok if isinstance(r.get("peak_memory_bytes"), (int, float))]
    np_ = [float(r["peak_memory_bytes"]) for r in n_ok if isinstance(r.get("peak_memory_bytes"), (int, float))]
    if bp and np_ and statistics.median(bp) > 0:
        out["peak_change"] = statistics.median(np_) / statistics.median(bp) - 1.0
    out["status"] = reasons[0][0] if reasons else "ok"
    out["reasons"] = [text for _, text in reasons]
    out["kinds"] = [kind for kind, _ in reasons]
    return out


def compile_accept(accept: Mapping[str, str]) -> dict[re.Pattern, str]:
    """``{pattern: reason}`` → ``{compiled pattern: reason}``; ``ValueError`` for an empty pattern
    or reason, or a pattern that is not a regular expression."""
    compiled = {}
    for pattern, reason in accept.items():
        if not pattern or not reason:
            raise ValueError(f"accept: expected a non-empty pattern and reason, got {pattern!r}={reason!r}")
        try:
            compiled[re.compile(pattern)] = reason
        except re.error as exc:
            raise ValueError(f"accept: {pattern!r} is not a regular expression: {exc}") from None
    return compiled


def compare(base_runs: Sequence[Mapping[str, Any]], new_runs: Sequence[Mapping[str, Any]], *,
            tolerance: float = TOLERANCE, metric: str = "time",
            accept: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The gate's verdict on matrix reports: every point of ours in any run, judged by
    :func:`judge_point`; ``verdict`` is ``fail`` when any point's status is failing or a side
    has no run. ``accept``: ``{pattern: reason}``; a point failing only as ``slower`` whose label
    ``family: case [mode]`` a pattern (a regular expression) is found in is ``accepted`` instead,
    the reason added to its reasons."""
    if metric not in ("time", "ratio"):
        raise ValueError(f"metric: expected 'time' or 'ratio', got {metric!r}")
    accept = dict(accept or {})
    compiled = compile_accept(accept)
    base = [ours_rows(r) for r in base_runs]
    new = [ours_rows(r) for r in new_runs]
    keys: dict[Key, None] = {}
    for rows in (*new, *base):
        keys.update(dict.fromkeys(rows))
    points = []
    for k in keys:
        v = judge_point([r.get(k) for r in base], [r.get(k) for r in new], tolerance=tolerance, metric=metric)
        kinds = v.pop("kinds", [])
        why = [reason for pattern, reason in compiled.items() if pattern.search(f"{k[0]}: {k[1]} [{k[2]}]")]
        if why and kinds and set(kinds) == {"slower"}:
            v["status"] = "accepted"
            v["reasons"] = [*v["reasons"], f"accepted: {why[0]}"]
        points.append({"family": k[0], "case": k[1], "mode": k[2], "implementation": k[3], **v})
    counts: dict[str, int] = {}
    for p in points:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    failed = [p for p in points if p["status"] in FAILING]
    verdict = "fail" if failed or not base_runs or not new_runs or not points else "pass"
    order = {s: i for i, s in enumerate(FAILING)}
    points.sort(key=lambda p: (order.get(p["status"], len(FAILING)), -(p["change"] or 0.0)))
    return {"verdict": verdict, "tolerance": tolerance, "metric": metric, "accepted": accept, "counts": counts,
            "runs": {"base": len(base_runs), "new": len(new_runs)}, "points": points}


def table(result: Mapping[str, Any], limit: int | None = None) -> str:
    """The summary as text: one line per point, failing ones first."""
    unit = "ms" if result["metric"] == "time" else "x"
    lines = [f"{'status':16s} {'family':9s} {'mode':5s} {'base ' + unit:>10s} {'new ' + unit:>10s} {'change':>8s}  case"]
    pts = result["points"] if limit is None else result["points"][:limit]
    for p in pts:
        num = lambda v: f"{v:10.4g}" if isinstance(v, float) else f"{'-':>10s}"  # noqa: E731
        change = f"{100 * p['change']:+7.1f}%" if p["change"] is not None else f"{'-':>8s}"
        peak = f"  peak memory {100 * p['peak_change']:+.1f}%" if p.get("peak_change") is not None else ""
        lines.append(f"{p['status']:16s} {p['family']:9s} {p['mode']:5s} {num(p['base'])} {num(p['new'])} {change}  "
                     f"{p['case']}{peak}" + (f"  [{'; '.join(p['reasons'])}]" if p["reasons"] else ""))
    if limit is not None and len(result["points"]) > limit:
        lines.append(f"... {len(result['points']) - limit} more in the summary JSON")
    counts = ", ".join(f"{k} {v}" for k, v in sorted(result["counts"].items()))
    lines.append(f"verdict: {result['verdict'].upper()} ({counts}; tolerance {100 * result['tolerance']:g} % on "
                 f"{result['metric']}; {result['runs']['base']} base and {result['runs']['new']} new runs)")
    return "\n".join(lines)


def _load(paths: Sequence[Path]) -> tuple[list[dict], list[str]]:
    reports, bad = [], []
    for p in paths:
        try:
            reports.append(json.loads(Path(p).read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            bad.append(f"{p}: {exc}")
    return reports, bad


def _archive_commit(path: str) -> str | None:
    """The commit ``git archive`` recorded in a tarball (its pax comment), or None."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        with tarfile.open(p) as tar:
            tar.next()
            commit = tar.pax_headers.get("comment")
    except (OSError, tarfile.TarError):
        return None
    return commit[:12] if commit else None


def _finish(result: dict[str, Any], out_dir: Path, extra: Mapping[str, Any]) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {**extra, **result}
    (out_dir / "matrix_gate.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(table(result, limit=200))
    print(f"wrote {out_dir / 'matrix_gate.json'}")
    return 0 if result["verdict"] == "pass" else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="NAME=PATH of the baseline tree (a directory or a .tgz)")
    ap.add_argument("--new", default="new=.", help="NAME=PATH of the tree under test (default new=.)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternating (default 2)")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlk_matrix_gate"), help="where archives are extracted")
    ap.add_argument("--site", action="append", default=[], help="extra PYTHONPATH entries (wheels)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for all runs; later runs get what is left")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="allowed slowdown (default 0.05: 5 %%)")
    ap.add_argument("--metric", choices=("time", "ratio"), default="time",
                    help="time: medians in ms; ratio: each run's ratio to its in-run baseline")
    ap.add_argument("--script", default=None, help=f"the matrix script (default: the new tree's {SCRIPT})")
    ap.add_argument("--base-runs", nargs="+", type=Path, default=None, help="judge these baseline reports (no runs)")
    ap.add_argument("--new-runs", nargs="+", type=Path, default=None, help="... against these reports of the change")
    ap.add_argument("--accept", action="append", default=[], metavar="PATTERN=REASON",
                    help="a slower point whose label 'family: case [mode]' matches the regular expression PATTERN "
                         "passes as 'accepted', REASON in the summary (a reviewed trade, e.g. time for peak memory); "
                         "repeatable")
    args = ap.parse_args(argv[:cut])
    matrix_args = argv[cut + 1:]
    accept: dict[str, str] = {}
    for item in args.accept:
        pattern, sep, reason = item.partition("=")
        if not sep or not pattern.strip() or not reason.strip():
            ap.error(f"--accept: expected PATTERN=REASON, both non-empty, got {item!r}")
        accept[pattern.strip()] = reason.strip()
    try:
        compile_accept(accept)  # before any run: a bad pattern must not waste the GPU job
    except ValueError as exc:
        ap.error(str(exc))
    if not 0 <= args.tolerance < 1:
        ap.error(f"--tolerance: expected a fraction in [0, 1), got {args.tolerance}")
    if (args.base_runs is None) != (args.new_runs is None):
        ap.error("--base-runs and --new-runs: expected both (judge existing reports) or neither")
    if args.base_runs is not None:
        if args.base or matrix_args:
            ap.error("--base-runs: judges existing reports; leave out --base and the matrix arguments")
        base, bad_b = _load(args.base_runs)
        new, bad_n = _load(args.new_runs)
        for b in bad_b + bad_n:
            print(f"unreadable report: {b}", file=sys.stderr)
        result = compare(base, new, tolerance=args.tolerance, metric=args.metric, accept=accept)
        if bad_b or bad_n:
            result["verdict"] = "fail"
        return _finish(result, args.out_dir, {"base_runs": [str(p) for p in args.base_runs],
                                              "new_runs": [str(p) for p in args.new_runs], "failed_runs": bad_b + bad_n})
    if not args.base:
        ap.error("--base: expected NAME=PATH of the baseline tree (or --base-runs/--new-runs)")
    if "--" not in argv:
        ap.error("expected '--' then the matrix arguments (e.g. -- --quick --modes graph)")
    if any(a in ("--out", "--impl-root", "--commit") or a.startswith(("--out=", "--impl-root=", "--commit="))
           for a in matrix_args):
        ap.error("after '--': leave out --out, --impl-root and --commit; the gate sets them for every run")
    if args.rounds < 1:
        ap.error(f"--rounds: expected a positive count, got {args.rounds}")
    try:
        trees = dict(_parse_tree(t) for t in (args.base, args.new))
    except ValueError as exc:
        ap.error(str(exc))
    if len(trees) != 2:
        ap.error("--base, --new: expected two trees with distinct names")
    (base_name, base_path), (new_name, new_path) = _parse_tree(args.base), _parse_tree(args.new)
    try:
        dirs = {n: _materialise(n, p, args.work) for n, p in trees.items()}
    except ValueError as exc:
        ap.error(str(exc))
    missing = [n for n, d in dirs.items() if not (d / "rl_engine" / "__init__.py").is_file()]
    if missing:
        ap.error(f"--base/--new: no rl_engine/ in tree(s) {missing}")
    script = Path(args.script) if args.script else dirs[new_name] / SCRIPT
    if not script.is_file():
        ap.error(f"--script: {script} is not a file")
    commits = {base_name: _archive_commit(base_path), new_name: _archive_commit(new_path)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*args.site, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    start = time.monotonic()
    outs: dict[str, list[Path]] = {base_name: [], new_name: []}
    failed: list[str] = []
    for rnd in range(1, args.rounds + 1):
        order = [base_name, new_name] if rnd % 2 else [new_name, base_name]
        for name in order:
            run = f"{name}{rnd}"
            out, log = args.out_dir / f"matrix_{run}.json", args.out_dir / f"matrix_{run}.log"
            left = None if args.deadline is None else args.deadline - (time.monotonic() - start)
            if left is not None and left < 1:
                print(f"{run}: skipped, deadline reached", flush=True)
                failed.append(run)
                continue
            cmd = [sys.executable, str(script), *matrix_args, "--impl-root", str(dirs[name]), "--out", str(out.resolve())]
            if commits[name]:
                cmd += ["--commit", commits[name]]
            t0 = time.monotonic()
            with log.open("w") as fh:
                try:
                    rc = subprocess.run(cmd, cwd=dirs[new_name], env=env, stdout=fh,
                                        stderr=subprocess.STDOUT, timeout=left).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            print(f"{run}: rc={rc} {time.monotonic() - t0:.0f} s", flush=True)
            if out.is_file():
                outs[name].append(out)
            if rc != 0 or not out.is_file():
                failed.append(run)
    base, bad_b = _load(outs[base_name])
    new, bad_n = _load(outs[new_name])
    result = compare(base, new, tolerance=args.tolerance, metric=args.metric, accept=accept)
    if failed or bad_b or bad_n:
        result["verdict"] = "fail"
    extra = {"script": [str(script), *matrix_args], "trees": {n: {"path": p, "commit": commits[n]} for n, p in trees.items()},
             "runs_written": {n: [str(p) for p in ps] for n, ps in outs.items()}, "failed_runs": failed + bad_b + bad_n,
             "seconds": round(time.monotonic() - start, 1)}
    if failed:
        print(f"failed runs: {failed} (logs in {args.out_dir})")
    return _finish(result, args.out_dir, extra)


if __name__ == "__main__":
    raise SystemExit(main())
