"""Media work beside a stage's step loop: decoding, the processor and the encoders of requests with media
parts run on the stage's own few threads (not the event loop, not the step loop's worker thread).

Bounded like the step scheduler: at most `workers` run at once, and at most the scheduler's queue room
wait for a thread; beyond that a request is refused as the scheduler refuses one (RESOURCE_EXHAUSTED,
the stage is full), never queued without bound. A request cancelled while it waits leaves the queue; one
cancelled while its work runs lets that work finish on its thread and drops the result, and that work
counts against the bound until its thread is free again (counted by the work's end, not the request's).
A request whose work runs past WORK_SECONDS fails (its thread, which cannot be stopped, stays counted).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from stage_service.runtime.errors import EngineOverloaded, RequestFailed

T = TypeVar("T")
WORKERS = 2
# Bound on one request's media work (decode, processor, encoder): far above a healthy encode of the largest
# parts the limits admit, it ends the wait of a request whose processor or decoder hangs.
WORK_SECONDS = 300.0


class MediaWork:
    def __init__(self, stage: str, max_waiting: int, workers: int = WORKERS, work_seconds: float = WORK_SECONDS):
        self.stage, self.workers, self.max_waiting, self.work_seconds = stage, workers, max_waiting, work_seconds
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"{stage}-media")
        self.pending = 0  # running or waiting for a thread: changed on the event loop only

    async def run(self, fn: Callable[..., T], *args) -> T:
        if self.pending >= self.workers + self.max_waiting:
            raise EngineOverloaded(f"stage {self.stage}: {self.pending} media requests in the encoders "
                                   f"({self.workers} at once, {self.max_waiting} waiting at most)")
        loop = asyncio.get_running_loop()
        work = self._pool.submit(fn, *args)
        self.pending += 1
        # Counted down when the work ends (or leaves the queue), on the loop: not when its request goes away.
        work.add_done_callback(lambda _: self._ended_on(loop))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(work), self.work_seconds)
        except TimeoutError:
            raise RequestFailed(f"stage {self.stage}: media work took longer than {self.work_seconds:g} s") from None

    def _ended_on(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._ended)
        except RuntimeError:  # the loop is closed: the stage is gone, and its count with it
            pass

    def _ended(self) -> None:
        self.pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class MediaStage:
    """Mixed into a stepped engine that takes media: its media threads (`self.media`, bounded by the
    scheduler's queue room), closed at shutdown."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.media = MediaWork(self.stage.name, self.settings.scheduler.max_queued)

    async def shutdown(self) -> None:
        self.media.close()
        await super().shutdown()
