"""Packaged, versioned workloads: the frozen inputs of every validation suite.

A workload is one JSON file ``rl_engine/workloads/data/<name>.v<version>.json`` validated by
:class:`Workload` (pydantic, unknown keys rejected). Its **content hash** (sha256 of the file's
bytes) goes into every report, so a report names exactly the inputs it ran. A shipped workload
is immutable: changing its content requires a new file with a new version (a test pins the
sha256 of every shipped file).

``load_workload("ws1-tiny")`` loads the highest version of that name; ``"ws1-tiny@1"`` a given
version; a path to a ``.json`` file loads that file (its hash is reported the same way).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from rl_engine.utils.schema import StrictModel

__all__ = ["WorkloadError", "Workload", "LoadedWorkload", "load_workload", "shipped_workloads", "SampleSpec"]

_FILE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9-]*)\.v(?P<version>[0-9]+)\.json$")


class WorkloadError(ValueError):
    """A workload is missing, not valid JSON, or does not match the schema."""


class ModelSpec(StrictModel):
    preset: str = "tiny"  # a rl_engine.models.qwen3 preset, random weights
    seed: int = 0  # weight seed
    path: str | None = None  # a HF Qwen3 checkpoint directory instead of the preset (its identity)
    dtype: Literal["float32", "bfloat16"] = "float32"


class SampleSpec(StrictModel):
    prompt_len: int = Field(ge=1)
    response_len: int = Field(ge=1)
    arrival_step: int = Field(default=0, ge=0)


class ChunkSizes(StrictModel):
    prefill_chunk: int = Field(default=16, ge=1)  # rollout prompt tokens per step per sequence
    max_step_tokens: int = Field(default=40, ge=1)  # rollout token budget per step
    token_chunk: int = Field(default=13, ge=1)  # fused LM-head log-prob chunks (train)
    vocab_chunk: int = Field(default=1024, ge=1)  # a multiple of the canonical 1024-column block


class OperatorSuite(StrictModel):
    dtypes: tuple[Literal["float32", "bfloat16"], ...] = ("float32", "bfloat16")
    rows: int = Field(default=9, ge=2)  # rows of each operator input
    trials: int = Field(default=6, ge=1)  # re-batched calls per invariance check (layouts)


class Workload(StrictModel):
    """Schema of a workload file (see module docstring)."""

    schema_version: Literal[1] = 1
    name: str
    version: int = Field(ge=1)
    description: str
    model: ModelSpec = ModelSpec()
    seed: int = 0  # prompt tokens and sampling draws
    temperature: float = Field(default=1.0, ge=0.0)
    top_k: int = Field(default=50, ge=0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    samples: tuple[SampleSpec, ...] = Field(min_length=1)
    chunks: ChunkSizes = ChunkSizes()
    permutation_seed: int = 1234
    padding_side: Literal["left", "right"] = "right"
    pad_id: int = Field(default=0, ge=0)
    operators: OperatorSuite = OperatorSuite()

    @model_validator(mode="after")
    def _check(self) -> "Workload":
        if not _FILE.match(f"{self.name}.v{self.version}.json"):
            raise ValueError(f"name: {self.name!r} must be lower-case letters, digits and '-'")
        return self


@dataclass(frozen=True)
class LoadedWorkload:
    """A validated workload and where it came from."""

    workload: Workload
    sha256: str
    source: str  # "package:<file>" or a path

    def header(self) -> dict:
        w = self.workload
        return {"name": w.name, "version": w.version, "sha256": self.sha256, "source": self.source}


def _package_dir():
    return resources.files("rl_engine.workloads").joinpath("data")


def shipped_workloads() -> dict[str, bytes]:
    """``{file name: bytes}`` of every packaged workload file."""
    return {p.name: p.read_bytes() for p in _package_dir().iterdir() if p.name.endswith(".json")}


def _parse(data: bytes, source: str, expect: tuple[str, int] | None = None) -> LoadedWorkload:
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"workload: {source} is not valid JSON: {exc}") from exc
    try:
        w = Workload.model_validate(raw)
    except ValidationError as exc:
        raise WorkloadError(f"workload: {source} does not match the schema:\n{exc}") from exc
    if expect is not None and (w.name, w.version) != expect:
        raise WorkloadError(f"workload: {source} declares {w.name} v{w.version}, its file name says {expect[0]} v{expect[1]}")
    return LoadedWorkload(w, hashlib.sha256(data).hexdigest(), source)


def load_workload(ref: str = "ws1-tiny") -> LoadedWorkload:
    """Load a shipped workload by ``name`` or ``name@version``, or a workload file by path."""
    path = Path(ref)
    if ref.endswith(".json") and path.is_file():
        return _parse(path.read_bytes(), str(path))
    name, _, ver = ref.partition("@")
    files = {}
    for fname, data in shipped_workloads().items():
        m = _FILE.match(fname)
        if m and m["name"] == name:
            files[int(m["version"])] = (fname, data)
    if not files:
        known = sorted({m["name"] for f in shipped_workloads() if (m := _FILE.match(f))})
        raise WorkloadError(f"workload: no shipped workload named {name!r} and no such file; known: {known}")
    if ver:
        if not ver.isdigit() or int(ver) not in files:
            raise WorkloadError(f"workload: {name!r} has versions {sorted(files)}, got {ver!r}")
        v = int(ver)
    else:
        v = max(files)
    fname, data = files[v]
    return _parse(data, f"package:{fname}", (name, v))
