"""The Realtime API (`/v1/realtime`) driven by the official `openai` SDK's `client.realtime.connect()`
against an in-process orchestrator over the tiny Qwen3-Omni pipeline: a session's events, audio in and an
answer's audio and transcript out, text out, cancels and barge-in through every stage, server VAD, API keys,
and, over raw `websockets`, frames the SDK cannot send (garbage, out of order, faster than real time): each
an `error` event, the connection still usable, nothing held after it closes."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import socket

import pytest
import websockets

from omnistage import logs
from orchestrator_service.http_api.realtime.limits import MAX_FRAME_BYTES

from ..harness import start_stage
from ..media_builders import speech_like
from ..polling import wait_until
from .test_http_api import KEYS, OMNI, Served, serve

RATE = 24000
SAFETY_S = 120  # a generous bound on any one wait: a stuck server fails the test instead of hanging it


def vowel(seconds: float) -> bytes:
    return speech_like(seconds)


def silence(seconds: float) -> bytes:
    return bytes(int(seconds * RATE) * 2)


def b64(pcm: bytes) -> str:
    return base64.b64encode(pcm).decode()


@pytest.fixture(scope="module")
async def served(model_dir):
    stages = {n: await start_stage(OMNI, n, model_dir) for n in ("thinker", "talker", "code2wav")}
    out = {"omni": await serve(OMNI, stages), "keyed": await serve(OMNI, stages, api_keys=KEYS),
           "broken": await serve(OMNI, stages)}
    out["broken"].orc.router.set_endpoints("talker", [])  # its Talker's replicas gone
    yield out
    for s in out.values():
        await s.orc.drain()
    for s in stages.values():
        await s.drain()


def ws_url(s: Served, model: str | None = None) -> str:
    return f"ws://127.0.0.1:{s.orc.api_port}/v1/realtime?model={model or s.model}"


async def recv_until(conn, *types: str) -> list:
    """Events up to and including the first of `types`."""
    seen = []
    async with asyncio.timeout(SAFETY_S):
        while True:
            event = await conn.recv()
            seen.append(event)
            if event.type in types:
                return seen


async def raw_until(ws, *types: str) -> list[dict]:
    seen = []
    async with asyncio.timeout(SAFETY_S):
        while True:
            event = json.loads(await ws.recv())
            seen.append(event)
            if event["type"] in types:
                return seen


def door_idle(s: Served) -> bool:
    api = s.orc.api
    return api is not None and api.door.total == 0 and api.gate.in_progress == 0


async def until_closed_and_idle(s: Served) -> None:
    await s.until_idle()
    await wait_until(lambda: door_idle(s), 30, 0.05, what="no connection counted in the door or the gate",
                     detail=lambda: (s.orc.api.door.total, s.orc.api.gate.in_progress))


# --------------------------------------------------------------------------- the SDK


async def test_a_session_is_created_then_updated_as_asked(served):
    s = served["omni"]
    async with s.aio().realtime.connect(model=s.model) as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        assert created.session.model == s.model and created.session.audio.input.turn_detection.type == "server_vad"
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                           "output_modalities": ["text"],
                                           "audio": {"input": {"turn_detection": None,
                                                               "format": {"type": "audio/pcm", "rate": 24000}}}})
        updated = await conn.recv()
        assert updated.type == "session.updated"
        assert updated.session.instructions == "Be brief." and updated.session.output_modalities == ["text"]
        assert updated.session.audio.input.turn_detection is None


async def test_committed_audio_is_answered_with_audio_and_its_transcript(served):
    s = served["omni"]
    async with s.aio().realtime.connect(model=s.model) as conn:
        await recv_until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "instructions": "You are a helpful assistant.",
                                           "max_output_tokens": 8, "audio": {"input": {"turn_detection": None}}})
        await recv_until(conn, "session.updated")
        speech = vowel(1.0)
        for at in range(0, len(speech), 9600):
            await conn.input_audio_buffer.append(audio=b64(speech[at:at + 9600]))
        await conn.input_audio_buffer.commit()
        committed = await recv_until(conn, "input_audio_buffer.committed")
        user_item = committed[-1].item_id
        await conn.response.create()
        events = await recv_until(conn, "response.done")
    types = [e.type for e in events]
    assert types[:2] == ["conversation.item.added", "conversation.item.done"]
    assert types[2] == "response.created"
    assert types.index("response.output_item.added") < types.index("response.content_part.added") < \
        types.index("response.output_audio.delta") < types.index("response.output_audio.done") < \
        types.index("response.content_part.done") < types.index("response.output_item.done") < \
        types.index("response.done")
    assert events[0].item.id == user_item and events[0].item.content[0].type == "input_audio"
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    assert len(audio) > 0 and len(audio) % 2 == 0
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    done = next(e for e in events if e.type == "response.output_audio_transcript.done")
    assert done.transcript == transcript
    response = events[-1].response
    assert response.status in ("completed", "incomplete")
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 0
    assert response.output[0].role == "assistant" and response.output[0].content[0].transcript == transcript
    await s.until_idle()


async def test_a_second_turn_answers_the_whole_conversation_in_text(served):
    s = served["omni"]
    async with s.aio().realtime.connect(model=s.model) as conn:
        await recv_until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                           "max_output_tokens": 6, "audio": {"input": {"turn_detection": None}}})
        await recv_until(conn, "session.updated")
        prompt_tokens = []
        for text in ("Hello there.", "And again?"):
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": text}]})
            await conn.response.create()
            events = await recv_until(conn, "response.done")
            types = [e.type for e in events]
            assert "response.output_audio.delta" not in types
            assert events[-1].response.status in ("completed", "incomplete"), events[-1].response.status_details
            text_out = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert next(e for e in events if e.type == "response.output_text.done").text == text_out
            prompt_tokens.append(events[-1].response.usage.input_tokens)
        # The second request carried the first turn and its answer before its own: its prompt is the longer.
        assert prompt_tokens[1] > prompt_tokens[0] + 3
    await s.until_idle()


async def test_a_second_response_while_one_runs_is_an_error_and_cancel_stops_it_everywhere(served):
    s = served["omni"]
    async with s.aio().realtime.connect(model=s.model) as conn:
        await recv_until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 256,
                                           "audio": {"input": {"turn_detection": None}}})
        await recv_until(conn, "session.updated")
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "a long answer"}]})
        await conn.response.create()
        await recv_until(conn, "response.created")
        await conn.response.create()
        error = (await recv_until(conn, "error"))[-1]
        assert error.error.code == "conversation_already_has_active_response"
        await recv_until(conn, "response.output_audio_transcript.delta", "response.output_audio.delta")
        await conn.response.cancel()
        done = (await recv_until(conn, "response.done"))[-1]
        assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"
        await s.until_idle()  # the cancel ran through every stage
        await conn.response.cancel()  # nothing to cancel now
        assert (await recv_until(conn, "error"))[-1].error.code == "response_cancel_not_active"


async def test_server_vad_commits_on_silence_answers_and_barge_in_cancels_the_answer(served):
    s = served["omni"]
    async with s.aio().realtime.connect(model=s.model) as conn:
        await recv_until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 256, "audio": {"input": {
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 300, "prefix_padding_ms": 100}}}})
        await recv_until(conn, "session.updated")
        for pcm in (silence(0.5), vowel(0.6), silence(0.6)):
            await conn.input_audio_buffer.append(audio=b64(pcm))
        events = await recv_until(conn, "response.created")
        types = [e.type for e in events]
        assert types.index("input_audio_buffer.speech_started") < types.index("input_audio_buffer.speech_stopped") \
            < types.index("input_audio_buffer.committed") < types.index("response.created")
        started = next(e for e in events if e.type == "input_audio_buffer.speech_started")
        stopped = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
        committed = next(e for e in events if e.type == "input_audio_buffer.committed")
        assert started.item_id == stopped.item_id == committed.item_id
        assert 300 <= started.audio_start_ms <= 700 and stopped.audio_end_ms > started.audio_start_ms
        await recv_until(conn, "response.output_audio.delta")  # the user hears the answer
        await conn.input_audio_buffer.append(audio=b64(vowel(0.3)))  # and speaks over it
        events = await recv_until(conn, "response.done")
        assert "input_audio_buffer.speech_started" in [e.type for e in events]
        assert events[-1].response.status == "cancelled" and events[-1].response.status_details.reason == \
            "turn_detected"
        await s.until_idle()  # cancelled through every stage, the session still open
        # What the user heard of the interrupted answer: its transcript goes, as the reference does.
        answer = next(o for o in events[-1].response.output if o.type == "message")
        assert answer.status == "incomplete" and answer.content[0].transcript
        await conn.conversation.item.truncate(item_id=answer.id, content_index=0, audio_end_ms=10 ** 6)
        assert (await recv_until(conn, "error"))[-1].error.param == "audio_end_ms"
        await conn.conversation.item.truncate(item_id=answer.id, content_index=0, audio_end_ms=0)
        truncated = (await recv_until(conn, "conversation.item.truncated"))[-1]
        assert (truncated.item_id, truncated.audio_end_ms) == (answer.id, 0)
        await conn.conversation.item.retrieve(item_id=answer.id)
        retrieved = (await recv_until(conn, "conversation.item.retrieved"))[-1]
        assert retrieved.item.content[0].transcript == ""
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await recv_until(conn, "session.updated")
    await until_closed_and_idle(s)


async def test_two_turns_in_one_append_are_two_turns_each_committed_with_its_own_audio(served):
    s = served["omni"]
    async with s.aio().realtime.connect(model=s.model) as conn:
        await recv_until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
            "type": "server_vad", "silence_duration_ms": 300, "prefix_padding_ms": 100, "create_response": False}}}})
        await recv_until(conn, "session.updated")
        await conn.input_audio_buffer.append(audio=b64(silence(0.5) + vowel(0.6) + silence(0.6) + vowel(0.6) +
                                                       silence(0.6)))
        first = await recv_until(conn, "input_audio_buffer.committed")
        second = await recv_until(conn, "input_audio_buffer.committed")
        for events in (first, second):   # each turn: started, stopped, committed, once, under one item id
            kinds = [e.type for e in events if e.type.startswith("input_audio_buffer.")]
            assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed"]
            assert len({e.item_id for e in events if e.type.startswith("input_audio_buffer.")}) == 1
        ends = [next(e for e in events if e.type == "input_audio_buffer.speech_stopped").audio_end_ms
                for events in (first, second)]
        starts = [next(e for e in events if e.type == "input_audio_buffer.speech_started").audio_start_ms
                  for events in (first, second)]
        assert starts[0] < ends[0] < starts[1] < ends[1]
        assert first[-1].item_id != second[-1].item_id
    await until_closed_and_idle(s)


async def test_api_keys_are_required_on_the_handshake(served):
    keyed = served["keyed"]
    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        async with keyed.aio(api_key="wrong").realtime.connect(model=keyed.model) as conn:
            await conn.recv()
    assert e.value.response.status_code == 401
    assert json.loads(e.value.response.body)["error"]["code"] == "invalid_api_key"
    async with keyed.aio(api_key=KEYS[0]).realtime.connect(model=keyed.model) as conn:
        assert (await conn.recv()).type == "session.created"


async def test_a_web_page_of_another_origin_cannot_open_a_session(served):
    """Browsers apply no CORS to WebSockets: a page on any site could otherwise talk to a loopback API."""
    s = served["omni"]
    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        async with websockets.connect(ws_url(s, s.model), origin="https://attacker.example"):
            pass
    assert e.value.response.status_code == 403
    assert json.loads(e.value.response.body)["error"]["code"] == "origin_not_allowed"
    host = ws_url(s, s.model).split("/")[2]
    async with websockets.connect(ws_url(s, s.model), origin=f"http://{host}") as conn:   # the API's own origin
        assert json.loads(await conn.recv())["type"] == "session.created"
    await until_closed_and_idle(s)


async def test_an_unknown_model_is_refused_at_the_handshake(served):
    s = served["omni"]
    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        async with websockets.connect(ws_url(s, "gpt-realtime")):
            pass
    assert e.value.response.status_code == 404
    assert json.loads(e.value.response.body)["error"]["code"] == "model_not_found"


# --------------------------------------------------------------------------- raw frames

GARBAGE = [
    ("not json", "invalid_json", None),
    ("[1, 2]", "invalid_json", None),
    (json.dumps({"type": "no.such.event", "event_id": "e1"}), "invalid_value", "type"),
    (json.dumps({"event_id": "e2"}), "missing_required_parameter", "type"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": 5}), "invalid_type", "audio"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "!!not base64"}), "invalid_value", "audio"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": b64(b"\x01\x02\x03")}), "invalid_value", "audio"),
    (json.dumps({"type": "session.update", "session": {"instructions": ["x"]}}), "invalid_type",
     "session.instructions"),
    (json.dumps({"type": "session.update", "session": {"bogus": 1}}), "unknown_parameter", "session.bogus"),
    (json.dumps({"type": "session.update", "session": {"max_output_tokens": 100_000}}), "invalid_value",
     "session.max_output_tokens"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}}),
     "unsupported_value", "session.audio.input.format.type"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "semantic_vad"}}}}}), "unsupported_value", "session.audio.input.turn_detection.type"),
    (json.dumps({"type": "session.update", "session": {"tools": [{"type": "function", "name": "f",
                                                                  "parameters": {"type": 12}}]}}),
     "invalid_value", "session.tools[0].parameters"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "nope",
                                                              "output": "{}"}}), "invalid_value", "item.call_id"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                              "content": [{"type": "output_text", "text": "x"}]}}),
     "invalid_value", "item.content[0].type"),
    (json.dumps({"type": "session.update", "session": {"audio": {"output": {"voice": "nobody"}}}}), "invalid_value",
     "session.audio.output.voice"),
    (json.dumps({"type": "input_audio_buffer.commit", "event_id": "c1"}), "input_audio_buffer_commit_empty", None),
    (json.dumps({"type": "response.cancel"}), "response_cancel_not_active", None),
    (json.dumps({"type": "response.create"}), "invalid_value", None),  # nothing to answer yet
    (json.dumps({"type": "conversation.item.delete", "item_id": "item_x"}), "item_not_found", "item_id"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (1 << 20)}), "event_too_large", None),
]


async def test_garbage_and_events_out_of_order_are_error_events_and_the_connection_stays_usable(served):
    s = served["omni"]
    async with websockets.connect(ws_url(s), max_size=None) as ws:
        await raw_until(ws, "session.created")
        for frame, code, param in GARBAGE:
            await ws.send(frame)
            error = (await raw_until(ws, "error"))[-1]["error"]
            assert (error["code"], error["param"]) == (code, param), (frame[:80], error)
            assert error["type"] == "invalid_request_error" and error["message"]
        await ws.send(b"\x00\x01binary")
        assert (await raw_until(ws, "error"))[-1]["error"]["code"] == "invalid_frame"
        await ws.send(json.dumps({"type": "input_audio_buffer.commit", "event_id": "mine"}))
        assert (await raw_until(ws, "error"))[-1]["error"]["event_id"] == "mine"
        await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "still here"}}))
        updated = (await raw_until(ws, "session.updated"))[-1]
        assert updated["session"]["instructions"] == "still here"
    await until_closed_and_idle(s)


async def test_audio_faster_than_real_time_past_the_bound_is_refused_and_the_buffer_stays_bounded(served):
    s = served["omni"]
    bound_s = min(60.0, s.orc.pipeline.limits.max_audio_seconds)
    piece = silence(8.0)  # 8 s an event: 512 KiB of base64, within the event bound
    async with websockets.connect(ws_url(s), max_size=None) as ws:
        await raw_until(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}))
        await raw_until(ws, "session.updated")
        fits = int(bound_s // 8)
        for _ in range(fits + 2):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(piece)}))
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        events = await raw_until(ws, "input_audio_buffer.cleared")
        errors = [e["error"] for e in events if e["type"] == "error"]
        assert [e["code"] for e in errors] == ["input_audio_buffer_full"] * 2
        assert f"at most {bound_s:g} s" in errors[0]["message"]
    await until_closed_and_idle(s)


async def test_a_client_that_leaves_mid_answer_leaves_nothing_held(served):
    s = served["omni"]
    for _ in range(3):
        ws = await websockets.connect(ws_url(s), max_size=None)
        await raw_until(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {"max_output_tokens": 256}}))
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "a long answer"}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        await raw_until(ws, "response.output_audio.delta", "response.output_audio_transcript.delta")
        await ws.close()
    await until_closed_and_idle(s)


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def test_a_forced_function_call_streams_its_arguments_and_its_output_is_answered(served):
    s = served["omni"]
    async with s.aio().realtime.connect(model=s.model) as conn:
        await recv_until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 12,
                                           "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"},
                                           "audio": {"input": {"turn_detection": None}}})
        await recv_until(conn, "session.updated")
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Weather in Paris?"}]})
        await conn.response.create()
        error = (await recv_until(conn, "error"))[-1].error
        assert error.param == "tool_choice.name" and "get_weather" in error.message
        # The call forced: the model writes its arguments (a random model: whatever it writes, as it writes it).
        await conn.response.create(response={"tool_choice": {"type": "function", "name": "get_weather"},
                                             "parallel_tool_calls": False})
        events = await recv_until(conn, "response.done")
        added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
        assert added.item.name == "get_weather" and added.item.call_id.startswith("call_")
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert done.arguments == deltas and done.name == "get_weather" and done.call_id == added.item.call_id
        item_done = next(e for e in events if e.type == "response.output_item.done" and e.item.type == "function_call")
        assert item_done.item.status == "completed" and item_done.item.arguments == deltas
        call = next(o for o in events[-1].response.output if o.type == "function_call")
        assert call.call_id == added.item.call_id
        # The function's output fed back: the next answer reads the call and its result as turns.
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                  "output": json.dumps({"temperature_c": 21})})
        await recv_until(conn, "conversation.item.done")
        await conn.response.create(response={"tool_choice": "none"})
        events = await recv_until(conn, "response.done")
        assert events[-1].response.status in ("completed", "incomplete"), events[-1].response.status_details
        assert all(e.type != "response.function_call_arguments.delta" for e in events)
    await s.until_idle()


async def test_websockets_count_in_the_door_and_the_gate_as_connections_and_requests(served):
    s = served["omni"]
    api = s.orc.api
    door_limits, gate_limit = api.door.limits, api.gate.limit
    try:
        api.door.limits = dataclasses.replace(door_limits, max_per_address=2)
        open_ = [await websockets.connect(ws_url(s)) for _ in range(2)]
        for ws in open_:
            await raw_until(ws, "session.created")
        assert api.door.total == 2 and api.gate.in_progress == 2
        with pytest.raises(websockets.exceptions.InvalidStatus) as e:  # a third from the same address
            await websockets.connect(ws_url(s))
        assert e.value.response.status_code == 429
        api.door.limits = door_limits
        api.gate.limit = 2
        with pytest.raises(websockets.exceptions.InvalidStatus) as e:  # the gate: as many requests as it takes
            await websockets.connect(ws_url(s))
        assert e.value.response.status_code == 429
        for ws in open_:
            await ws.close()
    finally:
        api.door.limits, api.gate.limit = door_limits, gate_limit
    await until_closed_and_idle(s)


async def test_a_message_past_the_frame_bound_closes_the_connection_and_frees_it(served):
    s = served["omni"]
    async with websockets.connect(ws_url(s), max_size=None) as ws:
        await raw_until(ws, "session.created")
        await ws.send("x" * (MAX_FRAME_BYTES + 1))
        with pytest.raises(websockets.exceptions.ConnectionClosed) as e:
            await raw_until(ws, "error")
    assert e.value.rcvd is not None and e.value.rcvd.code == 1009
    await until_closed_and_idle(s)


async def test_a_session_is_one_access_line_with_its_responses_ids_and_usage(served):
    keyed = served["keyed"]
    access = logging.getLogger(logs.ACCESS_LOGGER)
    records: list[logging.LogRecord] = []
    handler, level = logging.Handler(logging.INFO), access.level
    handler.emit = records.append  # type: ignore[method-assign]
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        async with keyed.aio(api_key=KEYS[1]).realtime.connect(model=keyed.model) as conn:
            await recv_until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                               "max_output_tokens": 4, "audio": {"input": {"turn_detection": None}}})
            for text in ("one", "two"):
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": text}]})
                await conn.response.create()
                await recv_until(conn, "response.done")
        await until_closed_and_idle(keyed)
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    lines = [r.__dict__ for r in records if getattr(r, "door", None) == "http"]
    assert len(lines) == 1
    line = lines[0]
    assert (line["status"], line["http_status"], line["api_key"]) == ("OK", 101, "key-1")
    assert len(line["request_id"].split()) == 2 and line["tokens_out"] > 0


def text_frame(payload: dict) -> bytes:
    """A client's masked WebSocket text frame (RFC 6455)."""
    data = json.dumps(payload).encode()
    mask = bytes([1, 2, 3, 4])
    size = bytes([0x80 | len(data)]) if len(data) < 126 else bytes([0x80 | 126]) + len(data).to_bytes(2, "big")
    return bytes([0x81]) + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


async def test_a_client_that_stops_reading_an_answer_is_cut_and_its_answer_cancelled(served):
    s = served["omni"]
    api = s.orc.api
    limits = api.door.limits
    loop = asyncio.get_running_loop()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        api.door.limits = dataclasses.replace(limits, send_window_s=0.5)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # what it does not read stays in the server
        client.setblocking(False)
        await loop.sock_connect(client, ("127.0.0.1", s.orc.api_port))
        await loop.sock_sendall(client, (f"GET /v1/realtime?model={s.model} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                         "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                                         "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n").encode())
        head = b""
        async with asyncio.timeout(SAFETY_S):
            while b"\r\n\r\n" not in head:
                head += await loop.sock_recv(client, 1)
        assert head.startswith(b"HTTP/1.1 101")

        def server_side():
            return next((c for c in api._server.server_state.connections
                         if c.transport.get_extra_info("peername") == client.getsockname()), None)

        conn = await wait_until(server_side, 30, 0.05, what="the WebSocket on the server")
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        for event in ({"type": "session.update", "session": {"max_output_tokens": 256,
                                                             "audio": {"input": {"turn_detection": None}}}},
                      {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                          {"type": "input_text", "text": "a long answer"}]}},
                      {"type": "response.create"}):
            await loop.sock_sendall(client, text_frame(event))
        await wait_until(lambda: not conn.writable.is_set(), SAFETY_S, 0.05, what="the answer held by the server")
        await wait_until(lambda: server_side() is None, SAFETY_S, 0.05, what="the stalled WebSocket cut")
    finally:
        client.close()
        api.door.limits = limits
    await until_closed_and_idle(s)


async def test_a_refused_response_is_an_error_event_and_a_failed_response_and_the_session_goes_on(served):
    s = served["broken"]
    async with s.aio().realtime.connect(model=s.model) as conn:
        await recv_until(conn, "session.created")
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "hello"}]})
        await conn.response.create()
        events = await recv_until(conn, "response.done")
        error = next(e for e in events if e.type == "error").error
        assert error.code == "stage_unavailable" and "talker" in error.message
        done = events[-1].response
        assert done.status == "failed" and done.status_details.error.code == "stage_unavailable"
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})  # the Thinker alone
        await recv_until(conn, "session.updated")
        await conn.response.create()
        assert (await recv_until(conn, "response.done"))[-1].response.status in ("completed", "incomplete")
    await until_closed_and_idle(s)
