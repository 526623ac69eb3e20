"""Admission's media check: a request's media parts decoded once, before any stage work, so that a part no
stage could read is INVALID_ARGUMENT naming it rather than a failure deep in a stage.

Decoding runs off the event loop in a few threads the server owns, within the pipeline's
media_decode_seconds, and keeps one part's pixels at a time (the check keeps nothing it decoded). A decode
that outlives its bound keeps its thread until it ends (a thread cannot be stopped), and keeps its slot:
at most `workers` decodes run at once. A request waits for a free slot at most media_decode_seconds;
then it is refused as overload (RESOURCE_EXHAUSTED, retry after that long), not queued without bound.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from omnistage.api import Pipeline, accepted_inputs
from omnistage.contract.params import InvalidRequest
from omnistage.media import decode_parts
from omnistage.v1 import common_pb2

from .admission import Overloaded

DECODE_WORKERS = 4


class MediaCheck:
    def __init__(self, pipeline: Pipeline, workers: int = DECODE_WORKERS):
        self.limits = pipeline.limits
        self.accepts = accepted_inputs(pipeline)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="media-decode")
        self._slots = asyncio.Semaphore(workers)

    async def check(self, parts: Sequence[common_pb2.ContentPart]) -> float:
        """Decode `parts`; InvalidRequest when one is refused or decoding takes too long. Returns the
        milliseconds it took, waiting for a slot included."""
        t0 = time.perf_counter()
        bound = self.limits.media_decode_seconds
        try:
            await asyncio.wait_for(self._slots.acquire(), bound)
        except TimeoutError:
            raise Overloaded(f"every media decoder was busy for {bound:g} s", retry_after_s=bound) from None
        decoding = asyncio.get_running_loop().run_in_executor(self._pool, decode_parts, parts, self.limits,
                                                              self.accepts, False)
        decoding.add_done_callback(self._decoded)
        try:
            await asyncio.wait_for(asyncio.shield(decoding), bound)  # shielded: the slot is freed by the thread's end
        except TimeoutError:
            raise InvalidRequest("params.parts", f"decoding took longer than {bound:g} s") from None
        return (time.perf_counter() - t0) * 1e3

    def _decoded(self, decoding: asyncio.Future) -> None:
        self._slots.release()
        if not decoding.cancelled():
            decoding.exception()  # retrieved: a decode whose request went away is not reported as unhandled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
