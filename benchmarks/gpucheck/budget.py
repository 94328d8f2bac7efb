"""The time budget: every section stops starting new work at its share of --budget-s (counted
from the start), so one call stays under 8 minutes whatever is slow; skipped items are reported."""

from __future__ import annotations

import time

SECTION_END = {"checks": 0.30, "e2e": 0.36, "engine": 0.55, "decode": 0.80, "prefill": 0.88,
               "graphs": 1.0}


class Clock:
    def __init__(self, budget_s: float, t0: float | None = None) -> None:
        self.budget_s, self.t0 = budget_s, time.time() if t0 is None else t0

    def start(self, budget_s: float, t0: float) -> None:
        """The run's budget, counted from t0 (main sets the one shared CLOCK)."""
        self.budget_s, self.t0 = budget_s, t0

    def past(self, section: str) -> bool:
        """The section's share of the budget is used up: start nothing new in it."""
        return time.time() - self.t0 > SECTION_END[section] * self.budget_s


CLOCK = Clock(float("inf"))


def skipped(name: str, section: str) -> dict:
    return dict(name=name, ok=None, skipped=f"{section}: out of time budget")
