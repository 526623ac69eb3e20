"""Watching jobs on this replica: one store read per watched job each poll, shared by all of its watchers (the
gRPC Watch calls and /events streams of that job), and at most `most` watchers at once.

A feed polls its job while it has watchers and ends when the job is finished, gone or nobody watches; each
watcher is told the snapshots in which the job's status or progress changed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import AsyncGenerator, Awaitable, Callable

import grpc

from ..servicer import Refused
from .store import FINISHED, Job

log = logging.getLogger("omnistage.orchestrator.jobs")
# Watchers one replica holds at once (each an open HTTP stream or gRPC call, with its own buffers): well above what
# clients of a pipeline that runs a few jobs at a time watch, and low enough that streams opened without end cannot
# hold the replica's connections. Past it a watch is refused (429 / RESOURCE_EXHAUSTED): poll the job instead.
MOST_WATCHERS = 256
# A watcher refused for the cap is told to retry after this long: watches end as their jobs finish.
WATCHERS_RETRY_AFTER_S = 5.0

Read = Callable[[str, str], Awaitable[Job]]


@dataclass
class _Feed:
    """One watched job: the latest snapshot (or the refusal that ended it), numbered so watchers see each once."""

    job: Job
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    version: int = 0
    ended: Refused | None = None
    watchers: int = 0
    task: asyncio.Task | None = None


class Watches:
    """`read(job_id, owner)`: the job now (Refused when gone or unreachable); `poll_s()`: how long between reads."""

    def __init__(self, read: Read, poll_s: Callable[[], float], most: int = MOST_WATCHERS):
        self.read, self.poll_s, self.most = read, poll_s, most
        self.watchers = 0
        self.feeds: dict[tuple[str, str], _Feed] = {}

    async def watch(self, job_id: str, owner: str) -> AsyncGenerator[Job, None]:
        """The job now, then each time its status or progress changes, until it is finished (Refused when it is
        gone, the store is unreachable, or this replica holds `most` watchers)."""
        if self.watchers >= self.most:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"this orchestrator holds {self.most} watches already (the most it keeps open); retry "
                          f"after {WATCHERS_RETRY_AFTER_S:.0f}s or poll the video instead",
                          retry_after_s=WATCHERS_RETRY_AFTER_S)
        self.watchers += 1
        key = (owner, job_id)
        feed: _Feed | None = None
        try:
            job = await self.read(job_id, owner)
            yield job
            if job.status in FINISHED:
                return
            feed = self._join(key, job)
            seen, version = (job.status, job.progress), feed.version
            while True:
                async with feed.changed:
                    await feed.changed.wait_for(lambda: feed.version != version)
                version = feed.version
                if feed.ended is not None:
                    raise feed.ended
                job = feed.job
                if (job.status, job.progress) != seen:
                    seen = (job.status, job.progress)
                    yield job
                if job.status in FINISHED:
                    return
        finally:
            self.watchers -= 1
            if feed is not None:
                feed.watchers -= 1
                if feed.watchers == 0:
                    if self.feeds.get(key) is feed:
                        del self.feeds[key]
                    if feed.task is not None:
                        feed.task.cancel()

    def _join(self, key: tuple[str, str], job: Job) -> _Feed:
        feed = self.feeds.get(key)
        if feed is None or feed.task is None or feed.task.done():
            feed = self.feeds[key] = _Feed(job)
            feed.task = asyncio.create_task(self._poll(key, feed), name=f"job-watch-{key[1]}")
        feed.watchers += 1
        return feed

    async def _poll(self, key: tuple[str, str], feed: _Feed) -> None:
        owner, job_id = key
        while True:
            await asyncio.sleep(self.poll_s())
            try:
                job, ended = await self.read(job_id, owner), None
            except Refused as e:
                job, ended = feed.job, e
            except Exception:  # its watchers are told, not left waiting on a feed that stopped
                log.exception("jobs: watching %s failed", job_id)
                job, ended = feed.job, Refused(grpc.StatusCode.INTERNAL, "the video could not be read (see the "
                                                                         "orchestrator's log)")
            async with feed.changed:
                feed.job, feed.ended = job, ended
                feed.version += 1
                feed.changed.notify_all()
            if ended is not None or job.status in FINISHED:
                with contextlib.suppress(KeyError):
                    if self.feeds[key] is feed:
                        del self.feeds[key]
                return
