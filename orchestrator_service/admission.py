"""Admission and backpressure: which requests may enter the pipeline now.

A request is admitted when the pipeline has room for it everywhere it will go:
fewer than `maxInflight` requests run, and for every stage it needs, the
requests committed to that stage (admitted, not yet done with it) stay below
the stage's capacity (the sum over its ready replicas of what each can hold,
as the replicas report it). So no stage is ever sent more than it can hold,
and when a slow stage's backlog is full, new requests wait here instead of
piling intermediate results in front of it. The wait queue is bounded; beyond
it a request is refused at once with a retry hint.

Order among waiting requests: higher priority first; then arrival order
(`InFlightFirst`: work already admitted finishes before new work competes
for it) or the smallest estimated cost (`ShortestFirst`). A request passed
over `max_overtakes` times is served next, so no request waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable


class Overloaded(RuntimeError):
    def __init__(self, message: str, retry_after_s: float):
        self.retry_after_s = retry_after_s
        super().__init__(message)


@dataclass(eq=False)
class Ticket:
    """One admitted request's hold on the pipeline; released stage by stage as it moves on."""

    stages: set[str]
    priority: int
    cost: float
    seq: int
    admitted_at: float = 0.0
    wait_ms: float = 0.0


@dataclass(eq=False)
class _Waiter:
    ticket: Ticket
    future: asyncio.Future
    overtaken: int = 0


@dataclass
class Admission:
    max_inflight: int
    max_queued: int
    capacity: Callable[[str], int]          # how many requests a stage can hold right now
    fairness: str = "InFlightFirst"
    max_overtakes: int = 64
    committed: dict[str, int] = field(default_factory=dict)
    inflight: int = 0
    peak_queued: int = 0
    peak_committed: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        self._mean_service_s = 1.0

    # ------------------------------------------------------------ queries
    @property
    def queued(self) -> int:
        return len(self._waiters)

    def fits(self, stages: Iterable[str]) -> bool:
        return self.inflight < self.max_inflight and all(
            self.committed.get(s, 0) < self.capacity(s) for s in stages)

    def retry_after(self) -> float:
        """Roughly when a slot frees up: the queue ahead times the mean service time, over the slots."""
        return round(max(0.1, self._mean_service_s * (1 + self.queued) / max(1, self.max_inflight)), 2)

    # ------------------------------------------------------------- admit
    async def admit(self, stages: Iterable[str], priority: int = 0, cost: float = 0.0) -> Ticket:
        """Wait for room (bounded); raises Overloaded when the wait queue is full."""
        t0 = time.perf_counter()
        ticket = Ticket(set(stages), priority, cost, next(self._seq))
        if not self._waiters and self.fits(ticket.stages):
            self._take(ticket)
        else:
            if len(self._waiters) >= self.max_queued:
                raise Overloaded(
                    f"pipeline is full: {self.inflight} requests in flight, {len(self._waiters)} waiting "
                    f"(maxInflight {self.max_inflight}, maxQueued {self.max_queued}"
                    f"{self._busiest()})", self.retry_after())
            w = _Waiter(ticket, asyncio.get_running_loop().create_future())
            self._waiters.append(w)
            self.peak_queued = max(self.peak_queued, len(self._waiters))
            self.poke()  # it may fit now, even behind others that do not
            try:
                await w.future
            except BaseException:
                if w in self._waiters:
                    self._waiters.remove(w)
                elif w.future.done() and not w.future.cancelled():
                    self.release(ticket)  # admitted just as we gave up: hand the room back
                raise
        ticket.admitted_at = time.perf_counter()
        ticket.wait_ms = (ticket.admitted_at - t0) * 1e3
        return ticket

    def release(self, ticket: Ticket, stage: str | None = None) -> None:
        """The request is done with `stage` (or with everything when None)."""
        for s in ([stage] if stage is not None else list(ticket.stages)):
            if s in ticket.stages:
                ticket.stages.discard(s)
                self.committed[s] -= 1
        if not ticket.stages and ticket.seq >= 0:
            ticket.seq = -1  # released for good
            self.inflight -= 1
            if ticket.admitted_at:
                self._mean_service_s = 0.9 * self._mean_service_s + 0.1 * (time.perf_counter() - ticket.admitted_at)
        self.poke()

    def poke(self) -> None:
        """Room may have appeared (a release, a new replica): admit whoever fits, in policy order."""
        if not self._waiters:
            return
        starving = [w for w in self._waiters if w.overtaken >= self.max_overtakes]
        order = sorted(starving or self._waiters, key=self._key)
        if starving:
            order = order[:1]  # the starving one goes next; nobody overtakes it any more
        admitted_seqs = []
        for w in order:
            if self.fits(w.ticket.stages):
                self._waiters.remove(w)
                self._take(w.ticket)
                admitted_seqs.append(w.ticket.seq)
                w.future.set_result(None)
        if admitted_seqs:
            newest = max(admitted_seqs)
            for w in self._waiters:
                if w.ticket.seq < newest:
                    w.overtaken += 1

    # ----------------------------------------------------------- helpers
    def _key(self, w: _Waiter):
        t = w.ticket
        if self.fairness == "ShortestFirst":
            return (-t.priority, t.cost, t.seq)
        return (-t.priority, t.seq)

    def _take(self, ticket: Ticket) -> None:
        self.inflight += 1
        for s in ticket.stages:
            self.committed[s] = self.committed.get(s, 0) + 1
            self.peak_committed[s] = max(self.peak_committed.get(s, 0), self.committed[s])

    def _busiest(self) -> str:
        full = [s for s, n in self.committed.items() if n >= self.capacity(s)]
        return f"; stage {', '.join(sorted(full))} at capacity" if full else ""
