"""Checkers shared by tests, suites and the CLI."""

from rl_engine.validation.common.invariance import RowInvarianceReport, check_row_invariance
from rl_engine.validation.common.report import CheckReport

__all__ = ["CheckReport", "RowInvarianceReport", "check_row_invariance"]
