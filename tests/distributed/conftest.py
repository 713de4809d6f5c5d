"""One gloo world of 4 ranks per test session runs every rank-side check of
:mod:`tests.distributed.workers` (TP/DP blocks on the world and its halves, FSDP2 at 1, 2, 4 ranks)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gloo_world():
    from rl_engine.distributed.launch import spawn
    from tests.distributed import workers

    return spawn(workers.all_checks, 4)
