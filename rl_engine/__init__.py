"""rl-kernel: operators whose numerics are written, tested contracts.

``import rl_engine`` is free of side effects: it compiles nothing, imports no backend and
changes no global state. Public sub-packages load lazily on first attribute access::

    import rl_engine
    y = rl_engine.ops.gemm.linear(x, w)      # imports rl_engine.ops.gemm on first use
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_SUBMODULES = (
    "backends",
    "contracts",
    "entrypoints",
    "models",
    "ops",
    "platforms",
    "reference",
    "runtime",
    "utils",
    "validation",
)

if TYPE_CHECKING:  # pragma: no cover
    from . import contracts, ops, platforms, reference, runtime, utils  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'rl_engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_SUBMODULES))
