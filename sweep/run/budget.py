"""``sweep.budget``: how much one session of a run may do before it stops cleanly, marked ``partial``.

The budget counts this session only (the evaluations it computes, the minutes since it started), so running
the same command again continues the run with a fresh budget, and a run resumed without a budget finishes
(``sweep.budget`` is not part of the config hash). A stop lands between evaluations: every result computed
so far is stored, the run row says ``partial``, and the evaluations in flight are computed again on resume.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class BudgetReached(Exception):
    """Raised between evaluations when the session's budget is spent (the driver marks the run partial)."""


@dataclass
class SessionBudget:
    """What is left of ``sweep.budget`` in this session."""

    evaluations: int | None = None
    minutes: float | None = None
    computed: int = 0
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def from_config(cls, budget: dict | None) -> SessionBudget | None:
        """The budget of ``sweep.budget`` (already checked: one key, a positive number), or None."""
        if not budget:
            return None
        return cls(evaluations=int(budget["evaluations"]) if "evaluations" in budget else None,
                   minutes=float(budget["minutes"]) if "minutes" in budget else None)

    def count(self, n: int = 1) -> None:
        """``n`` more evaluations computed (the reference counts like any other)."""
        self.computed += n

    def reached(self) -> bool:
        """Whether the session may start nothing more."""
        if self.evaluations is not None and self.computed >= self.evaluations:
            return True
        return self.minutes is not None and time.monotonic() - self.started >= self.minutes * 60

    def describe(self) -> str:
        """``100 evaluations`` or ``30 minutes``: what was spent."""
        if self.evaluations is not None:
            return f"{self.evaluations} evaluations"
        return f"{self.minutes:g} minutes"
