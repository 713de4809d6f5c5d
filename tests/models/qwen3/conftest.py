"""Tiny Qwen3 checkpoints built with transformers' ``save_pretrained`` (no hub access)."""

from __future__ import annotations

import pytest
import torch

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


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads; one thread avoids oversubscription
    under ``pytest -n 2`` on the 2-core CI machine. Restored after each test."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
