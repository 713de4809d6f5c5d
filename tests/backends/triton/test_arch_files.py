"""``rl_engine.backends.triton.ArchFiles``: one data file per device architecture, loaded once,
with the fallback's file for an architecture without one (CPU, pure)."""

from __future__ import annotations

import pytest

from rl_engine.backends.triton import ArchFiles


def test_files_load_once_and_fall_back(tmp_path):
    (tmp_path / "sm90.json").write_text("90")
    (tmp_path / "sm100.json").write_text("100")
    loads = []

    def load(path):
        loads.append(path.name)
        return int(path.read_text())

    files = ArchFiles(tmp_path, load, fallback="sm90")
    assert files.arches() == ["sm100", "sm90"] and files.path("sm80") == tmp_path / "sm80.json"
    assert files.get("sm100") == 100 and files.get("sm100") == 100
    assert files.get("sm80") == 90 and files.get(None) == 90  # no file, off the GPU: the fallback's
    assert loads == ["sm100.json", "sm90.json"]  # each file read once
    # without a fallback an architecture without a file has nothing (the MoE tables' reference tile)
    assert ArchFiles(tmp_path, load).get("sm80") is None and ArchFiles(tmp_path, load).get(None) is None


def test_a_missing_fallback_file_is_a_packaging_error(tmp_path):
    files = ArchFiles(tmp_path, lambda path: path.read_text(), fallback="sm90")
    with pytest.raises(FileNotFoundError, match="fallback"):
        files.get("sm80")
