"""Shared benchmark harness (see :mod:`benchmarks.common.harness`)."""
