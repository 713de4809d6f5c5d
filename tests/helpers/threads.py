"""Scoped intra-op thread count for property tests.

Hypothesis tests make thousands of tiny calls; with several pytest-xdist workers on a small
machine, torch's intra-op thread pool oversubscribes the cores and each tiny op can wait for
milliseconds. Bits do not depend on the thread count (tests/ops/logprob checks 1 vs 2 threads
on the same inputs, tests/ops/test_cpu_bits_threads_isa.py every op at 1-4 threads), so property
tests may run single-threaded without losing coverage.
"""

from __future__ import annotations

from rl_engine.utils.threads import intra_op_threads as threads

__all__ = ["threads"]
