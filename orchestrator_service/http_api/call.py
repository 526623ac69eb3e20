"""The call scope: one HTTP request's run down the orchestrator's request path, as an object with a
lifetime.

A task iterates `servicer.generate` into a bounded queue; the handler reads the events from it. Leaving
the scope (answer complete, a stop string, an error, the client gone) cancels the task and waits for
it: the cancel runs through the request's run, which cancels every stage call and releases what the
stages hold, before the handler returns. A watcher task reads the connection's ASGI `receive` for
`http.disconnect` and cancels the run the moment the client goes, whether or not anything is being
sent (uvicorn drops what is sent to a closed connection without a word, so a sender would not notice).

A deadline (the `X-Request-Timeout` header) goes down the request path with the request (each stage
call gets the time left) and is kept here too: past it, the reader gets DEADLINE_EXCEEDED even while the
request is still waiting for admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable, Mapping

import grpc
from starlette.datastructures import Headers

from omnistage.contract.params import InvalidRequest
from omnistage.v1 import orchestrator_pb2

from .. import access_log, otel
from ..servicer import Refused
from .errors import from_exception

log = logging.getLogger("omnistage.orchestrator.http_api")
REQUEST_TIMEOUT_HEADER = "X-Request-Timeout"
MAX_TIMEOUT_S = 24 * 3600.0
MAX_BUFFERED_EVENTS = 16  # events the run may be ahead of the client; then it waits (backpressure)
_END = object()


class ClientGone(Exception):
    """The client went away: nothing more is sent."""


def deadline_from(headers: Headers) -> float | None:
    """time.time() seconds by which the request must finish, from `X-Request-Timeout: SECONDS`."""
    raw = headers.get(REQUEST_TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise InvalidRequest(REQUEST_TIMEOUT_HEADER, f"must be seconds, more than 0 and at most {MAX_TIMEOUT_S:.0f}"
                                                     f", got {raw!r}")
    return time.time() + seconds


class Call:
    """`async with Call(...) as call: async for event in call: ...`; failures come out as ApiError (with
    `fields`, the translation's field map, naming the OpenAI field), a client gone as ClientGone."""

    def __init__(self, servicer, request: orchestrator_pb2.GenerateRequest, fields: Mapping[str, str] = {}, *,
                 deadline: float | None = None, receive: Callable[[], Awaitable[dict]] | None = None,
                 max_buffered: int = MAX_BUFFERED_EVENTS, client: str | None = None,
                 incoming: otel.Incoming | None = None):
        self.request_id = uuid.uuid4().hex  # the server's id (the response names it); request_id: the client's label
        self.deadline = deadline
        self._servicer, self._request, self._fields, self._receive = servicer, request, fields, receive
        self._client = client  # who sent it, for the per-client cap (client_cap.py)
        self._incoming = incoming  # its door and trace context, for its span
        self._queue: asyncio.Queue = asyncio.Queue(max_buffered)
        self._run_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._peeked: list = []
        self._ended = False

    async def __aenter__(self) -> "Call":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def start(self) -> None:
        self._run_task = asyncio.create_task(self._run(), name=f"http-call-{self.request_id}")
        if self._receive is not None:
            self._watch_task = asyncio.create_task(self._watch(), name=f"http-watch-{self.request_id}")

    async def open(self) -> orchestrator_pb2.GenerateResponse | None:
        """For a streamed response (which owns the call from then on): start, and wait for the first
        event; a failure closes the call and is raised, so that it becomes the response's status."""
        self.start()
        try:
            return await self.first()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Cancel the run (a no-op when it finished) and wait until it has unwound."""
        tasks = [t for t in (self._watch_task, self._run_task) if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if self._run_task is not None and self._run_task.cancelled():
            # A run cancelled before its first step never ran its own wake-up: a reader waiting on it would
            # wait for ever.
            self._wake_reader(ClientGone())
        for t in tasks:  # retrieved here, or asyncio reports them at garbage collection
            if not t.cancelled() and t.exception() is not None:
                # The run hands its failures to the reader, so this is the watcher (a broken `receive`): the
                # run is over either way, and the answer stands.
                log.warning("HTTP API: %s failed", t.get_name(), exc_info=t.exception())

    # ------------------------------------------------------------------ reading
    async def first(self) -> orchestrator_pb2.GenerateResponse | None:
        """The first event, still to come in iteration: a refusal (bad input, overload, no replica)
        comes out here, before a response is started."""
        if not self._peeked:
            self._peeked.append(await self.next())
        return self._peeked[0]

    async def next(self) -> orchestrator_pb2.GenerateResponse | None:
        """The next event; None once the answer is complete."""
        if self._peeked:
            return self._peeked.pop()
        if self._ended:
            return None
        left = None if self.deadline is None else self.deadline - time.time()
        try:
            async with asyncio.timeout(left):
                item = await self._queue.get()
        except TimeoutError:
            raise from_exception(Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request did not finish within "
                                         f"its {REQUEST_TIMEOUT_HEADER}")) from None
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        return item

    async def __aiter__(self) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        while (ev := await self.next()) is not None:
            yield ev

    # ------------------------------------------------------------------- tasks
    async def _run(self) -> None:
        try:
            try:
                events = access_log.observed(self._servicer.generate(
                    self._request, self.deadline, self.request_id, client=self._client, incoming=self._incoming),
                    self.request_id)
                async with contextlib.aclosing(events):
                    async for ev in events:
                        await self._queue.put(ev)
                item = _END
            except Exception as e:  # noqa: BLE001 - any failure reaches the reader as its answer; from_exception logs faults
                item = from_exception(e, self._fields)
            await self._queue.put(item)
        except asyncio.CancelledError:
            self._wake_reader(ClientGone())
            raise

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._run_task.cancel()

    def _wake_reader(self, item) -> None:
        """The run was cancelled: the reader, possibly waiting, gets `item` (undelivered events go nowhere)."""
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(item)


async def run_all(calls: list[Call], each: Callable[[Call], Awaitable]) -> list:
    """`each(call)` for every call at once (each within its own scope), in order; the first failure
    cancels the others and is raised."""
    async def one(call: Call):
        async with call:
            return await each(call)

    tasks = [asyncio.create_task(one(c)) for c in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)
    failed = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
    if failed:
        raise failed[0]
    return [t.result() for t in tasks]
