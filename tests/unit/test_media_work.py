"""Bounded media work: the stage's media threads and the orchestrator's decode slots refuse, rather than
queue without bound, what they cannot start in time."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from omnistage.client import image_part
from omnistage.contract.params import InvalidRequest
from orchestrator_service.admission import Overloaded
from orchestrator_service.media_check import MediaCheck
from stage_service.runtime.errors import EngineOverloaded, RequestFailed
from stage_service.runtime.media_work import MediaWork

from ..harness import example
from ..media_builders import png
from ..polling import wait_until


async def test_media_work_refuses_beyond_its_threads_and_queue_room():
    work = MediaWork("thinker", max_waiting=1, workers=1)
    gate = threading.Event()
    try:
        running = asyncio.create_task(work.run(gate.wait, 10))
        waiting = asyncio.create_task(work.run(gate.wait, 10))
        await asyncio.sleep(0.05)
        assert work.pending == 2
        with pytest.raises(EngineOverloaded, match="stage thinker: 2 media requests in the encoders"):
            await work.run(gate.wait, 10)
        waiting.cancel()  # a request that goes away while it waits leaves the queue
        await asyncio.gather(waiting, return_exceptions=True)
        assert work.pending == 1
        gate.set()
        assert await running is True and work.pending == 0
        assert await work.run(lambda x: x * 2, 21) == 42
    finally:
        gate.set()
        work.close()


async def test_media_work_keeps_its_bound_after_requests_cancelled_while_their_work_runs():
    work = MediaWork("thinker", max_waiting=1, workers=1)
    gate, started = threading.Event(), threading.Event()

    def held() -> bool:
        started.set()
        return gate.wait(30)
    try:
        running = asyncio.create_task(work.run(held))
        await wait_until(started.is_set)
        running.cancel()  # its request goes away; its work runs on, on the one thread
        await asyncio.gather(running, return_exceptions=True)
        assert work.pending == 1
        waiting = [asyncio.create_task(work.run(held))]
        await wait_until(lambda: work.pending == 2)
        for _ in range(3):  # cancelled after admission, each time: the count follows the work, not the request
            with pytest.raises(EngineOverloaded, match="stage thinker: 2 media requests in the encoders"):
                await work.run(held)
        waiting[0].cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await wait_until(lambda: work.pending == 1)  # the queued work left the queue with its request
        assert work._pool._work_queue.qsize() <= work.max_waiting
        gate.set()
        await wait_until(lambda: work.pending == 0)  # the running work ended: its thread is free
        assert await work.run(lambda x: x * 2, 21) == 42
    finally:
        gate.set()
        work.close()


async def test_media_work_that_runs_past_its_bound_fails_the_request_and_stays_counted():
    work = MediaWork("thinker", max_waiting=0, workers=1, work_seconds=0.5)
    gate = threading.Event()
    try:
        with pytest.raises(RequestFailed, match="stage thinker: media work took longer than 0.5 s"):
            await work.run(gate.wait, 30)
        assert work.pending == 1  # its thread is still busy: no more is admitted than there are threads
        with pytest.raises(EngineOverloaded):
            await work.run(gate.wait, 30)
        gate.set()
        await wait_until(lambda: work.pending == 0)
    finally:
        gate.set()
        work.close()


def big_png() -> bytes:
    return png(np.random.default_rng(0).integers(0, 256, (1800, 1800, 3), dtype=np.uint8))


async def test_a_request_that_cannot_get_a_decode_slot_in_time_is_overload_not_a_queue():
    pipeline = example("qwen3-omni-tiny", lambda d: d["spec"]["topology"].setdefault("limits", {}).update(
        mediaDecodeSeconds=0.01))
    check = MediaCheck(pipeline, workers=1)
    try:
        part = [image_part(big_png())]  # decoding it takes far longer than 10 ms
        first, second = await asyncio.gather(check.check(part), check.check(part), return_exceptions=True)
        assert isinstance(first, InvalidRequest) and str(first) == "params.parts: decoding took longer than 0.01 s"
        assert isinstance(second, Overloaded) and second.retry_after_s == 0.01
        assert str(second) == "every media decoder was busy for 0.01 s"
    finally:
        check.close()
