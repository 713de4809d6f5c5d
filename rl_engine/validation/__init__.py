"""Validation: invariance checkers, suites and reports."""
