"""Tiny Qwen3 checkpoints built with transformers' ``save_pretrained`` (no hub access)."""

from __future__ import annotations

import pytest

from tests.helpers.qwen3 import TINY_CONFIGS, build_hf_model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """``{name: directory}`` of saved tiny checkpoints; the untied 3-layer one is sharded."""
    out = {}
    for name, cfg in TINY_CONFIGS.items():
        d = tmp_path_factory.mktemp(name)
        hf = build_hf_model(cfg)
        shard = "60KB" if name.startswith("h32") else "100MB"
        hf.save_pretrained(d, max_shard_size=shard)
        out[name] = d
    return out
