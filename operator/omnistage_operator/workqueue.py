"""A de-duplicating work queue of pipelines to reconcile, as in controller-runtime: a watch event
of a pipeline or of any of its children adds the pipeline once; one pipeline is never reconciled by
two workers at once (an event during a pass runs it again after); failures back off; every known
pipeline is reconciled again every resync period. Reconciles are blocking (the Kubernetes client),
so workers run them in threads."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable, Hashable

import kopf

if TYPE_CHECKING:
    from .metrics import OperatorMetrics

log = logging.getLogger("omnistage.operator")

BACKOFF_BASE, BACKOFF_MAX = 0.5, 60.0


class WorkQueue:
    def __init__(self) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._queued: set = set()
        self._active: set = set()
        self._dirty: set = set()
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._failures: dict[Hashable, int] = {}
        self.known: set = set()

    def add(self, key: Hashable) -> None:
        self.known.add(key)
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def add_after(self, key: Hashable, delay: float) -> None:
        """Add later; an earlier pending add wins over a later one."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        old = self._timers.get(key)
        if old is not None and old.when() <= due:
            return
        if old is not None:
            old.cancel()
        self._timers[key] = loop.call_at(due, self._fire, key)

    def forget(self, key: Hashable) -> None:
        """The pipeline is gone: no resync, no pending retry."""
        self.known.discard(key)
        self._failures.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer:
            timer.cancel()

    def _fire(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def get(self) -> Hashable:
        key = await self._queue.get()
        self._queued.discard(key)
        self._active.add(key)
        return key

    def done(self, key: Hashable) -> None:
        self._active.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def backoff(self, key: Hashable) -> float:
        n = self._failures.get(key, 0)
        self._failures[key] = n + 1
        return min(BACKOFF_BASE * 2 ** n, BACKOFF_MAX)

    def succeeded(self, key: Hashable) -> None:
        self._failures.pop(key, None)

    def pending(self) -> int:
        return len(self._queued) + len(self._active) + len(self._timers)

    def queued(self) -> int:
        """Keys waiting for a worker."""
        return len(self._queued)

    def active(self) -> int:
        """Keys being reconciled now."""
        return len(self._active)

    def delayed(self) -> int:
        """Keys due later (add_after)."""
        return len(self._timers)


async def worker(queue: WorkQueue, reconcile: Callable, name: str, active: asyncio.Event | None = None,
                 metrics: OperatorMetrics | None = None) -> None:
    """Take keys forever; `reconcile(*key)` returns an object with `requeue_after` (or raises). With `active`,
    only while it is set (this replica leads, leadership.py): a standby keeps its keys queued. Each pass is
    counted in `metrics` by its result (metrics.RESULTS)."""
    while True:
        if active is not None:
            await active.wait()
        key = await queue.get()
        if active is not None and not active.is_set():  # led no more while it waited for a key: put it back
            queue.done(key)
            queue.add(key)
            continue
        result, t0 = None, time.monotonic()   # None: cancelled (the worker stops), not counted
        try:
            outcome = await asyncio.to_thread(reconcile, *key)
            result = "ok"
            queue.succeeded(key)
            log.info("reconciled %s/%s in %.2fs: %d writes%s", *key, time.monotonic() - t0,
                     getattr(outcome, "writes", 0),
                     f", again in {outcome.requeue_after:.0f}s" if getattr(outcome, "requeue_after", None) else "")
            if getattr(outcome, "gone", False):
                queue.forget(key)
            elif outcome is not None and outcome.requeue_after:
                queue.add_after(key, outcome.requeue_after)
        except kopf.PermanentError as e:
            result = "invalid"
            queue.succeeded(key)    # nothing to retry until the object changes (its event adds it again)
            log.info("%s: %s", name, e)
        except kopf.TemporaryError as e:
            result = "waiting"
            log.info("%s: %s/%s: %s (again in %.0fs)", name, *key, e, e.delay or 0)
            queue.add_after(key, e.delay if e.delay is not None else queue.backoff(key))
        except Exception:
            result = "error"
            delay = queue.backoff(key)
            log.exception("%s: reconcile of %s/%s failed; again in %.1fs", name, *key, delay)
            queue.add_after(key, delay)
        finally:
            queue.done(key)
            if metrics is not None and result is not None:
                metrics.reconciled(result, time.monotonic() - t0)


async def resync(queue: WorkQueue, period: float) -> None:
    while True:
        await asyncio.sleep(period)
        for key in list(queue.known):
            queue.add(key)
