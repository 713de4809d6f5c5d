"""Record one GPU test shard in ``reports/gpu/<platform>/gpu_tests.json`` from the device run's junit XML.

``tools/benchmarking/gpu_all_run.sh`` writes ``pytest_gpu.xml`` (the ``gpu``-marked tests, parallel
workers) and ``pytest_gpu_perf.xml`` (the bounded-performance smoke, alone). This reads both and
replaces the shard of the same name: command, measured commit, counts, seconds, timestamp, the
per-module counts, the failing tests (node ids) and a ``why`` sentence for them when given.

A run that pytest ended at its session time limit (``--session-timeout``, which the driver sets
below the device call's limit so that the junit XML is still written) is marked ``"stopped"``
with pytest's line, read from the run's log (``--log``; default: ``pytest_gpu.log`` beside the
XML, as the driver writes it): the tests it did not reach are in no count, so such a shard is
never a complete run.

    python tools/benchmarking/record_gpu_tests.py rest OUT/pytest_gpu.xml --perf OUT/pytest_gpu_perf.xml \\
        --commit bb7a58d --command "python -m pytest tests ... -m gpu -n 16" --report reports/gpu/h200/gpu_tests.json

A platform's first shard starts its report: ``--env`` names the driver's ``env.txt`` of the run
(the versions of torch, CUDA, triton, pydantic, hypothesis and pytest it printed) and
``--device-from`` a benchmark record of the same machine whose ``platform`` and ``device`` (name,
capability, SMs, driver, memory) the report takes, e.g. the matrix record the same call wrote. ``--check`` adds
the ``rlk check --device cuda ... --json`` outputs of the same call (the driver's ``check_cuda``
step) to the report's ``rlk_check`` table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def _suite(path: Path) -> ET.Element:
    root = ET.parse(path).getroot()
    return root.find("testsuite") if root.tag == "testsuites" else root


def _node(case: ET.Element) -> str:
    mod = case.get("classname", "").replace(".", "/") + ".py"
    return f"{mod}::{case.get('name')}"


#: pytest-timeout's line when the session time limit ends a run
STOPPED = re.compile(r"session-timeout: [0-9.]+ sec exceeded")


def stopped_line(log: Path) -> str | None:
    """pytest's session-timeout line in ``log`` (``None``: the run was not cut short)."""
    m = STOPPED.search(log.read_text(encoding="utf-8", errors="replace"))
    return m.group(0) if m else None


def shard(name: str, xml: Path, *, commit: str, command: str, perf: Path | None = None,
          why: str | None = None, log: Path | None = None) -> dict[str, Any]:
    s = _suite(xml)
    modules: dict[str, dict[str, int]] = {}
    failed = []
    for case in s.findall("testcase"):
        mod = case.get("classname", "").replace(".", "/") + ".py"
        m = modules.setdefault(mod, {"tests": 0, "skipped": 0})
        m["tests"] += 1
        m["skipped"] += case.find("skipped") is not None
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(_node(case))
    out: dict[str, Any] = {"shard": name, "command": command, "commit": commit, "tests": int(s.get("tests")),
                           "failures": int(s.get("failures")), "errors": int(s.get("errors")),
                           "skipped": int(s.get("skipped")), "seconds": float(s.get("time")),
                           "timestamp": s.get("timestamp"), "modules": dict(sorted(modules.items()))}
    if failed:
        out["failed"] = sorted(failed)
        if not why:
            raise SystemExit(f"--why: {len(failed)} tests failed; say what caused them")
        out["why"] = why
    stopped = stopped_line(log) if log is not None else None
    if stopped:
        out["stopped"] = stopped
    if perf is not None:
        p = _suite(perf)
        out["bounded_performance"] = {k: int(p.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    return out


#: the driver's version line: ``torch 2.11.0+cu130 cuda 13.0 triton 3.6.0 pydantic 2.14.4 ...``
VERSIONS = re.compile(r"^torch (\S+) cuda (\S+) triton (\S+) pydantic (\S+) hypothesis (\S+) pytest (\S+)$", re.M)


def new_report(env: Path, device_from: Path) -> dict[str, Any]:
    """An empty ``gpu_tests.json`` for a platform's first shard: the versions from the driver's
    ``env.txt``, the platform and device from a benchmark record of the same machine (the matrix
    record names its platform with ``bench_matrix_gpu.platform_key``)."""
    m = VERSIONS.search(env.read_text(encoding="utf-8"))
    if m is None:
        raise SystemExit(f"--env: no version line ('torch X cuda Y triton Z pydantic P hypothesis H pytest T') in {env}")
    record = json.loads(device_from.read_text(encoding="utf-8"))
    device, platform = record.get("device"), record.get("platform")
    if not isinstance(device, dict) or not {"name", "capability", "sm_count"} <= set(device) or not platform:
        raise SystemExit(f"--device-from: expected a benchmark record with its platform and a top-level device "
                         f"(name, capability, sm_count), got platform {platform!r}, device {device!r} in {device_from}")
    versions = dict(zip(("torch", "cuda", "triton", "pydantic", "hypothesis", "pytest"), m.groups()))
    if "python" in record.get("versions", {}):
        versions["python"] = record["versions"]["python"]
    return {"schema_version": 1, "family": "gpu_tests", "platform": platform,
            "title": "GPU test runs (every gpu-marked test, in shards) and rlk check on CUDA",
            "device": device, "versions": versions, "notes": [], "shards": []}


def check_entry(path: Path) -> dict[str, Any]:
    """One ``rlk_check`` entry from the JSON that ``rlk check --device cuda ... --json`` printed (the
    driver's ``check_cuda`` step writes one file per run): the command, rebuilt from the run's own
    settings, its counts and what a correct library gives (0 mismatches; on the production plan
    ``P/P``, the negative control, mismatches)."""
    r = json.loads(path.read_text(encoding="utf-8"))
    missing = {"dtype", "plan", "model", "compared_tokens", "mismatched_tokens", "max_abs_diff", "bits_digest"} - set(r)
    if missing or r.get("device") != "cuda":
        raise SystemExit(f"--check: {path} is not the JSON of `rlk check --device cuda ... --json` "
                         f"(missing {sorted(missing)}, device {r.get('device')!r})")
    cmd = ["rlk check --device cuda", f"--dtype {r['dtype']}"]
    if r["model"] != "tiny":
        cmd.append(f"--preset {r['model']}")
    if r.get("extra_prompt_tokens"):
        cmd.append(f"--extra-prompt-tokens {r['extra_prompt_tokens']}")
    if r.get("kv_cache", "contiguous") != "contiguous":
        cmd.append(f"--kv-cache {r['kv_cache']}")
    if r["plan"] != "R/R":
        cmd.append(f"--plan {r['plan']}")
    expected = ("0 mismatches" if r["plan"] == "R/R" else
                "mismatches (negative control: both sides on the production plan)")
    return {"command": " ".join(cmd + ["--json"]), "compared_tokens": r["compared_tokens"],
            "mismatched_tokens": r["mismatched_tokens"], "max_abs_diff": r["max_abs_diff"],
            "bits_digest": r["bits_digest"], "expected": expected}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="the shard's name (a shard of that name is replaced)")
    ap.add_argument("xml", type=Path, help="pytest_gpu.xml of the run")
    ap.add_argument("--perf", type=Path, default=None, help="pytest_gpu_perf.xml of the run")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--command", required=True, help="the pytest command as it ran")
    ap.add_argument("--why", default=None, help="what caused the failures (required when there are any)")
    ap.add_argument("--log", type=Path, default=None,
                    help="the run's pytest log (default: the XML's name with .log, when present): marks a shard "
                         "that pytest's session time limit ended")
    ap.add_argument("--report", type=Path, required=True, help="reports/gpu/<platform>/gpu_tests.json")
    ap.add_argument("--env", type=Path, default=None,
                    help="the driver's env.txt of the run: starts the report when it does not exist (with --device-from)")
    ap.add_argument("--device-from", type=Path, default=None,
                    help="a benchmark record of the same machine (its top-level device) for a new report")
    ap.add_argument("--check", type=Path, action="append", default=[],
                    help="the JSON of one `rlk check --device cuda ... --json` run of the same call (repeatable): "
                         "replaces the report's rlk_check entry of the same command")
    a = ap.parse_args(argv)
    if a.report.is_file():
        rep = json.loads(a.report.read_text(encoding="utf-8"))
    elif a.env is None or a.device_from is None:
        ap.error(f"--report: no report at {a.report}; a platform's first shard needs --env and --device-from")
    else:
        rep = new_report(a.env, a.device_from)
    log = a.log if a.log is not None else a.xml.with_suffix(".log")
    if a.log is not None and not log.is_file():
        ap.error(f"--log: no file at {log}")
    new = shard(a.name, a.xml, commit=a.commit, command=a.command, perf=a.perf, why=a.why,
                log=log if log.is_file() else None)
    rep["shards"] = [s for s in rep["shards"] if s["shard"] != a.name] + [new]
    for path in a.check:
        entry = check_entry(path)
        rep["rlk_check"] = [c for c in rep.get("rlk_check", []) if c["command"] != entry["command"]] + [entry]
    a.report.write_text(json.dumps(rep, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{a.report}: shard {a.name}: {new['tests']} tests, {new['failures']} failures, {new['errors']} errors, "
          f"{new['skipped']} skipped" + (f"; STOPPED ({new['stopped']}): not a complete run" if new.get("stopped") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
