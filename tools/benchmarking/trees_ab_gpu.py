"""Time one benchmark script from several source trees in alternating processes (A, B, A, B, ...).

A change is compared with its base on one machine in one sitting: the same benchmark script is
run once per tree per round, the trees alternating, each in its own process with its own tree
first on ``PYTHONPATH`` (and its own working directory), so that clock and thermal drift fall on
both sides alike. Each run writes ``<out-dir>/<stem>_<tree><round>.json``
(the script's ``--out``); the tool then prints one line per benchmark row (config, implementation)
with its median in every run, and writes them to ``<out-dir>/<stem>_ab.json``.

Trees are ``NAME=PATH``: a directory (``.`` for the working tree) or a ``.tgz`` / ``.tar.gz``
archive of one (``git archive BASE rl_engine benchmarks tools tests pyproject.toml | gzip``),
extracted under ``--work``. Rows are the benchmark harness's (``benchmarks/common/harness.py``:
``implementation``, ``config``, ``median``, ``unit``).

    python tools/benchmarking/trees_ab_gpu.py --tree base=.whl/base.tgz --tree new=. --rounds 2 \\
        --out-dir $OUT --site /tmp/w/site -- benchmarks/operators/bench_attention_gpu.py --kinds prefill --repeats 15

Exit status: 0 when every run wrote its rows, 1 when a run failed or timed out (its log is
``<out-dir>/<stem>_<tree><round>.log``; the others are still tabulated), 2 for bad arguments.

The parity gate on the public-API benchmark matrix (a verdict: no point more than 5 % slower than
the baseline, the same bits) is ``tools/benchmarking/matrix_gate_gpu.py``, built on this tool's
tree handling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path


def _parse_tree(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path or not name.replace("_", "").isalnum():
        raise ValueError(f"--tree: expected NAME=PATH with NAME letters, digits or _, got {spec!r}")
    return name, path


def _materialise(name: str, path: str, work: Path) -> Path:
    """The tree's directory: ``path`` itself, or the archive extracted into ``work/name``."""
    p = Path(path)
    if p.is_dir():
        return p.resolve()
    if p.is_file() and (p.name.endswith(".tgz") or p.name.endswith(".tar.gz")):
        dest = work / name
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(p) as tar:
            if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: refuse links and paths out of dest
                tar.extractall(dest, filter="data")
            else:
                tar.extractall(dest)
        return dest.resolve()
    raise ValueError(f"--tree {name}: expected a directory or a .tgz / .tar.gz archive, got {path!r}")


def _row_key(row: dict) -> str:
    config = row.get("config", {})
    return json.dumps(config, sort_keys=True) + " | " + str(row.get("implementation"))


def table(results: dict[str, Path]) -> list[dict]:
    """One entry per (config, implementation) seen in any run: ``{"config", "implementation",
    "unit", "medians": {run: median or None}}``, in first-seen order."""
    out: dict[str, dict] = {}
    for run, path in results.items():
        try:
            rows = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError):
            continue
        for r in rows:
            e = out.setdefault(_row_key(r), {"config": r.get("config", {}), "implementation": r.get("implementation"),
                                             "unit": r.get("unit"), "medians": {k: None for k in results}})
            e["medians"][run] = r.get("median")
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("trees_ab_gpu: expected '--' then the benchmark script and its arguments", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH (a directory or .tgz), two or more")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every tree, alternating (default 2)")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlk_trees_ab"), help="where archives are extracted")
    ap.add_argument("--site", action="append", default=[], help="extra PYTHONPATH entries after the tree (wheels)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for all runs; later runs get what is left")
    args = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd or not cmd[0].endswith(".py"):
        ap.error(f"after '--': expected a benchmark script (a .py path relative to each tree), got {cmd!r}")
    if "--out" in cmd:
        ap.error("after '--': leave out --out; the tool gives every run its own")
    if args.rounds < 1:
        ap.error(f"--rounds: expected a positive count, got {args.rounds}")
    try:
        trees = dict(_parse_tree(t) for t in args.tree)
    except ValueError as exc:
        ap.error(str(exc))
    if len(trees) < 2:
        ap.error(f"--tree: expected at least two trees with distinct names, got {sorted(trees)}")
    try:
        dirs = {n: _materialise(n, p, args.work) for n, p in trees.items()}
    except ValueError as exc:
        ap.error(str(exc))
    missing = [n for n, d in dirs.items() if not (d / cmd[0]).is_file()]
    if missing:
        ap.error(f"--tree: {cmd[0]} is missing from tree(s) {missing}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(cmd[0]).stem
    start = time.monotonic()
    results: dict[str, Path] = {}
    failed = []
    for rnd in range(1, args.rounds + 1):
        for name, d in dirs.items():
            run = f"{name}{rnd}"
            out, log = args.out_dir / f"{stem}_{run}.json", args.out_dir / f"{stem}_{run}.log"
            left = None if args.deadline is None else args.deadline - (time.monotonic() - start)
            if left is not None and left < 1:
                print(f"{run}: skipped, deadline reached", flush=True)
                failed.append(run)
                continue
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(d), *args.site]))
            t0 = time.monotonic()
            with log.open("w") as fh:
                try:
                    rc = subprocess.run([sys.executable, cmd[0], *cmd[1:], "--out", str(out.resolve())], cwd=d,
                                        env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=left).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            print(f"{run}: rc={rc} {time.monotonic() - t0:.0f} s", flush=True)
            results[run] = out
            if rc != 0 or not out.is_file():
                failed.append(run)
    rows = table(results)
    runs = list(results)
    print(f"{'config | implementation':70s} " + " ".join(f"{r:>10s}" for r in runs))
    for e in rows:
        label = (json.dumps(e["config"], sort_keys=True) + " | " + str(e["implementation"]))[:70]
        cells = " ".join(f"{e['medians'][r]:10.4g}" if e["medians"][r] is not None else f"{'-':>10s}" for r in runs)
        print(f"{label:70s} {cells}  {e['unit'] or ''}")
    summary = {"script": cmd, "trees": {n: str(p) for n, p in trees.items()}, "runs": runs, "failed": failed,
               "rows": rows}
    (args.out_dir / f"{stem}_ab.json").write_text(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
