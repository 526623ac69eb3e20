"""Admission's media check: a request's media parts decoded once, before any stage work, so that a part no
stage could read is INVALID_ARGUMENT naming it rather than a failure deep in a stage.

Decoding runs in a few worker processes the server owns (`media_pool`), within the pipeline's
media_decode_seconds, and keeps one part's pixels at a time (the check keeps nothing it decoded). A decode
that outlives its bound ends its worker, so its slot is free again at the bound; a decoder that crashes
ends only its worker, and the request is INVALID_ARGUMENT. A request's parts are decoded in order in one
call, against its totals (limits.maxRequest*): the first part that passes one ends the call with the refusal,
no later part is decoded, and the worker and its slot are free for the next request. At most `workers`
decodes run at once. A request waits for a free slot at most media_decode_seconds; then it is refused as
overload (RESOURCE_EXHAUSTED, retry after that long), not queued without bound.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from omnistage.api import Limits, Pipeline, accepted_inputs, one_of_each_input
from omnistage.contract.params import InvalidRequest
from omnistage.media import decode_parts
from omnistage.v1 import common_pb2

from .admission import Overloaded
from .media_pool import DecoderCrashed, DecodeTimeout, MediaPool, WorkerStartFailed

DECODE_WORKERS = 4


def check_needed_parts(pipeline: Pipeline, parts: Sequence[common_pb2.ContentPart]) -> None:
    """InvalidRequest unless the request carries exactly one of each part the pipeline needs one of (an
    image-to-video pipeline's reference image): checked before anything is decoded or queued."""
    for kind, stage in one_of_each_input(pipeline).items():
        count = sum(p.WhichOneof("part") == kind for p in parts)
        if count != 1:
            raise InvalidRequest("params.parts", f'"{pipeline.name}" generates from one reference {kind} (its stage '
                                                 f"{stage} reads it): send exactly one {kind} part, got {count}")


class MediaCheck:
    def __init__(self, pipeline: Pipeline, workers: int = DECODE_WORKERS, decode: Callable | None = None):
        """`decode`: what a worker runs on a request's parts, `check_in_worker` unless a test puts a failing
        decoder in its place (a module-level function: it is sent to the worker by name)."""
        self.limits = pipeline.limits
        self._decode = decode or check_in_worker
        self.accepts = accepted_inputs(pipeline)
        self._pool = MediaPool(workers, preload=(self._decode.__module__,))
        # One thread per worker, to wait on it off the event loop.
        self._waiters = ThreadPoolExecutor(workers, thread_name_prefix="media-decode")
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
        wire = [p.SerializeToString() for p in parts]
        decoding = asyncio.get_running_loop().run_in_executor(self._waiters, self._pool.call, bound,
                                                              self._decode, wire, self.limits, self.accepts)
        decoding.add_done_callback(self._decoded)
        try:
            # shielded: a request that goes away leaves its decode to end (within the bound), which frees the slot
            refusal = await asyncio.shield(decoding)
        except DecodeTimeout:
            raise InvalidRequest("params.parts", f"decoding took longer than {bound:g} s") from None
        except DecoderCrashed as e:
            raise InvalidRequest("params.parts", f"cannot decode (the decoder failed on it: exit code "
                                                 f"{e.exitcode})") from None
        except WorkerStartFailed as e:  # the server's, not the request's: retry
            raise Overloaded(f"{e}; retry", retry_after_s=bound) from None
        if refusal is not None:
            raise InvalidRequest(*refusal)
        return (time.perf_counter() - t0) * 1e3

    @property
    def free_slots(self) -> int:
        """Decode slots no request holds (all `workers` when the check is idle)."""
        return self._slots._value

    def live_workers(self) -> int:
        """Idle worker processes that are alive (for tests and diagnostics)."""
        return len(self._pool.pids())

    def _decoded(self, decoding: asyncio.Future) -> None:
        self._slots.release()
        if not decoding.cancelled():
            decoding.exception()  # retrieved: a decode whose request went away is not reported as unhandled

    def close(self) -> None:
        self._waiters.shutdown(wait=False, cancel_futures=True)
        self._pool.close()


def check_in_worker(wire: list[bytes], limits: Limits, accepts: frozenset[str]) -> tuple[str, str] | None:
    """In a decode worker: the parts (serialized) checked; the refusal as (field, message), or None.
    (InvalidRequest itself does not cross the pipe: its constructor takes the two apart.)"""
    parts = [common_pb2.ContentPart.FromString(b) for b in wire]
    try:
        decode_parts(parts, limits, accepts, keep=False)
    except InvalidRequest as e:
        return e.field, str(e)[len(e.field) + 2:]
    return None
