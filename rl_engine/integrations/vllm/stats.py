"""Per-process record of what the vLLM plugin ran: rl_engine operators and native fallbacks.

vLLM runs the model in one process per tensor-parallel rank (or in the caller's process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so each process keeps its own record; the parent reads
every rank's through :func:`rl_engine.integrations.vllm.vllm_provenance`.

* Every replacement forward runs its rl_engine operators through :func:`run`, which opens a
  :func:`rl_engine.runtime.provenance.record` block and folds the records (operator,
  implementation, version, platform, source fingerprint, policy, fallback) into call counts.
* Every *native* vLLM forward of a replaced kind (a class the plugin also wraps with a
  counter, see ``plugin.NATIVE_WATCH``) calls :func:`native`: counted in the diagnostic mode,
  :class:`NativeFallbackError` in the strict mode. Zero native calls is therefore measured,
  not assumed.

This module imports neither vLLM nor torch at import time beyond rl_engine's runtime.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

from rl_engine.runtime import provenance as _prov

__all__ = ["NativeFallbackError", "run", "native", "snapshot", "reset", "set_mode", "mode"]

_LOCK = threading.Lock()
_OPS: Counter = Counter()  # (op, impl_id, impl_version, platform, fingerprint, policy, fallback) -> calls
_MODULES: Counter = Counter()  # replacement kind ("RMSNorm", "RowParallelLinear", ...) -> forwards
_NATIVE: Counter = Counter()  # "Class.method" -> native calls
_MODE = {"mode": "off"}


class NativeFallbackError(RuntimeError):
    """Strict mode: a native vLLM operator of a replaced kind ran instead of rl_engine's."""


def set_mode(mode: str) -> None:
    """``"off"``, ``"diagnostic"`` (count native calls) or ``"strict"`` (raise on them)."""
    if mode not in ("off", "diagnostic", "strict"):
        raise ValueError(f"mode: expected 'off', 'diagnostic' or 'strict', got {mode!r}")
    _MODE["mode"] = mode


def mode() -> str:
    return _MODE["mode"]


def run(kind: str, fn, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` (rl_engine ops inside) for replacement ``kind`` and count its provenance."""
    with _prov.record() as recs:
        out = fn(*args, **kwargs)
    with _LOCK:
        _MODULES[kind] += 1
        for r in recs:
            _OPS[(r.op, r.impl_id, r.impl_version, r.platform, r.source_fingerprint, r.policy, r.fallback)] += 1
    return out


def native(where: str) -> None:
    """A native forward of a replaced kind is about to run (raises in strict mode)."""
    with _LOCK:
        _NATIVE[where] += 1
    if _MODE["mode"] == "strict":
        raise NativeFallbackError(
            f"rl_engine vLLM plugin (strict): native {where} ran, but strict mode allows only rl_engine operators "
            f"(was the module built before the plugin was installed, or is this layer kind not supported?)"
        )


def snapshot() -> dict[str, Any]:
    """This process's record: mode, pid, operator call counts, module forwards, native calls."""
    with _LOCK:
        ops = [
            {"op": k[0], "impl_id": k[1], "impl_version": k[2], "platform": k[3], "source_fingerprint": k[4],
             "policy": k[5], "fallback": k[6], "calls": n}
            for k, n in sorted(_OPS.items(), key=lambda kv: (kv[0][0], kv[0][1]))
        ]
        return {
            "pid": os.getpid(),
            "mode": _MODE["mode"],
            "operators": ops,
            "modules": dict(sorted(_MODULES.items())),
            "native_calls": dict(sorted(_NATIVE.items())),
            "fallback": any(o["fallback"] for o in ops),
        }


def reset() -> None:
    """Forget every count in this process."""
    with _LOCK:
        _OPS.clear()
        _MODULES.clear()
        _NATIVE.clear()
