"""Outlier ejection of stage replicas, as Envoy's: which failures mean "nothing was sent", and how long a
replica that refuses connections stays out of routing.

A call that never reached its replica (connection refused, no route, the address is gone) cost the
request nothing: it goes to another ready replica without counting as an attempt or against the retry
budget, and the replica is ejected at once: no new work until a probe answers. Each ejection in a row
lasts longer (base time x consecutive ejections, capped), so a replica that flaps is tried less and less
often; a call it then serves to the end clears the count. Pure: the router (routing.py) keeps one
`Outlier` per replica, asks `probe_due`, and runs the probe itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

# Envoy ejects for 30 s and up to 300 s. A stage replica that refused a connection is usually restarting
# (a kubelet restart, a rollout) and back within seconds: probing after 1 s finds it soon, and the
# growth keeps a replica that stays down from costing more than a probe every 30 s.
BASE_EJECTION_S = 1.0
MAX_EJECTION_S = 30.0

# A replica's load is polled (routing.py, GetLoad with a 1 s bound). Two polls that could not connect mean it is
# gone. A poll that timed out means it is slow, not gone: a stage starved of CPU (its cgroup's share on a busy
# node, a long step holding the interpreter) still serves what it holds, and taking it out of routing would turn
# slowness into refusals. Only this many timed-out polls in a row (about 10 s without one answer) mean hung.
UNREACHABLE_AFTER_FAILED_POLLS = 2
UNREACHABLE_AFTER_SLOW_POLLS = 8

# What gRPC core says when no connection could be made (so no byte of the call was sent). Matched on
# the status details because gRPC Python exposes no separate error kind for it.
_NOT_CONNECTED = ("failed to connect to all addresses", "connection refused", "no route to host",
                  "name resolution", "dns resolution failed")


def nothing_sent(code: grpc.StatusCode, details: str) -> bool:
    """Whether a failed call never reached its replica: UNAVAILABLE before any connection was made."""
    text = (details or "").lower()
    return code == grpc.StatusCode.UNAVAILABLE and any(s in text for s in _NOT_CONNECTED)


def unreachable(code: grpc.StatusCode, misses: int) -> bool:
    """Whether `misses` load polls in a row, the last of which failed with `code`, mean the replica is unreachable."""
    slow = code == grpc.StatusCode.DEADLINE_EXCEEDED
    return misses >= (UNREACHABLE_AFTER_SLOW_POLLS if slow else UNREACHABLE_AFTER_FAILED_POLLS)


def ejection_seconds(consecutive: int, base_s: float = BASE_EJECTION_S, max_s: float = MAX_EJECTION_S) -> float:
    """How long the `consecutive`-th ejection in a row lasts (1-based)."""
    if consecutive < 1:
        raise ValueError(f"consecutive ejections must be >= 1, got {consecutive}")
    return min(max_s, base_s * consecutive)


@dataclass
class Outlier:
    """One replica's ejection state. Times are the caller's clock (loop.time())."""

    base_s: float = BASE_EJECTION_S
    max_s: float = MAX_EJECTION_S
    consecutive: int = 0             # ejections since the replica last served a call to the end
    until: float | None = None       # ejected until then, and after that until a probe answers

    @property
    def ejected(self) -> bool:
        return self.until is not None

    def eject(self, now: float) -> float:
        """Eject (again, when ejected: a failed probe); returns when a probe is next due."""
        self.consecutive += 1
        self.until = now + ejection_seconds(self.consecutive, self.base_s, self.max_s)
        return self.until

    def probe_due(self, now: float) -> bool:
        return self.until is not None and now >= self.until

    def probe_answered(self) -> None:
        """The replica answered a probe: back in routing (the count stays: ejected again, it stays out longer)."""
        self.until = None

    def served(self) -> None:
        """The replica served a call to the end: its next ejection starts from the base time again."""
        if self.until is None:
            self.consecutive = 0
