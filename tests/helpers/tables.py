"""Negative controls of the tile-table loaders: each malformed document is refused with an error
naming what is wrong."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest


def assert_each_refused(load: Callable[[Path], Any], documents: Mapping[str, Any], tmp_path: Path) -> None:
    """``load`` (a table loader taking a path) raises ``ValueError`` matching each key of
    ``documents`` on the document it maps to, written to a file under ``tmp_path``."""
    assert documents, "no malformed documents given"
    path = tmp_path / "table.json"
    for needle, document in documents.items():
        path.write_text(json.dumps(document))
        with pytest.raises(ValueError, match=needle):
            load(path)
