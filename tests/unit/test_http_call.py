"""The HTTP call scope (orchestrator_service/http_api/call.py) over a scripted request path, no server:
events flow through a bounded queue, refusals come out mapped, and every way a call ends (client gone,
deadline, scope left early, a sibling failing) unwinds the request path's generator."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from starlette.datastructures import Headers

from omnistage.contract.params import InvalidRequest
from omnistage.v1 import orchestrator_pb2
from orchestrator_service.api_keys import ApiKeys
from orchestrator_service.client_cap import CLIENT_FLOOR, ClientCap
from orchestrator_service.http_api import images
from orchestrator_service.http_api.call import Call, ClientGone, deadline_from, run_all
from orchestrator_service.http_api.errors import ApiError
from orchestrator_service.servicer import Refused

from ..polling import wait_until


def text(t: str) -> orchestrator_pb2.GenerateResponse:
    return orchestrator_pb2.GenerateResponse(text=orchestrator_pb2.TextDelta(text=t))


class ScriptedPath:
    """`generate` as the servicer's: yields `events`, then raises `fail` or waits forever (`hang`); its
    `finally` is the request path unwinding (where the real one cancels every stage call)."""

    def __init__(self, events=(), fail: BaseException | None = None, hang: bool = False):
        self.events, self.fail, self.hang = list(events), fail, hang
        self.api_keys = ApiKeys()  # the servicer's client keys: none, no key needed
        self.client_cap = ClientCap(CLIENT_FLOOR)  # the servicer's per-client cap (and trusted proxies: none)
        self.voices = None  # the servicer's voices: none read (the cards list none)
        self.unwound = asyncio.Event()
        self.deadline = None
        self.yielded = 0

    async def generate(self, request, deadline=None, request_id=None, client=None, incoming=None):
        self.deadline = deadline
        self.request_id = request_id
        try:
            for ev in self.events:
                yield ev
                self.yielded += 1
            if self.fail is not None:
                raise self.fail
            if self.hang:
                await asyncio.Event().wait()
        finally:
            self.unwound.set()


def request() -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest()


async def read_all(call: Call) -> list[str]:
    return [ev.text.text async for ev in call]


async def test_events_flow_in_order_and_the_call_gets_an_id():
    path = ScriptedPath([text(str(i)) for i in range(50)])
    async with Call(path, request(), max_buffered=2) as call:
        assert len(call.request_id) == 32
        assert await read_all(call) == [str(i) for i in range(50)]
        assert await call.next() is None
    assert path.unwound.is_set()


async def test_the_first_event_is_kept_for_iteration():
    async with Call(ScriptedPath([text("a"), text("b")]), request()) as call:
        assert (await call.first()).text.text == "a"
        assert await read_all(call) == ["a", "b"]


async def test_a_refusal_comes_out_mapped_to_the_openai_field():
    path = ScriptedPath(fail=Refused(grpc.StatusCode.INVALID_ARGUMENT, "params.text.max_tokens: too many",
                                     param="params.text.max_tokens"))
    call = Call(path, request(), {"params.text.max_tokens": "max_completion_tokens"})
    with pytest.raises(ApiError) as e:
        await call.open()
    assert (e.value.status, e.value.param) == (400, "max_completion_tokens")
    assert path.unwound.is_set()


async def test_a_fault_in_the_path_is_a_500_without_its_text():
    async with Call(ScriptedPath([text("a")], fail=RuntimeError("secret")), request()) as call:
        with pytest.raises(ApiError) as e:
            await read_all(call)
    assert e.value.status == 500 and "secret" not in e.value.message


async def test_the_client_going_away_cancels_the_run_even_while_nothing_is_read():
    gone = asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    path = ScriptedPath([text("a")], hang=True)
    async with Call(path, request(), receive=receive) as call:
        assert (await call.next()).text.text == "a"
        gone.set()
        await wait_until(path.unwound.is_set, what="request path unwound")
        with pytest.raises(ClientGone):
            await call.next()


async def test_leaving_the_scope_unwinds_a_run_blocked_on_a_full_queue():
    path = ScriptedPath([text(str(i)) for i in range(10)], hang=True)
    async with Call(path, request(), max_buffered=1) as call:
        await call.first()
        await wait_until(lambda: path.yielded == 2, what="the run waiting on a full queue")
    assert path.unwound.is_set()  # closed in the scope's exit, not left for the garbage collector


async def test_a_passed_deadline_is_504_even_before_admission_answers():
    path = ScriptedPath(hang=True)
    deadline = time.time() + 0.05
    async with Call(path, request(), deadline=deadline) as call:
        with pytest.raises(ApiError) as e:
            await call.next()
        assert path.deadline == deadline  # it went down the request path too
    assert e.value.status == 504 and path.unwound.is_set()


async def test_a_failing_watcher_is_logged_and_the_answer_stands(caplog):
    async def receive():
        raise RuntimeError("receive broke")

    async with Call(ScriptedPath([text("a")]), request(), receive=receive) as call:
        assert await read_all(call) == ["a"]
    assert [r.exc_info[1].args for r in caplog.records if r.exc_info] == [("receive broke",)]


async def test_run_all_cancels_the_others_when_one_fails():
    slow, failing = ScriptedPath(hang=True), ScriptedPath(fail=Refused(grpc.StatusCode.UNAVAILABLE, "stage x down",
                                                                       stage="x"))
    with pytest.raises(ApiError) as e:
        await run_all([Call(slow, request()), Call(failing, request())], read_all)
    assert e.value.status == 503 and slow.unwound.is_set() and failing.unwound.is_set()
    assert await run_all([Call(ScriptedPath([text("a")]), request()), Call(ScriptedPath([text("b")]), request())],
                         read_all) == [["a"], ["b"]]


async def test_images_without_an_image_are_a_server_error_not_an_empty_picture():
    image = orchestrator_pb2.GenerateResponse(image=orchestrator_pb2.ImageOutput(png=b"png", width=8, height=8))
    made = await images.generate([Call(ScriptedPath([image]), request())])
    assert made["data"] == [{"b64_json": "cG5n"}] and made["size"] == "8x8" and "omnistage_trace" not in made
    with pytest.raises(ApiError) as e:
        await images.generate([Call(ScriptedPath([image]), request()), Call(ScriptedPath([text("a")]), request())])
    assert e.value.status == 500 and "produced no image" in e.value.message


@pytest.mark.parametrize("value,ok", [("2.5", True), ("30", True), ("0", False), ("-1", False), ("soon", False),
                                      ("nan", False), ("inf", False), ("1e9", False)])
def test_the_timeout_header(value, ok):
    headers = Headers({"x-request-timeout": value})
    if ok:
        assert deadline_from(headers) == pytest.approx(time.time() + float(value), abs=1)
    else:
        with pytest.raises(InvalidRequest) as e:
            deadline_from(headers)
        assert e.value.field == "X-Request-Timeout"
    assert deadline_from(Headers({})) is None


async def test_a_close_before_the_run_took_its_first_step_still_ends_a_waiting_reader():
    """A realtime `response.cancel` right behind its `response.create`: the run is cancelled before it ever
    ran, so its own wake-up never runs; the reader must not wait for ever."""
    call = Call(ScriptedPath(hang=True), request())
    call.start()
    reader = asyncio.create_task(call.next())
    await call.close()   # cancels the run before its first step
    with pytest.raises(ClientGone):
        await asyncio.wait_for(reader, 30)   # a safety bound only: the reader is woken at once
