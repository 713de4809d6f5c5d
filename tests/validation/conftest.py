"""Validation suites run tiny models: one intra-op thread is fastest and avoids oversubscribing CI
(bits do not depend on the thread count; see tests/helpers/threads.py)."""

from __future__ import annotations

import pytest

from tests.helpers.threads import threads


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with threads(1):
        yield
