"""Packaged workloads: schema, versioned lookup, and the pinned content hash of each shipped file."""

from __future__ import annotations

import hashlib
import json

import pytest

from rl_engine.workloads import Workload, WorkloadError, load_workload, shipped_workloads

# A shipped workload is immutable: editing one without adding a new version fails here.
# Adding a version: add its file and its sha256 below (never change an existing line).
PINNED_SHA256 = {
    "ws1-tiny.v1.json": "1e5495a0fa888a4a3904dbc8a364c601d2d093f33a8af0c13222003e0f3cb0a9",
    "ws2-tiny.v1.json": "a55f1915421849c4f420e1c4ba4d9a1aca47edabc48cc8f5fdfd9b8dc01338d8",
    "ws1-moe-tiny.v1.json": "a3c804c945fc46ce7b767b3782c4a7f26cc319321d07db7824c14c1c36f7ddd4",
}


def test_every_shipped_workload_is_pinned_and_unchanged():
    files = shipped_workloads()
    assert set(files) == set(PINNED_SHA256)
    for name, data in files.items():
        assert hashlib.sha256(data).hexdigest() == PINNED_SHA256[name], f"{name} changed: bump its version instead"


def test_load_by_name_version_and_path(tmp_path):
    lw = load_workload("ws1-tiny")
    assert (lw.workload.name, lw.workload.version) == ("ws1-tiny", 1)
    assert lw.sha256 == PINNED_SHA256["ws1-tiny.v1.json"] and lw.source == "package:ws1-tiny.v1.json"
    assert load_workload("ws1-tiny@1").sha256 == lw.sha256
    p = tmp_path / "mine.json"
    p.write_bytes(shipped_workloads()["ws1-tiny.v1.json"])
    assert load_workload(str(p)).sha256 == lw.sha256
    assert lw.header() == {"name": "ws1-tiny", "version": 1, "sha256": lw.sha256, "source": lw.source}


@pytest.mark.parametrize("ref, message", [
    ("no-such-workload", "no shipped workload named 'no-such-workload'"),
    ("ws1-tiny@7", "has versions [1]"),
    ("ws1-tiny@x", "has versions [1]"),
])
def test_bad_references(ref, message):
    with pytest.raises(WorkloadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_workload(ref)


def test_schema_rejects_bad_content(tmp_path):
    good = json.loads(shipped_workloads()["ws1-tiny.v1.json"])
    cases = {
        "unknown key": {**good, "surprise": 1},
        "empty samples": {**good, "samples": []},
        "bad padding": {**good, "padding_side": "middle"},
        "bad dtype": {**good, "model": {**good["model"], "dtype": "float64"}},
        "zero response": {**good, "samples": [{"prompt_len": 3, "response_len": 0}]},
    }
    for name, content in cases.items():
        p = tmp_path / f"{name.replace(' ', '_')}.json"
        p.write_text(json.dumps(content))
        with pytest.raises(WorkloadError, match="does not match the schema"):
            load_workload(str(p))
    p = tmp_path / "broken.json"
    p.write_text("{not json")
    with pytest.raises(WorkloadError, match="not valid JSON"):
        load_workload(str(p))


def test_workload_model_is_frozen():
    w = load_workload().workload
    assert isinstance(w, Workload)
    with pytest.raises(Exception):
        w.seed = 3  # type: ignore[misc]


def test_suite_configs_reference_shipped_workloads():
    from pathlib import Path

    from rl_engine.runtime.plan import Plan

    root = Path(__file__).resolve().parents[3] / "configs" / "suites"
    files = sorted(root.glob("*.json"))
    assert {f.stem for f in files} == {"ws1", "chain", "cross-config", "ablation", "ws2"}
    for f in files:
        cfg = json.loads(f.read_text())
        assert cfg["suite"] == f.stem
        load_workload(cfg["workload"])
        Plan.parse(cfg.get("plan", "R/R"))
