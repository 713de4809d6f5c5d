"""Provenance: which implementation produced each result, and on what.

::

    with rl_engine.runtime.provenance.record() as calls:
        y = rl_engine.ops.gemm.linear(x, w)
    calls[0].impl_id        # "cpu.exact_sum"
    calls[0].fallback       # False

Every dispatched call inside the block appends one :class:`ProvenanceRecord`. Blocks nest: an
inner block's records also reach the outer one. The source fingerprint is the sha256 of the
implementation module's source file, so a report names exactly the code that ran.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import inspect
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ProvenanceRecord", "record", "source_fingerprint", "summarize"]


@dataclass(frozen=True)
class ProvenanceRecord:
    op: str
    impl_id: str
    impl_version: str
    platform: str
    source_fingerprint: str
    policy: str
    fallback: bool
    contract_version: int
    requested: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["requested"] = list(self.requested)
        return d


_SINKS: contextvars.ContextVar[tuple[list[ProvenanceRecord], ...]] = contextvars.ContextVar(
    "rlk_provenance_sinks", default=()
)


@functools.lru_cache(maxsize=None)
def source_fingerprint(module_name: str) -> str:
    """``sha256:<hex>`` of the source file of ``module_name`` (already imported)."""
    module = sys.modules[module_name]
    try:
        src = inspect.getsource(module).encode("utf-8")
    except (OSError, TypeError):  # pragma: no cover - frozen or generated modules
        src = repr(module).encode("utf-8")
    return "sha256:" + hashlib.sha256(src).hexdigest()


def active() -> bool:
    return bool(_SINKS.get())


def emit(rec: ProvenanceRecord) -> None:
    for sink in _SINKS.get():
        sink.append(rec)


@contextlib.contextmanager
def record() -> Iterator[list[ProvenanceRecord]]:
    """Collect a :class:`ProvenanceRecord` for every dispatched call in the block."""
    sink: list[ProvenanceRecord] = []
    token = _SINKS.set(_SINKS.get() + (sink,))
    try:
        yield sink
    finally:
        _SINKS.reset(token)


def summarize(records: list[ProvenanceRecord]) -> list[dict[str, Any]]:
    """Group records by (op, impl, fallback) with call counts — the form reports embed."""
    groups: dict[tuple, dict[str, Any]] = {}
    for r in records:
        key = (r.op, r.impl_id, r.impl_version, r.platform, r.source_fingerprint, r.policy, r.fallback)
        if key not in groups:
            groups[key] = {**r.as_dict(), "calls": 0}
            groups[key].pop("requested")
        groups[key]["calls"] += 1
    return sorted(groups.values(), key=lambda d: (d["op"], d["impl_id"]))
