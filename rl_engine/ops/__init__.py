"""Semantic operator entry points (hardware independent).

Each family module validates arguments, builds a runtime request and dispatches to the first
eligible implementation under the current policy. Families load lazily::

    from rl_engine.ops import gemm
    y = gemm.linear(x, w)
"""

from __future__ import annotations

import importlib
from typing import Any

FAMILIES = ("activation", "attention", "embedding", "gemm", "logprob", "loss", "moe", "norm", "packing", "rope")


def __getattr__(name: str) -> Any:
    if name in FAMILIES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'rl_engine.ops' has no attribute {name!r}")
