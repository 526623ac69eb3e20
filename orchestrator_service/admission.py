"""Admission and backpressure: which requests may enter the pipeline now.

A request is admitted when fewer than `maxInflight` requests run and every
stage it needs has a backlog (requests dispatched to it and not done there,
plus requests already in flight waiting for a slot on it) below its capacity
(the sum over its ready replicas of what each says it can hold). So when a slow
stage's backlog is full, new requests wait here instead of piling intermediate
results in front of it, and requests already in flight get its free slots
first. Dispatch itself never sends a replica more than it holds (routing
waits for room). The wait queue is bounded; beyond it a request is refused at
once with a retry hint.

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
    """One admitted request's place in the pipeline."""

    stages: set[str]
    priority: int
    cost: float
    seq: int
    admitted_at: float = 0.0
    wait_ms: float = 0.0
    pending: bool = False  # admitted, not yet dispatched to a stage


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
    backlog: Callable[[str], int] = lambda stage: 0  # how many it holds or has waiting for it
    fairness: str = "InFlightFirst"
    max_overtakes: int = 64
    inflight: int = 0
    pending: dict[str, int] = field(default_factory=dict)  # admitted, not yet at a stage

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
            self.backlog(s) + self.pending.get(s, 0) < self.capacity(s) for s in stages)

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

    def arrived(self, ticket: Ticket) -> None:
        """The request has been dispatched: stage backlogs count it from now on."""
        if ticket.pending:
            ticket.pending = False
            for s in ticket.stages:
                self.pending[s] -= 1

    def release(self, ticket: Ticket) -> None:
        """The request has left the pipeline (finished, failed or cancelled)."""
        self.arrived(ticket)
        if ticket.seq >= 0:
            ticket.seq = -1
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
            if w.future.done():  # its caller gave up (a deadline, a cancel) and has not yet run its cleanup
                self._waiters.remove(w)
                continue
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
        ticket.pending = True
        for s in ticket.stages:  # counted against its stages until it gets there
            self.pending[s] = self.pending.get(s, 0) + 1

    def _busiest(self) -> str:
        stages = {s for w in self._waiters for s in w.ticket.stages}
        full = [s for s in stages if self.backlog(s) >= self.capacity(s)]
        return f"; stage {', '.join(sorted(full))} at capacity" if full else ""
