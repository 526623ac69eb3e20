"""The orchestrator's retry budget, as Envoy's: how many stage calls may be on a retry at once.

A failed stage call is retried on another replica (stage_call.py) only while the retries in progress
stay under max(`min_retry_concurrency`, `budget_percent` of the active stage calls). Without it, a
request that fails every replica it reaches is retried on each in turn, and a burst of them marks every
replica down; with it, retries stay a bounded share of the work, and a call beyond the budget fails with
the status it had ("retry budget exhausted"). Pure bookkeeping on the event loop: no locks, no I/O.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

# Envoy's defaults (config.cluster.v3.CircuitBreakers.Thresholds.RetryBudget): retries may be 20% of the
# active calls, and never fewer than 3 at once, so a lightly loaded orchestrator still retries.
BUDGET_PERCENT = 20.0
MIN_RETRY_CONCURRENCY = 3


class RetryBudget:
    """Active stage calls and the retries among them, across every request of one orchestrator."""

    def __init__(self, budget_percent: float = BUDGET_PERCENT, min_retry_concurrency: int = MIN_RETRY_CONCURRENCY):
        if budget_percent < 0 or min_retry_concurrency < 0:
            raise ValueError("budget_percent and min_retry_concurrency must be >= 0")
        self.budget_percent = budget_percent
        self.min_retry_concurrency = min_retry_concurrency
        self.active = 0    # stage calls in progress (a call on a retry attempt included)
        self.retrying = 0  # stage calls on a retry attempt

    @property
    def limit(self) -> float:
        """Retries that may be in progress at once now."""
        return max(self.min_retry_concurrency, self.active * self.budget_percent / 100)

    @contextlib.contextmanager
    def call(self) -> Iterator["CallBudget"]:
        """Count one stage call as active for the block; its retry slot, if any, is freed on the way out."""
        share = CallBudget(self)
        self.active += 1
        try:
            yield share
        finally:
            share.retry_ended()
            self.active -= 1


class CallBudget:
    """One stage call's share of the budget: a retry slot held while the call is on a retry attempt."""

    def __init__(self, budget: RetryBudget):
        self._budget = budget
        self.retrying = False

    def try_retry(self) -> bool:
        """Take a slot for this call's next attempt (the slot of a retry that failed is given back first);
        False when the budget is spent."""
        self.retry_ended()
        b = self._budget
        if b.retrying >= b.limit:
            return False
        b.retrying += 1
        self.retrying = True
        return True

    def retry_ended(self) -> None:
        if self.retrying:
            self._budget.retrying -= 1
            self.retrying = False
