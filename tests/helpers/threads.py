"""Scoped intra-op thread count for property tests.

Hypothesis tests make thousands of tiny calls; with several pytest-xdist workers on a small
machine, torch's intra-op thread pool oversubscribes the cores and each tiny op can wait for
milliseconds. Bits do not depend on the thread count (tests/ops/logprob checks 1 vs 2 threads
on the same inputs), so property tests may run single-threaded without losing coverage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)``; restores the previous count in ``finally``."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
