"""Admission: a bound on requests in flight and a bounded, priority-ordered wait queue."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from typing import AsyncIterator


class Overloaded(RuntimeError):
    def __init__(self, message: str, retry_after_s: float):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class Admission:
    """At most `max_inflight` requests run; up to `max_queued` wait, highest priority first
    (FIFO within a priority); beyond that a request is refused at once with a retry hint."""

    def __init__(self, max_inflight: int, max_queued: int):
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.inflight = 0
        self._waiters: list[tuple[int, int, asyncio.Future]] = []
        self._seq = itertools.count()
        self._mean_service_s = 1.0  # moving average, for the retry hint

    @property
    def queued(self) -> int:
        return sum(1 for *_, f in self._waiters if not f.done())

    def retry_after(self) -> float:
        """Roughly when a slot frees up: the queue ahead divided by the rate slots free at."""
        return round(max(0.1, self._mean_service_s * (1 + self.queued) / max(1, self.max_inflight)), 2)

    @contextlib.asynccontextmanager
    async def admit(self, priority: int = 0) -> AsyncIterator[float]:
        """Hold a slot for the body; yields the time waited (ms)."""
        t0 = time.perf_counter()
        if self.inflight >= self.max_inflight:
            if self.queued >= self.max_queued:
                raise Overloaded(f"pipeline is full: {self.inflight} requests in flight, {self.queued} waiting "
                                 f"(maxInflight {self.max_inflight}, maxQueued {self.max_queued})",
                                 self.retry_after())
            fut = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiters, (-priority, next(self._seq), fut))
            try:
                await fut  # the releaser hands its slot over: inflight stays counted
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._release()  # a slot was handed to us just as we gave up: pass it on
                raise
        else:
            self.inflight += 1
        started = time.perf_counter()
        try:
            yield (started - t0) * 1e3
        finally:
            self._mean_service_s = 0.9 * self._mean_service_s + 0.1 * (time.perf_counter() - started)
            self._release()

    def _release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)
                return
        self.inflight -= 1
