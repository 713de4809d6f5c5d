"""The outcome type shared by the raw-bit checkers (row, attention, micro-batch invariance)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

__all__ = ["CheckReport"]


@dataclass
class CheckReport:
    """How many comparisons a checker made, and one line per failure.

    Truthy when nothing failed, so ``assert report, str(report)`` reads well. Subclasses only
    name what passing means and what one comparison is called.
    """

    trials: int = 0
    failures: list[str] = field(default_factory=list)

    passed_as: ClassVar[str] = "raw-bit equal"
    unit: ClassVar[str] = "comparisons"

    @property
    def ok(self) -> bool:
        return not self.failures

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return f"{self.passed_as} on {self.trials} {self.unit}"
        return f"{len(self.failures)} failure(s) in {self.trials} {self.unit}; first: {self.failures[0]}"
