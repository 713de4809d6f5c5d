"""Record parity-gate runs as ``reports/gpu/<platform>/matrix_gate.json``.

``tools/benchmarking/matrix_gate_gpu.py`` (the ``gate`` step of ``gpu_all_run.sh``) writes one
summary per device call. A gate that finds slower points is commonly followed by a second one on
those points over more alternating rounds (a one-round slowdown can be drift over the job). The
record keeps each summary under its name, in order, and one verdict for them together:

* **pass** when the last gate passes and every point that failed in a gate (``FAILING``: slower,
  bits, nondeterministic, error, missing) is measured again by a later gate and passes there;
* **fail** otherwise (a failing point no later gate re-measured, or one that fails again).

Every gate must compare the same baseline commit. The device and versions come from the run's
``env.txt`` (the driver writes it); the working tree's commit, which the device cannot read (its
copy has no ``.git``), is given with ``--new-commit``. Device-local paths are dropped.

    python tools/benchmarking/record_gate.py --gate quick_one_round=OUT1/bench_matrix_gate.json \\
        --gate slower_points_two_rounds=OUT2/bench_matrix_gate.json --env OUT1/env.txt --new-commit 1cbf85f \\
        --note "..." --note "..." --out reports/gpu/h200/matrix_gate.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matrix_gate_gpu import FAILING, SCRIPT  # noqa: E402 - the gate's statuses and its matrix script

TITLE = "Performance-parity gate: benchmark-matrix points under CUDA graphs, the working tree against a baseline revision"


def parse_env(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(device, versions)`` from the driver's ``env.txt``: the nvidia-smi CSV row after its
    header (name, driver) and the ``torch X cuda Y triton Z`` line (``ValueError`` naming what
    is missing)."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith("name, driver_version")), None)
    if header is None or header + 1 >= len(lines):
        raise ValueError("env: expected nvidia-smi's 'name, driver_version, ...' header and a row after it")
    name, driver = (f.strip() for f in lines[header + 1].split(",")[:2])
    m = re.search(r"^torch (\S+) cuda (\S+) triton (\S+)", text, re.MULTILINE)
    if m is None:
        raise ValueError("env: expected a 'torch X cuda Y triton Z' line")
    return {"name": name, "driver": driver}, {"torch": m.group(1), "cuda": m.group(2), "triton": m.group(3)}


def _key(p: dict[str, Any]) -> tuple:
    return p["family"], p["case"], p["mode"], p["implementation"]


def combined_verdict(gates: list[dict[str, Any]]) -> str:
    """``"pass"`` when the last gate passes and each failing point of a gate passes in a later
    gate that measured it again (module docstring); ``"fail"`` otherwise."""
    if not gates or gates[-1]["verdict"] != "pass":
        return "fail"
    for i, gate in enumerate(gates):
        for p in gate["points"]:
            if p["status"] not in FAILING:
                continue
            later = [q for g in gates[i + 1:] for q in g["points"] if _key(q) == _key(p)]
            if not later or later[-1]["status"] in FAILING:
                return "fail"
    return "pass"


def gate_entry(summary: dict[str, Any], new_commit: str) -> dict[str, Any]:
    """A gate summary as the record keeps it: no device-local paths (the runs' files, the
    script's absolute path), the working tree named by its commit."""
    out = {k: v for k, v in summary.items() if k != "runs_written"}
    script = list(summary["script"])
    if script and script[0].endswith(SCRIPT):
        script[0] = SCRIPT
    out["script"] = script
    trees = {n: dict(t) for n, t in summary["trees"].items()}
    for t in trees.values():
        if t.get("commit") is None:
            t.update(path=f"the working tree at {new_commit}", commit=new_commit)
    out["trees"] = trees
    return out


def record(named: list[tuple[str, dict[str, Any]]], *, new_commit: str, platform: str, device: dict[str, str],
           versions: dict[str, str], notes: list[str]) -> dict[str, Any]:
    """The record of the gates in ``named`` (``(name, summary)`` in run order); ``ValueError``
    when two gates compare different baseline commits or a name repeats."""
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(f"--gate: each gate needs its own name, got {names}")
    bases = {s["trees"]["base"]["commit"] for _, s in named}
    if len(bases) != 1:
        raise ValueError(f"--gate: the gates compare different baseline commits {sorted(map(str, bases))}")
    gates = {n: gate_entry(s, new_commit) for n, s in named}
    return {"schema_version": 1, "family": "matrix_gate", "platform": platform, "title": TITLE, "device": device,
            "versions": versions, "base": str(bases.pop())[:7], "new": new_commit,
            "verdict": combined_verdict(list(gates.values())), "notes": notes, "gates": gates}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gate", action="append", required=True, metavar="NAME=SUMMARY",
                    help="a gate's matrix_gate.json under a name, in run order (repeatable)")
    ap.add_argument("--env", type=Path, required=True, help="the driver's env.txt of the run")
    ap.add_argument("--new-commit", required=True, help="the commit of the working tree the gates measured")
    ap.add_argument("--note", action="append", default=[], help="a sentence for the record (repeatable)")
    ap.add_argument("--out", type=Path, required=True, help="reports/gpu/<platform>/matrix_gate.json")
    a = ap.parse_args(argv)
    if a.out.name != "matrix_gate.json":
        ap.error(f"--out: expected a file named matrix_gate.json, got {a.out.name}")
    named = []
    for item in a.gate:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            ap.error(f"--gate: expected NAME=SUMMARY, got {item!r}")
        named.append((name, json.loads(Path(path).read_text(encoding="utf-8"))))
    try:
        device, versions = parse_env(a.env.read_text(encoding="utf-8"))
        doc = record(named, new_commit=a.new_commit, platform=a.out.parent.name, device=device, versions=versions,
                     notes=a.note)
    except ValueError as exc:
        ap.error(str(exc))
    a.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {a.out}: verdict {doc['verdict']} over {len(named)} gates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
