"""Shared test configuration.

* Hypothesis: a derandomized profile (CI reproducible), no deadline (CPU timing noise).
* ``@pytest.mark.gpu`` tests are skipped when no CUDA/ROCm device is visible, with that reason;
  on the device machine they run (and a skip there is a failure of the run: see reports/).
* ``gpu_branches``: host tensors take the GPU's branches of the NaN policy (for the host-read
  checks of ``tests/helpers/host_reads.py``).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "rlk",
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "rlk"))

# Under pytest-xdist each worker gets one intra-op thread: two workers with two threads each
# oversubscribe a 2-core CI machine (a tiny op then waits ~1000x longer). Bits do not depend on
# the thread count (tests/helpers/threads.py and the thread-count tests prove it).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture
def gpu_branches(monkeypatch):
    """Make the NaN policy treat host tensors as it treats GPU tensors for the test (no scan, no
    read-back under ``"auto"``): ``checks._HOST_DEVICES`` empty, restored by ``monkeypatch``."""
    from rl_engine.utils import checks

    monkeypatch.setattr(checks, "_HOST_DEVICES", frozenset())


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU: none visible on this machine (CPU CI); runs on the device with zero skips")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
