"""``tools/benchmarking/trees_ab_gpu.py`` on the CPU: it runs a benchmark script from each tree in
alternating processes (each tree first on ``PYTHONPATH``, an archive extracted), tabulates every
run's medians by (config, implementation), reports a failing run, and refuses bad arguments by
name."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "benchmarking" / "trees_ab_gpu.py"

# a harness-shaped benchmark whose median comes from the tree's own module (so the run used its
# tree), and which appends its tree's name to a shared order file
BENCH = """
import argparse, json, os, pathlib, treeval
ap = argparse.ArgumentParser(); ap.add_argument("--out"); ap.add_argument("--size", type=int, default=1)
a = ap.parse_args()
with open(os.environ["AB_ORDER"], "a") as f:
    f.write(treeval.NAME + "\\n")
if treeval.NAME == "broken":
    raise SystemExit(3)
rows = [{"implementation": "impl", "config": {"size": a.size}, "unit": "ms", "median": treeval.MEDIAN}]
pathlib.Path(a.out).write_text(json.dumps({"rows": rows}))
"""


def make_tree(root: Path, name: str, median: float) -> Path:
    (root / "bench").mkdir(parents=True)
    (root / "bench" / "b.py").write_text(BENCH)
    (root / "treeval.py").write_text(f"NAME = {name!r}\nMEDIAN = {median}\n")
    return root


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "", "AB_ORDER": str(tmp_path / "order.txt")}
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120, env=env)


def test_runs_alternate_and_rows_are_tabulated(tmp_path):
    base = make_tree(tmp_path / "base_src", "base", 2.0)
    archive = tmp_path / "base.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(base, arcname=".")
    new = make_tree(tmp_path / "new", "new", 1.5)
    out = tmp_path / "out"
    r = run(tmp_path, "--tree", f"base={archive}", "--tree", f"new={new}", "--rounds", "2", "--out-dir", str(out),
            "--work", str(tmp_path / "work"), "--", "bench/b.py", "--size", "7")
    assert r.returncode == 0, r.stderr + r.stdout
    assert (tmp_path / "order.txt").read_text().split() == ["base", "new", "base", "new"]
    summary = json.loads((out / "b_ab.json").read_text())
    assert summary["runs"] == ["base1", "new1", "base2", "new2"] and summary["failed"] == []
    (row,) = summary["rows"]
    assert row["config"] == {"size": 7} and row["implementation"] == "impl"
    assert row["medians"] == {"base1": 2.0, "new1": 1.5, "base2": 2.0, "new2": 1.5}
    assert all((out / f"b_{k}.json").is_file() for k in summary["runs"])


def test_a_failing_run_is_reported_and_the_rest_tabulated(tmp_path):
    good = make_tree(tmp_path / "good", "good", 1.0)
    broken = make_tree(tmp_path / "broken", "broken", 1.0)
    out = tmp_path / "out"
    r = run(tmp_path, "--tree", f"good={good}", "--tree", f"broken={broken}", "--rounds", "1", "--out-dir", str(out),
            "--", "bench/b.py")
    assert r.returncode == 1, r.stdout
    summary = json.loads((out / "b_ab.json").read_text())
    assert summary["failed"] == ["broken1"]
    assert summary["rows"][0]["medians"] == {"good1": 1.0, "broken1": None}
    assert "broken1: rc=3" in r.stdout and (out / "b_broken1.log").is_file()
    assert not (out / "b_broken1.json").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tree", "a=.", "--tree", "b=.", "--out-dir", "x"], "expected '--' then the benchmark script"),
        (["--tree", "a=.", "--out-dir", "x", "--", "bench/b.py"], "at least two trees"),
        (["--tree", "a", "--tree", "b=.", "--out-dir", "x", "--", "bench/b.py"], "expected NAME=PATH"),
        (["--tree", "a=/nonexistent", "--tree", "b=.", "--out-dir", "x", "--", "bench/b.py"],
         "expected a directory or a .tgz"),
        (["--tree", "a=.", "--tree", "b=.", "--out-dir", "x", "--", "bench/b.py", "--out", "y"], "leave out --out"),
        (["--tree", "a=.", "--tree", "b=.", "--out-dir", "x", "--rounds", "0", "--", "bench/b.py"],
         "--rounds: expected a positive count"),
        (["--tree", "a=.", "--tree", "b=.", "--out-dir", "x", "--", "nothing_here.py"], "is missing from tree(s)"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, args, message):
    r = run(tmp_path, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr
