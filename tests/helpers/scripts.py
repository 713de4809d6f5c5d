"""Import a script of the tree (``tools/``, ``benchmarks/``) that is not part of a package, by path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str) -> ModuleType:
    """The module of ``ROOT / relative`` (e.g. ``"tools/benchmarking/record_gpu_report.py"``), executed
    once per call under its file stem; ``ValueError`` when the file does not exist."""
    path = ROOT / relative
    if not path.is_file():
        raise ValueError(f"relative: no script at {path}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
