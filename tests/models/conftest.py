"""Shared by the model tests (Qwen3, Qwen3-MoE)."""

from __future__ import annotations

import pytest

from tests.helpers.threads import threads


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads; one thread avoids oversubscription
    under ``pytest -n 2`` on the 2-core CI machine. Restored after each test."""
    with threads(1):
        yield
