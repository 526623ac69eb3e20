"""The stage's call scope (stage_service/call_scope.py) with a scripted engine, no gRPC and no model:
how each way a call can end is counted and answered, and that every way leaves nothing running."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

import grpc
import pytest

from stage_service.call_scope import StageCalls
from stage_service.metrics import StageMetrics
from stage_service.runtime.base import InputChunk, OutputChunk, StageRequest
from stage_service.runtime.errors import EngineError, InputError
from stage_service.runtime.work_tally import WorkTally
from stage_service.servicer import status_for

from ..polling import wait_until

BAD = "bad"  # a message the wire converter refuses


class ScriptedEngine:
    """Echoes each input chunk's text; `consequence` turns an input error into an error of its own. Its work
    units: one for starting a request and one per chunk echoed."""

    unit = "chunks"

    def __init__(self, consequence: bool = False):
        self.consequence = consequence
        self.started = asyncio.Event()
        self.open_requests = 0
        self.tally = WorkTally()

    async def generate(self, req, inputs):
        self.tally.add(req.request_id)
        self.started.set()
        self.open_requests += 1
        try:
            try:
                async for chunk in inputs.chunks("up"):
                    self.tally.add(req.request_id)
                    yield OutputChunk(text=chunk.text)
            except InputError:
                if self.consequence:
                    raise EngineError("what the engine made of the bad input") from None
                raise
            yield OutputChunk(last=True)
        finally:
            self.open_requests -= 1


class RecordingDataPlane:
    def __init__(self):
        self.released: list[str] = []

    def release(self, request_id: str) -> int:
        self.released.append(request_id)
        return 0


def stage_calls(engine: ScriptedEngine) -> StageCalls:
    return StageCalls("s", engine, ("up",), RecordingDataPlane(), StageMetrics("s"), functools.partial(status_for, "s"))


def outcomes(calls: StageCalls) -> dict[str, int]:
    return {s.labels["outcome"]: int(s.value) for m in calls.metrics.requests.collect() for s in m.samples
            if s.name.endswith("_total") and s.value}


async def messages(items, hold_open: asyncio.Event | None = None):
    for item in items:
        yield item
    if hold_open is not None:
        await hold_open.wait()


async def to_input(msg) -> InputChunk:
    if msg == BAD:
        raise InputError("not a chunk")
    chunk_id, text, last = msg
    return InputChunk(stage="up", chunk_id=chunk_id, tensors={}, text=text, end_of_stream=last)


async def serve(calls: StageCalls, request_id: str, items=(), *, hold_open: asyncio.Event | None = None,
                deadline: float | None = None, caller_gone=lambda: False, per_output=None):
    """What Process does with a scope: returns the scope and the engine's outputs."""
    outputs = []
    async with calls.scope() as call:
        call.serve(request_id)
        req = StageRequest(request_id, params=None, deadline=deadline)
        async with contextlib.aclosing(call.run(req, messages(items, hold_open), to_input, caller_gone)) as run:
            async for out in run:
                outputs.append(out)
                if per_output is not None:
                    await per_output()
    assert asyncio.current_task().cancelling() == 0  # no cancel left pending on the servicer's task
    return call, outputs


async def sent_by_grpc(calls: StageCalls, request_id: str, items=(), *, hold_open: asyncio.Event | None = None,
                       deadline: float | None = None, send=None):
    """What Process does with a scope, driven as gRPC drives it: the servicer is an async generator, and gRPC
    sends each chunk it yields in its own frame (`send(out)`, awaited there, on the same task) before it asks
    for the next. Returns the scope and the chunks sent."""
    scopes, sent = [], []

    async def process():
        async with calls.scope() as call:
            scopes.append(call)
            call.serve(request_id)
            req = StageRequest(request_id, params=None, deadline=deadline)
            async with contextlib.aclosing(call.run(req, messages(items, hold_open), to_input,
                                                    lambda: False)) as run:
                async for out in run:
                    with call.sending():
                        yield out

    async with contextlib.aclosing(process()) as chunks:
        async for out in chunks:
            await send(out)  # a cancel landing here would end the call with no status: gRPC answers nothing
            sent.append(out)
    assert asyncio.current_task().cancelling() == 0
    return scopes[0], sent


async def running(calls: StageCalls, engine: ScriptedEngine, request_id: str) -> asyncio.Task:
    """A call, as a task, whose engine waits for input that never comes."""
    task = asyncio.create_task(serve(calls, request_id, hold_open=asyncio.Event()))
    await wait_until(lambda: engine.started.is_set(), what="engine running")
    assert len(engine.tally) == 1  # its units so far, which the call's end must not leave behind
    return task


async def assert_ends_while_grpc_sends(calls: StageCalls, engine: ScriptedEngine, request_id: str, send,
                                       deadline: float | None, status: tuple, outcome: str) -> None:
    """One chunk, held open after it, driven as gRPC drives it (`sent_by_grpc`), ended while `send` has it:
    the chunk is sent all the same, the call ends with `status` and the engine request with `outcome`."""
    call, sent = await asyncio.wait_for(sent_by_grpc(calls, request_id, [(0, "a", False)], hold_open=asyncio.Event(),
                                                     deadline=deadline, send=send), 10)
    assert [o.text for o in sent] == ["a"]
    assert call.status == status
    assert_ended(calls, engine, outcome, [request_id])


def assert_ended(calls: StageCalls, engine: ScriptedEngine, outcome: str, released: list[str]) -> None:
    """The call was counted as `outcome`, the data plane freed `released`, and nothing runs or is tallied."""
    assert outcomes(calls) == {outcome: 1} and calls.data_plane.released == released
    assert calls.inflight == 0 and calls.idle.is_set() and engine.open_requests == 0
    assert len(engine.tally) == 0  # its work units: carried by its last chunk, or dropped with the call
    assert not calls._serving  # Release finds nothing of an ended call


async def test_a_finished_call_streams_the_engine_outputs_and_frees_nothing_early():
    engine = ScriptedEngine()
    calls = stage_calls(engine)
    call, outputs = await serve(calls, "r1", [(0, "a", False), (1, "b", True)])
    assert [o.text for o in outputs] == ["a", "b", ""] and outputs[-1].last
    assert call.status is None
    assert_ended(calls, engine, "finished", [])  # its consumers still fetch what it sent


async def test_release_ends_the_call_with_cancelled_and_frees_its_data():
    engine = ScriptedEngine()
    calls = stage_calls(engine)
    task = await running(calls, engine, "orphan")
    assert calls.inflight == 1
    calls.release("other")  # another request's Release leaves this call alone
    calls.release("orphan")
    call, outputs = await asyncio.wait_for(task, 10)
    assert outputs == []
    assert call.status == (grpc.StatusCode.CANCELLED, "stage s: request orphan was released")
    assert_ended(calls, engine, "cancelled", ["orphan"])


async def test_bad_input_is_reported_rather_than_what_the_engine_made_of_it():
    engine = ScriptedEngine(consequence=True)
    calls = stage_calls(engine)
    call, _ = await serve(calls, "r1", [(0, "a", False), BAD], hold_open=asyncio.Event())
    assert call.status == (grpc.StatusCode.INVALID_ARGUMENT, "stage s: bad input: not a chunk")
    assert_ended(calls, engine, "invalid", ["r1"])


async def test_a_caller_gone_mid_input_stops_the_engine_without_an_answer():
    engine = ScriptedEngine()
    calls = stage_calls(engine)
    # The input stream ended, but because the caller went away: the engine must not finish on it.
    call, outputs = await serve(calls, "r1", [(0, "a", False)], caller_gone=lambda: True)
    assert not any(o.last for o in outputs)
    assert call.status is None
    assert_ended(calls, engine, "cancelled", ["r1"])


@pytest.mark.parametrize("where", ["engine", "servicer"])
async def test_a_passed_deadline_is_a_timeout_wherever_the_call_waits(where):
    """`engine`: waiting for input inside the engine; `servicer`: converting an output chunk."""
    engine = ScriptedEngine()
    calls = stage_calls(engine)
    stuck = asyncio.Event()
    items = [(0, "a", False)] if where == "servicer" else []
    t0 = time.monotonic()
    call, _ = await asyncio.wait_for(serve(calls, "late", items, hold_open=asyncio.Event(),
                                           deadline=time.time() + 0.3, per_output=stuck.wait), 10)
    assert time.monotonic() - t0 >= 0.25
    assert call.status == (grpc.StatusCode.DEADLINE_EXCEEDED, "stage s: deadline passed")
    assert_ended(calls, engine, "timeout", ["late"])


async def test_a_deadline_passing_while_grpc_sends_a_chunk_is_answered_as_a_timeout():
    """The deadline passes while the chunk is in gRPC's hands, outside the servicer's frame: the call still
    ends with DEADLINE_EXCEEDED (from the servicer, when gRPC asks for the next chunk), not with a cancel
    of gRPC's send that leaves the caller without any status."""
    engine = ScriptedEngine()
    calls = stage_calls(engine)
    deadline = time.time() + 1.0

    async def slow_send(out):  # until the deadline has passed
        await wait_until(lambda: time.time() > deadline + 0.05, 10, 0.01, what="deadline passed")

    await assert_ends_while_grpc_sends(calls, engine, "late", slow_send, deadline,
                                       (grpc.StatusCode.DEADLINE_EXCEEDED, "stage s: deadline passed"), "timeout")


async def test_release_while_grpc_sends_a_chunk_ends_the_call_with_cancelled():
    engine = ScriptedEngine()
    calls = stage_calls(engine)

    async def send(out):
        calls.release("orphan")  # comes while gRPC still sends the chunk
        await asyncio.sleep(0.05)

    await assert_ends_while_grpc_sends(calls, engine, "orphan", send, None,
                                       (grpc.StatusCode.CANCELLED, "stage s: request orphan was released"), "cancelled")


async def test_a_cancel_from_outside_propagates_and_ends_the_engine_request():
    engine = ScriptedEngine()
    calls = stage_calls(engine)
    task = await running(calls, engine, "r1")
    task.cancel()  # the caller went away, or the server stops: nothing to answer
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_ended(calls, engine, "cancelled", ["r1"])


async def test_an_engine_failure_is_internal_and_logged_with_its_traceback(caplog):
    engine = ScriptedEngine()
    calls = stage_calls(engine)

    async def broken(req, inputs):
        raise EngineError("device lost")
        yield  # an async generator, as engines are

    engine.generate = broken
    with caplog.at_level(logging.ERROR, logger="omnistage.stage"):
        call, _ = await serve(calls, "r1", [(0, "a", True)])
    assert call.status == (grpc.StatusCode.INTERNAL, "stage s: engine failed (device lost)")
    assert "stage s: request failed" in caplog.text and "EngineError: device lost" in caplog.text
    assert_ended(calls, engine, "failed", ["r1"])


async def test_a_bad_header_is_answered_without_a_request_to_free():
    engine = ScriptedEngine()
    calls = stage_calls(engine)
    async with calls.scope() as call:
        raise InputError("no header")  # what the servicer raises before `serve`
    assert call.status[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert_ended(calls, engine, "invalid", [])


async def test_a_call_that_ends_while_a_retry_of_its_request_runs_here_leaves_the_retrys_units():
    """A retry that came back to this replica while the old call still ends: the old call takes nothing of
    the request's tally, so the retry's last chunk carries the work done here; the last call to end drops
    what is left."""
    engine = ScriptedEngine()
    calls = stage_calls(engine)
    old = await running(calls, engine, "r1")
    engine.started.clear()
    retry = asyncio.create_task(serve(calls, "r1", hold_open=asyncio.Event()))
    await wait_until(lambda: engine.started.is_set(), what="the retry running")
    old.cancel()
    await asyncio.gather(old, return_exceptions=True)
    assert len(engine.tally) == 1  # the request's units, still counting for the retry
    retry.cancel()
    await asyncio.gather(retry, return_exceptions=True)
    assert len(engine.tally) == 0 and not calls._serving
