"""Media work beside a stage's step loop: decoding, the processor and the encoders of requests with media
parts run on the stage's own few threads (not the event loop, not the step loop's worker thread).

Bounded like the step scheduler: at most `workers` run at once, and at most the scheduler's queue room
wait for a thread; beyond that a request is refused as the scheduler refuses one (RESOURCE_EXHAUSTED,
the stage is full), never queued without bound. A request cancelled while it waits leaves the queue; one
cancelled while its work runs lets that work finish on its thread and drops the result.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from stage_service.runtime.errors import EngineOverloaded

T = TypeVar("T")
WORKERS = 2


class MediaWork:
    def __init__(self, stage: str, max_waiting: int, workers: int = WORKERS):
        self.stage, self.workers, self.max_waiting = stage, workers, max_waiting
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"{stage}-media")
        self.pending = 0  # running or waiting for a thread

    async def run(self, fn: Callable[..., T], *args) -> T:
        if self.pending >= self.workers + self.max_waiting:
            raise EngineOverloaded(f"stage {self.stage}: {self.pending} media requests in the encoders "
                                   f"({self.workers} at once, {self.max_waiting} waiting at most)")
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
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
