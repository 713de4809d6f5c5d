"""Validation reports: schema-versioned JSON, a Markdown summary and PNG plots, in append-only
run directories.

A run directory (``<out>/<suite>-<UTC time>-<8 hex>/``) holds ``report.json``, ``summary.md``,
``plots/*.png`` and finally ``COMPLETE`` — written last, it lists the sha256 of every other
file, so a directory without it is an interrupted run and a changed file is detected. Files
are created exclusively (never overwritten); ``rlk report RUN_DIR`` verifies the seals and
renders again into a new ``rendered-<n>/`` sub-directory.

``report.json`` (schema :data:`SCHEMA_VERSION`): ``suite``, ``created_utc``, ``environment``
(platform, versions, threads), ``provenance`` (operators and implementations that ran, policy,
fallbacks), ``workload`` (name, version, sha256 of its file), ``options``, ``result``,
``passed`` (the verdict, ``result["passed"]``) and ``seals``: ``inputs_sha256`` (workload hash +
options), ``result_sha256`` (canonical JSON of ``result``) and ``report_sha256`` (canonical JSON
of every other top-level field, the verdict included).

:func:`verify_run` accepts a run only when all of these hold: ``COMPLETE`` is a JSON object
whose ``files`` maps **exactly** the files the run wrote (every file of the directory except
``COMPLETE`` and the ``rendered-<n>/`` renderings; ``report.json`` and ``summary.md`` among them)
to their sha256; every path is relative, inside the directory and reached without a symbolic
link; every file hashes to its entry; ``report.json`` has the current schema, its three seals
recompute and ``passed`` equals ``result["passed"]``. The seals are content hashes, not
signatures: they make an edit of any field or file, an emptied or partial manifest and a path
out of the directory detectable; someone who recomputes every hash after an edit is not
stopped (keep run directories where only the runner writes, or sign ``COMPLETE`` outside).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import platform as _py
import re
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["SCHEMA_VERSION", "ReportError", "SealError", "environment", "canonical_sha256", "build_report",
           "write_run", "verify_run", "render", "markdown"]

SCHEMA_VERSION = 2
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_RENDERED = re.compile(r"^rendered-[0-9]+$")
_REPORT_KEYS = ("schema_version", "suite", "created_utc", "environment", "provenance", "workload", "options", "result",
                "passed", "seals")


class ReportError(ValueError):
    """Not a run directory, an incomplete run, or a malformed report or manifest."""


class SealError(ReportError):
    """A run directory whose content does not match its seals (edited after the run)."""


def canonical_sha256(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def _report_sha256(report: dict[str, Any]) -> str:
    """The seal over every top-level field but ``seals`` (the verdict, the environment, ...)."""
    return canonical_sha256({k: v for k, v in report.items() if k != "seals"})


def environment(device: str = "cpu") -> dict[str, Any]:
    import torch

    from rl_engine import __version__
    from rl_engine.platforms import platform_of

    return {"rl_engine": __version__, "python": _py.python_version(), "torch": torch.__version__,
            "host": _py.machine(), "os": _py.platform(), "torch_threads": torch.get_num_threads(),
            "platform": platform_of(torch.empty(0, device=device)).as_dict()}


def build_report(suite: str, result: dict[str, Any], workload_header: dict[str, Any], options: dict[str, Any],
                 device: str, provenance: dict[str, Any]) -> dict[str, Any]:
    report = {
        "schema_version": SCHEMA_VERSION,
        "suite": suite,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(device),
        "provenance": provenance,
        "workload": workload_header,
        "options": options,
        "result": result,
        "passed": bool(result.get("passed")),
    }
    # the report is sealed as it will be read back from report.json (JSON, default=str)
    report = json.loads(json.dumps(report, default=str))
    report["seals"] = {"inputs_sha256": canonical_sha256({"workload": report["workload"]["sha256"],
                                                          "options": report["options"]}),
                       "result_sha256": canonical_sha256(report["result"]),
                       "report_sha256": _report_sha256(report)}
    return report


def _write_new(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "xb") as f:  # exclusive: a run directory is append-only
        f.write(data)


def _sha_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def check_out_dir(out: str | Path) -> Path:
    """``out`` can receive a run directory: it is (or can be created as) a writable directory.

    Raises:
        ReportError: ``out`` is a file, cannot be created, or is not writable (``--out: ...``).
    """
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise ReportError(f"--out: {str(path)!r} exists and is not a directory") from exc
    except OSError as exc:
        raise ReportError(f"--out: cannot create directory {str(path)!r}: {exc.strerror or exc}") from exc
    if not path.is_dir():
        raise ReportError(f"--out: {str(path)!r} is not a directory")
    probe = path / f".rlk-write-test-{os.urandom(4).hex()}"
    try:
        with open(probe, "xb"):
            pass
        probe.unlink()
    except OSError as exc:
        raise ReportError(f"--out: directory {str(path)!r} is not writable: {exc.strerror or exc}") from exc
    return path


def _run_files(run: Path) -> list[Path]:
    """The files the run wrote: everything but COMPLETE and the rendered-<n>/ renderings."""
    out = []
    for p in run.rglob("*"):
        rel = p.relative_to(run)
        if rel.parts[0] == "COMPLETE" or _RENDERED.match(rel.parts[0]):
            continue
        if p.is_file() or p.is_symlink():
            out.append(p)
    return sorted(out)


def write_run(out: str | Path, report: dict[str, Any]) -> Path:
    """Create a new run directory under ``out`` with the report, summary, plots and COMPLETE."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run = Path(out) / f"{report['suite']}-{stamp}-{os.urandom(4).hex()}"
    run.mkdir(parents=True, exist_ok=False)
    _write_new(run / "report.json", (json.dumps(report, indent=2, sort_keys=True, default=str) + "\n").encode())
    render(run, dest=run, verify=False)
    files = _run_files(run)
    complete = {"schema_version": SCHEMA_VERSION, "files": {p.relative_to(run).as_posix(): _sha_file(p) for p in files}}
    _write_new(run / "COMPLETE", (json.dumps(complete, indent=2, sort_keys=True) + "\n").encode())
    return run


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{what}: not readable as JSON ({exc})") from exc


def _manifest_path(run: Path, rel: object) -> Path:
    """A manifest entry as a path inside ``run`` (relative, no ``..``, no symbolic link on the way)."""
    if not isinstance(rel, str) or not rel:
        raise ReportError(f"COMPLETE: expected file paths as non-empty strings, got {rel!r}")
    pp = PurePosixPath(rel)
    if pp.is_absolute() or "\\" in rel or ".." in pp.parts or "." in rel.split("/") or rel != pp.as_posix():
        raise SealError(f"seal: COMPLETE names {rel!r}, a path outside the run directory (expected a relative path "
                        "inside it, without '..')")
    p = run
    for part in pp.parts:
        p = p / part
        if p.is_symlink():
            raise SealError(f"seal: COMPLETE names {rel!r}, which goes through the symbolic link "
                            f"{p.relative_to(run).as_posix()!r} (a run directory holds no links)")
    if not p.resolve().is_relative_to(run.resolve()):
        raise SealError(f"seal: COMPLETE names {rel!r}, a path outside the run directory")
    return p


def verify_run(run: str | Path) -> dict[str, Any]:
    """Check the COMPLETE marker and every seal; returns the report.

    Raises:
        SealError: a file changed, added or removed after the run, a manifest that is empty,
            partial or names a path outside the directory, a report field that no longer matches
            its seal (``seal: ...``).
        ReportError: not a run directory, an interrupted run (no COMPLETE), a malformed
            COMPLETE or report.json.
    """
    run = Path(run)
    if not (run / "report.json").is_file():
        raise ReportError(f"run_dir: {str(run)!r} has no report.json (not a validation run directory)")
    if not (run / "COMPLETE").is_file():
        raise ReportError(f"run_dir: {str(run)!r} has no COMPLETE marker (the run was interrupted)")
    complete = _read_json(run / "COMPLETE", "COMPLETE")
    if not isinstance(complete, dict) or not isinstance(complete.get("files"), dict):
        raise ReportError("COMPLETE: expected a JSON object with a 'files' object (path -> sha256)")
    if complete.get("schema_version") != SCHEMA_VERSION:
        raise ReportError(f"COMPLETE: schema_version {complete.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    listed = complete["files"]
    for rel, sha in listed.items():
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise ReportError(f"COMPLETE: expected a sha256 (64 lowercase hex digits) for {rel!r}, got {sha!r}")
    paths = {rel: _manifest_path(run, rel) for rel in listed}
    for required in ("report.json", "summary.md"):
        if required not in listed:
            raise SealError(f"seal: COMPLETE does not list {required} (an empty or partial manifest)")
    for p in _run_files(run):
        rel = p.relative_to(run).as_posix()
        if p.is_symlink():
            raise SealError(f"seal: {rel} is a symbolic link (a run directory holds no links)")
        if rel not in listed:
            raise SealError(f"seal: {rel} is not listed in COMPLETE (added after the run, or a partial manifest)")
    for rel, sha in listed.items():
        p = paths[rel]
        if not p.is_file() or _sha_file(p) != sha:
            raise SealError(f"seal: {rel} was changed or removed after the run completed")
    report = _read_json(run / "report.json", "report.json")
    if not isinstance(report, dict):
        raise ReportError("report.json: expected a JSON object")
    if report.get("schema_version") != SCHEMA_VERSION:
        raise ReportError(f"report.json: schema_version {report.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    missing = [k for k in _REPORT_KEYS if k not in report]
    extra = sorted(set(report) - set(_REPORT_KEYS))
    if missing or extra:
        raise ReportError(f"report.json: expected the fields {list(_REPORT_KEYS)}, missing {missing}, unexpected {extra}")
    seals, result, workload = report["seals"], report["result"], report["workload"]
    if not isinstance(seals, dict) or set(seals) != {"inputs_sha256", "result_sha256", "report_sha256"}:
        raise ReportError("report.json: expected seals with inputs_sha256, result_sha256 and report_sha256")
    if not isinstance(result, dict) or not isinstance(workload, dict) or "sha256" not in workload:
        raise ReportError("report.json: expected result and workload objects (workload with its sha256)")
    if canonical_sha256(result) != seals["result_sha256"]:
        raise SealError("seal: result_sha256 does not match the result")
    if canonical_sha256({"workload": workload["sha256"], "options": report["options"]}) != seals["inputs_sha256"]:
        raise SealError("seal: inputs_sha256 does not match the workload and options")
    if _report_sha256(report) != seals["report_sha256"]:
        raise SealError("seal: report_sha256 does not match the report's fields (suite, verdict, environment, ...)")
    if report["passed"] is not bool(result.get("passed")):
        raise SealError(f"seal: passed={report['passed']!r} disagrees with result.passed={result.get('passed')!r}")
    return report


# --- Markdown -------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "0" if v == 0 else (f"{v:.3e}" if math.isfinite(v) else str(v))
    return str(v)


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_fmt(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out + [""]


def markdown(report: dict[str, Any], plots: list[str]) -> str:
    r = report["result"]
    s = report["suite"]
    env = report["environment"]
    title = f"rlk debug: {r['outcome']}" if s == "debug" else f"rlk validate {s}: {'PASS' if report['passed'] else 'FAIL'}"
    lines = [f"# {title}", "",
             f"- workload: {report['workload']['name']} v{report['workload']['version']} (sha256 {report['workload']['sha256'][:16]}…)",
             f"- created: {report['created_utc']}; rl_engine {env['rl_engine']}, torch {env['torch']}, "
             f"platform {env['platform'].get('key', env['platform'].get('family'))}, threads {env['torch_threads']}",
             f"- seals: inputs {report['seals']['inputs_sha256'][:16]}…, result {report['seals']['result_sha256'][:16]}…", ""]
    if s == "ws1":
        lines += [f"Cells: {r['counts']['green']} green, {r['counts']['red']} red, {r['counts']['n.a.']} n.a.", ""]
        lines += _table(["operator", "implementation", "dtype", "check", "status", "detail"],
                        [[c["op"], c["impl"], c["dtype"], c["check"], c["status"], c["detail"]] for c in r["cells"]])
    elif s == "chain":
        lines += _table(["cell", "layout", "compared", "mismatched", "max |Δ|", "result"],
                        [[c["cell"], c["layout"], c["compared_tokens"], c["mismatched_tokens"], c["max_abs_diff"],
                          "bitwise equal" if c["passed"] else "MISMATCH"] for c in r["cells"]])
        g = r.get("gradient_invariance")
        if g:
            lines += ["Gradient invariance (per-token gradient w.r.t. the embedding output, raw bits):", ""]
            lines += _table(["layout", "against", "tokens", "equal", "max |Δ|"],
                            [[c["layout"], c["against"], c["tokens"], c["equal"], c["max_abs_diff"]] for c in g["comparisons"]])
        lines += [f"Totals: {r['compared_tokens']} tokens compared, {r['mismatched_tokens']} mismatched (plan {r['plan']}).", ""]
    elif s == "ablation":
        lines += _table(["plan", "compared", "mismatched", "max |Δ|", "bitwise equal"],
                        [[k, v["compared_tokens"], v["mismatched_tokens"], v["max_abs_diff"], v["passed"]] for k, v in r["runs"].items()])
        a = r["attribution"]
        lines += [f"**Drift attributed to:** {', '.join(a['modules']) or 'none'} ({a['basis']}).", ""]
    elif s == "ws2":
        rv = r["reference_vs_rollout"]
        lines += [f"TP {r['tp']} × DP {r['dp']} on {r['world']} gloo ranks; {r['samples']} samples, one micro-batch each; "
                  f"every layout against one process (reference vs rollout: {rv['mismatched']} of {rv['compared']} "
                  "log-probs differ).", ""]

        def first(f):
            if not f:
                return "none"
            return f"layer {f['layer']} {f['stage']}" + (f", sample {f['sample']} position {f['position']}" if "sample" in f else "")

        lines += _table(["layout", "log-probs", "mismatched", "vs rollout", "stages equal", "first divergence",
                         "gradients differing", "result"],
                        [[x["layout"], x["logprobs"]["compared"], x["logprobs"]["mismatched"],
                          x["logprobs_vs_rollout"]["mismatched"], f"{sum(y['equal'] for y in x['stages'])}/{len(x['stages'])}",
                          first(x["first_divergence"]), len(x["gradients"]["mismatched"]),
                          "bitwise equal" if x["passed"] else "MISMATCH"] for x in r["layouts"]])
    elif s == "cross-config":
        lines += _table(["knob", "value", "status", "expected", "tokens", "max |Δ log p|"],
                        [[x["knob"], x["value"], x["status"], x["expect"], x["tokens"], x.get("max_abs_diff", 0.0)] for x in r["results"]])
    elif s == "debug":
        lines += [f"Sample {r['sample']}: {r['side_a']['path']} {r['side_a']['plan']} vs {r['side_b']['path']} {r['side_b']['plan']}: "
                  f"**{r['outcome']}**" + (f" ({r['reason']})" if r.get("reason") else ""), ""]
        f = r.get("first_divergence")
        if f:
            lines += [f"First divergence: layer {f['layer']}, stage `{f['stage']}`, token position {f['position']}, "
                      f"feature {f['feature']}: {f['side_a']!r} ({f['side_a_bits']}) vs {f['side_b']!r} ({f['side_b_bits']})", ""]
            if "experts_a" in f:
                lines += [f"Routing: token position {f['position']} chose experts {f['experts_a']} on side A and "
                          f"{f['experts_b']} on side B (rank order).", ""]
        lines += _table(["layer", "stage", "tokens", "equal", "max |Δ|"],
                        [[x["layer"], x["stage"], x["tokens"], x["equal"], x["max_abs_diff"]] for x in r["stages"]])
    controls = r.get("negative_controls")
    if controls:
        lines += ["Negative controls (must be detected):", ""]
        lines += _table(["control", "detected"], [[c["name"], "n.a." if c["detected"] is None else c["detected"]]
                                                  for c in controls])
    for p in plots:
        lines += [f"![{Path(p).stem}]({p})", ""]
    return "\n".join(lines)


# --- plots ----------------------------------------------------------------------------------------
def _plots(report: dict[str, Any], dest: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    r, s = report["result"], report["suite"]
    made: list[str] = []

    def save(fig, name: str) -> None:
        p = dest / "plots" / f"{name}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "xb") as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        made.append(f"plots/{name}.png")

    floor = 1e-12
    if s == "debug" and r["stages"]:
        fig, ax = plt.subplots(figsize=(10, 4.2))
        labels = [("emb" if x["stage"] == "embedding" else f"L{x['layer']}.{x['stage']}" if x["layer"] >= 0 else x["stage"])
                  for x in r["stages"]]
        ys = [max(x["max_abs_diff"], floor) for x in r["stages"]]
        colors = ["tab:green" if x["equal"] else "tab:red" for x in r["stages"]]
        ax.plot(range(len(ys)), ys, color="0.6", lw=1, zorder=1)
        ax.scatter(range(len(ys)), ys, c=colors, zorder=2)
        f = r.get("first_divergence")
        if f:
            k = next(i for i, x in enumerate(r["stages"]) if x["layer"] == f["layer"] and x["stage"] == f["stage"])
            ax.axvline(k, color="tab:red", ls="--", lw=1)
            ax.annotate(f"first divergence\nlayer {f['layer']} {f['stage']}, token {f['position']}",
                        (k, ys[k]), textcoords="offset points", xytext=(8, 10), fontsize=8, color="tab:red")
        ax.set_yscale("log")
        ax.set_ylim(floor / 3, max(max(ys) * 10, 1e-6))
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=70, fontsize=7)
        ax.set_ylabel(f"max |Δ| over tokens (equal shown at {floor:g})")
        ax.set_title(f"rlk debug: sample {r['sample']}, {r['side_a']['path']} {r['side_a']['plan']} vs "
                     f"{r['side_b']['path']} {r['side_b']['plan']} — {r['outcome']}")
        ax.grid(True, axis="y", alpha=0.3)
        save(fig, "debug_per_layer_max_abs_diff")
    if s == "cross-config":
        rows = [x for x in r["results"] if x.get("abs_diff")]
        fig, ax = plt.subplots(figsize=(10, 4.2))
        for i, x in enumerate(rows):
            ys = [max(v, floor) for v in x["abs_diff"]]
            col = {"PASS": "tab:green", "FAIL": "tab:red", "INVALID": "tab:gray"}.get(x["status"], "tab:orange")
            ax.scatter([i + (j / max(len(ys), 1) - 0.5) * 0.6 for j in range(len(ys))], ys, s=10, color=col,
                       label=x["status"] if x["status"] not in [y["status"] for y in rows[:i]] else None)
        ax.set_yscale("log")
        ax.set_ylim(floor / 3, 1.0)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([f"{x['knob']}\n{x['value']}" for x in rows], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(f"per-token |Δ log p| vs baseline (equal shown at {floor:g})")
        ax.set_title("rlk validate cross-config: one knob at a time, frozen inputs")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        save(fig, "cross_config_per_token_abs_dlogp")
    if s == "ws1":
        cells = [c for c in r["cells"] if c["check"] != "all"]
        rows_ = sorted({(c["op"], c["impl"], c["dtype"]) for c in cells})
        checks = ["forward_accuracy", "gradient_accuracy", "forward_invariance", "gradient_invariance"]
        code = {"green": 0, "red": 1, "n.a.": 2}
        grid = [[2] * len(checks) for _ in rows_]
        for c in cells:
            grid[rows_.index((c["op"], c["impl"], c["dtype"]))][checks.index(c["check"])] = code[c["status"]]
        from matplotlib.colors import ListedColormap

        fig, ax = plt.subplots(figsize=(7, 0.28 * len(rows_) + 1.5))
        ax.imshow(grid, cmap=ListedColormap(["#3a3", "#d33", "#bbb"]), vmin=0, vmax=2, aspect="auto")
        ax.set_xticks(range(len(checks)))
        ax.set_xticklabels([c.replace("_", "\n") for c in checks], fontsize=8)
        ax.set_yticks(range(len(rows_)))
        ax.set_yticklabels([f"{o} [{i}, {d}]" for o, i, d in rows_], fontsize=7)
        ax.set_title(f"WS1 operator matrix: {r['counts']['green']} green, {r['counts']['red']} red (grey: n.a.)")
        save(fig, "ws1_matrix")
    if s in ("chain", "ablation"):
        items = ([(c["cell"], c["mismatched_tokens"], c["compared_tokens"]) for c in r["cells"]] if s == "chain"
                 else [(k, v["mismatched_tokens"], v["compared_tokens"]) for k, v in r["runs"].items()])
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.bar(range(len(items)), [m for _, m, _ in items], color=["tab:green" if m == 0 else "tab:red" for _, m, _ in items])
        ax.bar(range(len(items)), [n for _, _, n in items], color="none", edgecolor="0.5")
        for i, (_, m, n) in enumerate(items):
            ax.annotate(f"{m}/{n}", (i, n), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7,
                        color="tab:green" if m == 0 else "tab:red")
        ax.set_xticks(range(len(items)))
        ax.set_xticklabels([n for n, _, _ in items], rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("mismatched tokens (outline: compared)")
        ax.set_title(f"rlk validate {s}" + (f": drift attributed to {', '.join(r['attribution']['modules']) or 'none'}"
                                             if s == "ablation" else ": raw-bit mismatches per cell"))
        save(fig, f"{s}_mismatches")
    return made


def render(run: str | Path, dest: str | Path | None = None, *, verify: bool = True) -> Path:
    """Write ``summary.md`` and the plots of a run into ``dest`` (default: a new ``rendered-<n>/``)."""
    run = Path(run)
    report = verify_run(run) if verify else json.loads((run / "report.json").read_text())
    if dest is None:
        n = 1
        while (run / f"rendered-{n}").exists():
            n += 1
        dest = run / f"rendered-{n}"
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    plots = _plots(report, dest)
    _write_new(dest / "summary.md", markdown(report, plots).encode())
    return dest
