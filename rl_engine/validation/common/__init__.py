"""Checkers shared by tests, suites and the CLI."""

from rl_engine.validation.common.invariance import RowInvarianceReport, check_row_invariance

__all__ = ["RowInvarianceReport", "check_row_invariance"]
