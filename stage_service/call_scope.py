"""One Process call on this stage as an `async with` scope, and the calls running on the stage.

The scope owns what lasts as long as the call: the task that reads the caller's input stream into the
engine, the engine's run within the request's deadline, the call's place among the running calls (so
`Release` can end it), what the data plane holds for the request (freed when the call ends other than
finished), the work units the engine tallied for the request (dropped however the call ends), and the
outcome counted in metrics. An error leaves the scope as a status, made by the
servicer's one mapping (`status_for`), so the servicer only translates between the wire and the scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import grpc

from stage_service import access_log
from stage_service.data_plane import DataPlane
from stage_service.metrics import StageMetrics
from stage_service.runtime.base import Engine, InputChunk, OutputChunk, StageInputs, StageRequest
from stage_service.runtime.errors import CallerGone

log = logging.getLogger("omnistage.stage")

Status = tuple[grpc.StatusCode, str]

# The outcome counted for a call that ended with one of these statuses ("failed" for the rest).
OUTCOMES = {grpc.StatusCode.INVALID_ARGUMENT: "invalid", grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected",
            grpc.StatusCode.DEADLINE_EXCEEDED: "timeout"}


class RequestReleased(Exception):
    """`Release` ended this call: its request ended elsewhere."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        super().__init__(f"request {request_id} was released")


class StageCalls:
    """The Process calls running on this stage: how many, an event set while there are none (for the
    drain), and which request each serves (for Release)."""

    def __init__(self, stage: str, engine: Engine, sources: tuple[str, ...], data_plane: DataPlane,
                 metrics: StageMetrics, status_for: Callable[[BaseException], Status]):
        self.stage, self.engine, self.sources = stage, engine, sources
        self.data_plane, self.metrics, self.status_for = data_plane, metrics, status_for
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._serving: dict[str, set[CallScope]] = {}  # request id -> its calls

    def scope(self) -> CallScope:
        return CallScope(self)

    def release(self, request_id: str) -> None:
        """End every call still running for `request_id`; each answers CANCELLED."""
        for call in list(self._serving.get(request_id, ())):
            call.release()

    def _started(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def _serves(self, call: CallScope) -> None:
        self._serving.setdefault(call.request_id, set()).add(call)

    def _forget(self, call: CallScope) -> None:
        serving = self._serving.get(call.request_id)
        if serving is not None:
            serving.discard(call)
            if not serving:
                del self._serving[call.request_id]

    def _ended(self, call: CallScope) -> None:
        self.metrics.outcome(call.outcome)
        access_log.write(self.stage, call.request_id, call.outcome, call.status[0] if call.status else None,
                         call.queue_s, call.compute_s, time.perf_counter() - call.started, call.units, self.engine.unit)
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()


class CallScope:
    """One Process call, from its header to its status: `async with calls.scope() as call`."""

    def __init__(self, calls: StageCalls):
        self._calls = calls
        self.request_id = ""
        self.outcome = "failed"
        self.status: Status | None = None  # what to answer when the scope ends with an error
        self._task: asyncio.Task | None = None
        self._deadline: asyncio.Timeout | None = None
        self._reader: asyncio.Task | None = None
        self._released = False
        self._sending = False
        self._caller_gone: Callable[[], bool] = lambda: False
        # for its access line: when it began, the engine's queue and compute seconds, the units it made
        self.started = time.perf_counter()
        self.queue_s = self.compute_s = 0.0
        self.units = 0

    async def __aenter__(self) -> CallScope:
        self._task = asyncio.current_task()
        # Around the whole body, in the servicer's frame: a deadline passing while it converts a chunk
        # is a timeout too, not a cancel. No deadline until `run` knows the request.
        self._deadline = asyncio.timeout(None)
        await self._deadline.__aenter__()
        self._calls._started()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        try:
            await self._deadline.__aexit__(exc_type, exc, tb)
        except TimeoutError as e:  # the deadline passed: the cancel it caused is this error
            exc = e
        handled = self._settle(exc)
        calls = self._calls
        calls._forget(self)  # first: a Release from now on finds nothing of this call left to end
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
            self._reader = None  # and with it any error it kept, with its traceback
        if self.outcome != "finished" and self.request_id:
            calls.data_plane.release(self.request_id)  # nobody will fetch what it held
        if self.request_id and self.request_id not in calls._serving:
            # its last chunk took its units; a call that ended otherwise leaves them here, unless another call
            # of the request (a retry back on this replica) is still counting into the same tally
            left = calls.engine.tally.take(self.request_id)   # always taken: never left to leak
            self.units = self.units or left
        calls._ended(self)
        return handled

    def serve(self, request_id: str) -> None:
        """The call serves `request_id` from now on: Release of it ends the call."""
        self.request_id = request_id
        self._calls._serves(self)

    def release(self) -> None:
        """End the call where it stands: it answers CANCELLED (its request ended elsewhere)."""
        self._released = True
        if not self._sending:  # else `sending` ends it when gRPC asks for the next chunk
            self._task.cancel()

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Around the servicer's `yield` of a chunk. gRPC sends the chunk in its own frame, on the servicer's
        task: a cancel landing there (the deadline's, Release's) would end the call with no status at all,
        and leave the caller waiting for its own timeout. So while the chunk is out, neither cancels the
        task; when gRPC asks for the next chunk, the one that came is raised here, in the servicer's frame."""
        when = self._deadline.when()
        self._deadline.reschedule(None)
        self._sending = True
        try:
            yield
        finally:
            self._sending = False
        if self._released:
            raise asyncio.CancelledError  # as the cancel of `release` would have; `_settle` answers it
        if when is not None and when <= asyncio.get_running_loop().time():
            raise TimeoutError  # the deadline passed meanwhile
        self._deadline.reschedule(when)

    async def run(self, req: StageRequest, messages: AsyncIterator[Any],
                  to_input: Callable[[Any], Awaitable[InputChunk]],
                  caller_gone: Callable[[], bool]) -> AsyncIterator[OutputChunk]:
        """The engine's output chunks for `req`, up to its last, within the request's deadline. Its
        input is `messages` (after the header) as `to_input` makes them, read on a task of this scope;
        `caller_gone()` tells a half-close from a caller that went away. Close it (`aclosing`) so the
        engine request ends with it."""
        self._caller_gone = caller_gone
        inputs = StageInputs(self._calls.sources)
        self._reader = asyncio.create_task(self._read(messages, to_input, inputs))
        self._deadline.reschedule(_loop_time(req.deadline))
        gen = self._calls.engine.generate(req, inputs)
        try:
            async for out in gen:
                self.queue_s += out.queue_ms / 1e3
                self.compute_s += out.compute_ms / 1e3
                if out.last:   # before the servicer takes them for the last chunk
                    self.units = self._calls.engine.tally.peek(req.request_id)
                yield out
                if out.last:
                    break
            error = self._input_error()
            if error is not None:
                raise error
        finally:
            await gen.aclose()

    async def _read(self, messages: AsyncIterator[Any], to_input: Callable[[Any], Awaitable[InputChunk]],
                    inputs: StageInputs) -> None:
        try:
            async for msg in messages:
                await inputs.put(await to_input(msg))
            if self._caller_gone():  # the stream ended because the caller went away, not a half-close:
                inputs.fail(CallerGone())  # the engine must stop, not finish on partial input
        except asyncio.CancelledError:
            raise
        except Exception as e:
            inputs.fail(e)
            raise
        finally:
            inputs.close_all()

    def _input_error(self) -> BaseException | None:
        r = self._reader
        return r.exception() if r is not None and r.done() and not r.cancelled() else None

    def _settle(self, exc: BaseException | None) -> bool:
        """Set the outcome and status from how the call ended; True when the error is answered here."""
        if exc is None:
            self.outcome = "cancelled" if self._caller_gone() else "finished"
            return False
        if isinstance(exc, asyncio.CancelledError):
            self.outcome = "cancelled"
            if not self._released:
                return False  # the caller went away (or the server stops): nothing to answer
            # Release ended this call: answer it, rather than leave the caller waiting.
            self._task.uncancel()
            self.status = self._calls.status_for(RequestReleased(self.request_id))
            return True
        if isinstance(exc, (CallerGone, GeneratorExit)):
            self.outcome = "cancelled"  # nobody is left to answer (gRPC closes the call on GeneratorExit)
            return isinstance(exc, CallerGone)
        if not isinstance(exc, Exception):
            return False
        error = self._input_error() or exc  # the input was bad: report that, not its consequence
        self.status = self._calls.status_for(error)
        code = self.status[0]
        self.outcome = OUTCOMES.get(code, "failed")
        if code == grpc.StatusCode.INTERNAL:  # as text: a kept traceback would keep the request's state
            log.error("stage %s: request failed\n%s", self._calls.stage,
                      "".join(traceback.format_exception(error)).rstrip())
        return True


def _loop_time(deadline: float | None) -> float | None:
    """A time.time() deadline on the event loop's clock (None: no deadline)."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.time())
