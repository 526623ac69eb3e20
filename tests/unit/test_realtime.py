"""The Realtime API's pure parts: turn detection on synthetic speech and silence, the input audio buffer's
bound, client events checked, the conversation's bounds and its turns, the session's refusals, output audio
brought to 24 kHz."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omnistage.api import Limits
from omnistage.contract import conversation
from omnistage.v1 import common_pb2, orchestrator_pb2
from orchestrator_service.http_api.realtime import events as ev
from orchestrator_service.http_api.realtime import items
from orchestrator_service.http_api.realtime.audio_buffer import AudioBuffer
from orchestrator_service.http_api.realtime.events import RealtimeError
from orchestrator_service.http_api.realtime.limits import MAX_ITEMS, SessionLimits
from orchestrator_service.http_api.realtime.runner import to_24k
from orchestrator_service.http_api.realtime.session import SessionConfig, Vad
from orchestrator_service.http_api.realtime.vad import (
    FRAME_BYTES,
    FRAME_MS,
    Segmenter,
    SpeechStarted,
    SpeechStopped,
    mode_of,
    webrtc_classifier,
)

from ..media_builders import speech_like

RATE = 24000


def vowel(seconds: float) -> bytes:
    return speech_like(seconds)


def silence(seconds: float) -> bytes:
    return bytes(int(seconds * RATE) * 2)


def hiss(seconds: float, level: float = 20.0) -> bytes:
    return np.random.default_rng(1).normal(0, level, int(seconds * RATE)).astype("<i2").tobytes()


# --------------------------------------------------------------------------- VAD

def test_speech_between_silences_is_one_turn_at_its_times():
    seg = Segmenter(500, webrtc_classifier(0.5))
    turns = seg.feed(silence(0.6) + vowel(1.2) + silence(1.0))
    assert [type(t) for t in turns] == [SpeechStarted, SpeechStopped]
    assert abs(turns[0].audio_start_ms - 600) <= 3 * FRAME_MS
    assert abs(turns[1].audio_end_ms - 1800) <= 3 * FRAME_MS


def test_the_turns_do_not_depend_on_how_the_audio_is_cut():
    audio = silence(0.3) + vowel(0.8) + silence(0.7) + vowel(0.5) + silence(0.8)
    whole = Segmenter(400, webrtc_classifier(0.5)).feed(audio)
    seg = Segmenter(400, webrtc_classifier(0.5))
    pieces = []
    for at in range(0, len(audio), 1234):  # odd sizes: frames straddle the appends
        pieces += seg.feed(audio[at:at + 1234])
    assert pieces == whole and len(whole) == 4


@pytest.mark.parametrize("audio", [silence(2.0), hiss(2.0)], ids=["digital silence", "low hiss"])
def test_silence_and_hiss_are_never_speech(audio):
    assert Segmenter(300, webrtc_classifier(0.0)).feed(audio) == []


SCRIPT = [  # frames as speech (1) or not (0), and the turns a 90 ms start and 150 ms stop make of them
    ("0000", []),
    ("11000", []),  # two speech frames: shorter than the start
    ("1110000", ["start@0"]),  # three: a turn starts where they began; silence shorter than the stop
    ("11100000", ["start@0", "stop@90"]),  # five silent frames: it stops where the speech ended
    ("0111101111100000", ["start@30", "stop@330"]),  # a gap shorter than the stop is inside the turn
]


@pytest.mark.parametrize("frames,expected", SCRIPT)
def test_the_segmenter_starts_and_stops_on_runs_of_frames(frames, expected):
    marks = iter(frames)
    seg = Segmenter(150, lambda frame: next(marks) == "1", start_ms=90)
    got = [f"start@{t.audio_start_ms}" if isinstance(t, SpeechStarted) else f"stop@{t.audio_end_ms}"
           for t in seg.feed(bytes(FRAME_BYTES * len(frames)))]
    assert got == expected


def test_threshold_maps_onto_the_aggressiveness_levels():
    assert [mode_of(t) for t in (0.0, 0.3, 0.5, 0.8, 1.0)] == [0, 1, 2, 3, 3]


# --------------------------------------------------------------------------- input audio buffer

def test_an_append_past_the_bound_is_refused_whole_and_the_buffer_keeps_what_it_had():
    buf = AudioBuffer(max_seconds=1.0)
    buf.append(silence(0.75))
    with pytest.raises(RealtimeError) as e:
        buf.append(silence(0.5))
    assert e.value.code == "input_audio_buffer_full"
    assert len(buf) == int(0.75 * RATE) * 2
    buf.append(silence(0.25))  # exactly to the bound
    assert len(buf) == RATE * 2


def test_dropping_silence_before_speech_keeps_the_buffer_in_session_time():
    buf = AudioBuffer(max_seconds=10.0)
    buf.append(silence(2.0))
    buf.keep_last(300)
    assert (buf.start_ms, buf.end_ms) == (1700, 2000)
    assert len(buf.take()) == int(0.3 * RATE) * 2 and buf.start_ms == 2000 and len(buf) == 0


# --------------------------------------------------------------------------- client events

@pytest.mark.parametrize("text,code,param", [
    ("{", "invalid_json", None),
    ('"a string"', "invalid_json", None),
    ('{"type": 3}', "invalid_type", "type"),
    ('{"type": "response.start"}', "invalid_value", "type"),
    ('{"type": "response.cancel", "response_id": 7}', "invalid_type", "response_id"),
    ('{"type": "input_audio_buffer.commit", "extra": 1}', "unknown_parameter", "extra"),
    ('{"type": "input_audio_buffer.append"}', "missing_required_parameter", "audio"),
    ('{"type": "session.update", "session": {"max_output_tokens": "lots"}}', "invalid_type",
     "session.max_output_tokens"),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "robot", "content": []}}',
     "invalid_value", "item.role"),
])
def test_a_bad_event_is_refused_naming_the_field(text, code, param):
    with pytest.raises(RealtimeError) as e:
        ev.parse({"type": "websocket.receive", "text": text})
    assert (e.value.code, e.value.param) == (code, param), e.value.message


def test_a_refused_event_keeps_its_event_id_for_the_error():
    with pytest.raises(RealtimeError) as e:
        ev.parse({"type": "websocket.receive", "text": '{"type": "nope", "event_id": "evt_1"}'})
    error = ev.error_event(e.value)
    assert error["type"] == "error" and error["error"]["event_id"] == "evt_1" and error["event_id"] != "evt_1"


def test_a_binary_message_is_refused():
    with pytest.raises(RealtimeError) as e:
        ev.parse({"type": "websocket.receive", "bytes": b"{}"})
    assert e.value.code == "invalid_frame"


# --------------------------------------------------------------------------- conversation

LIMITS = SessionLimits.of(Limits(max_parts=8, max_audio_seconds=4.0))


def user_text(text: str) -> items.Item:
    return items.of_client(ev.MessageItem(type="message", role="user",
                                          content=[ev.Content(type="input_text", text=text)]))


def test_the_oldest_items_go_when_the_media_parts_bound_is_reached():
    conv = items.Conversation(LIMITS)
    spoken = [items.user_audio(b"\x01\x00" * 2400) for _ in range(8)]   # 0.1 s each: maxParts 8 of media
    for item in spoken:
        assert conv.add(item)[1] == []
    _, dropped = conv.add(items.user_audio(b"\x01\x00" * 2400))
    assert dropped == [spoken[0].id] and len(conv.items) == 8


def test_text_items_are_bounded_by_characters_not_by_max_parts():
    conv = items.Conversation(LIMITS)
    added = [user_text(str(i)) for i in range(40)]   # five times maxParts: text is not media
    assert all(conv.add(item)[1] == [] for item in added)
    assert len(conv.items) == 40


def test_an_empty_text_is_refused_when_the_item_is_made_and_an_empty_tool_output_is_taken():
    with pytest.raises(RealtimeError) as e:
        user_text("")
    assert e.value.param == "item.content[0].text"
    out = items.of_client(ev.FunctionCallOutputItem(type="function_call_output", call_id="c1", output=""))
    assert out.parts == []


def test_the_items_bound_holds_for_items_without_parts():
    conv = items.Conversation(SessionLimits(buffered_audio_s=1, items=3, parts=100, audio_s=10, chars=1000))
    for i in range(5):
        conv.add(items.Item(f"item_{i}", "function_call", call_id=f"c{i}", name="f"))
    assert [i.id for i in conv.items] == ["item_2", "item_3", "item_4"]
    assert LIMITS.items == MAX_ITEMS


def test_audio_seconds_are_bounded_and_a_dropped_call_takes_its_output():
    conv = items.Conversation(LIMITS)
    conv.add(items.Item("call", "function_call", call_id="c1", name="f", arguments="{}"))
    conv.add(items.of_client(ev.FunctionCallOutputItem(type="function_call_output", call_id="c1", output="42")))
    conv.add(items.user_audio(silence(2.5)))
    _, dropped = conv.add(items.user_audio(silence(1.0)))  # 3.5 s: within 4 s, nothing dropped
    assert dropped == []
    _, dropped = conv.add(items.user_audio(silence(1.0)))  # 4.5 s: the oldest go until it fits
    assert dropped[:1] == ["call"] and len(dropped) == 3  # the call, its output, the 2.5 s of audio
    with pytest.raises(RealtimeError):
        conv.add(items.user_audio(silence(5.0)))  # alone past the bound


def test_an_output_must_answer_a_call_in_the_conversation():
    conv = items.Conversation(LIMITS)
    with pytest.raises(RealtimeError) as e:
        conv.add(items.of_client(ev.FunctionCallOutputItem(type="function_call_output", call_id="x", output="")))
    assert e.value.param == "item.call_id"


def test_the_conversation_becomes_turns_the_request_path_accepts():
    conv = items.Conversation(LIMITS)
    conv.add(user_text("weather?"))
    conv.add(items.assistant_message("item_a", "let me look", audio=True))
    conv.add(items.Item("item_c1", "function_call", call_id="c1", name="get_weather", arguments='{"city":"P"}'))
    conv.add(items.Item("item_c2", "function_call", call_id="c2", name="get_time", arguments="{}"))
    conv.add(items.of_client(ev.FunctionCallOutputItem(type="function_call_output", call_id="c1", output="21")))
    conv.add(items.of_client(ev.FunctionCallOutputItem(type="function_call_output", call_id="c2", output="noon")))
    conv.add(items.user_audio(vowel(0.2)))
    parts, turns = conv.turns("Be brief.")
    assert [(t.role, t.parts, [c.name for c in t.tool_calls], t.tool_call_id) for t in turns] == [
        ("system", 1, [], ""), ("user", 1, [], ""), ("assistant", 1, ["get_weather", "get_time"], ""),
        ("tool", 1, [], "c1"), ("tool", 1, [], "c2"), ("user", 1, [], "")]
    assert parts[-1].audio.sample_rate == RATE and parts[0].text == "Be brief."
    params = common_pb2.GenerationParams(parts=parts, turns=turns)
    conversation.check(params, max_chars=10_000)  # the request path's own check passes


# --------------------------------------------------------------------------- session

CONFIG = SessionConfig("sess_1", "m", ("text", "audio"), token_bound=512)


@pytest.mark.parametrize("session,param", [
    ({"audio": {"input": {"format": {"type": "audio/pcma"}}}}, "session.audio.input.format.type"),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.output.format.rate"),
    ({"audio": {"output": {"speed": 1.5}}}, "session.audio.output.speed"),
    ({"audio": {"input": {"transcription": {"model": "whisper-1"}}}}, "session.audio.input.transcription"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2.0}}}},
     "session.audio.input.turn_detection.threshold"),
    ({"model": "gpt-realtime"}, "session.model"),
    ({"max_output_tokens": 513}, "session.max_output_tokens"),
    ({"type": "transcription"}, "session.type"),
    ({"tool_choice": "sometimes"}, "session.tool_choice"),
    ({"tools": [{"type": "mcp", "name": "x"}]}, "session.tools[0].type"),
])
def test_what_the_session_cannot_honour_is_refused_by_name(session, param):
    with pytest.raises(RealtimeError) as e:
        CONFIG.updated(ev.Session.model_validate(session, strict=True))
    assert e.value.param == param, e.value.message


def test_an_update_changes_only_what_it_sets():
    config = CONFIG.updated(ev.Session.model_validate({"instructions": "x", "audio": {"input": {
        "turn_detection": {"type": "server_vad", "silence_duration_ms": 200}}}}))
    assert config.vad == Vad(silence_duration_ms=200) and config.instructions == "x"
    config = config.updated(ev.Session.model_validate({"audio": {"input": {"turn_detection": None}}}))
    assert config.vad is None and config.instructions == "x" and config.output_modalities == ("audio",)
    shown = config.as_dict()
    assert shown["audio"]["input"]["turn_detection"] is None and json.dumps(shown)


def test_tool_choice_forces_a_call_through_the_answer_prefix():
    tools = ev.Session.model_validate({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                                       "tool_choice": {"type": "function", "name": "f"},
                                       "parallel_tool_calls": False})
    use = CONFIG.updated(tools).tool_use()
    assert use.prefix.startswith("<tool_call>") and '"f"' in use.prefix and use.max_calls == 1
    auto = CONFIG.updated(tools).updated(ev.Session.model_validate({"tool_choice": "auto"})).tool_use()
    assert auto.prefix == "" and [t.name for t in auto.tools] == ["f"]
    assert CONFIG.updated(tools).updated(ev.Session.model_validate({"tool_choice": "none"})).tool_use().tools == ()


# --------------------------------------------------------------------------- output audio

def test_output_audio_is_brought_to_24_khz_mono():
    same = orchestrator_pb2.AudioChunk(pcm=vowel(0.1), sample_rate=RATE, channels=1)
    assert to_24k(same) == same.pcm
    at_48k = orchestrator_pb2.AudioChunk(pcm=bytes(9600 * 2), sample_rate=48000, channels=1)
    assert len(to_24k(at_48k)) == 4800 * 2
    stereo = np.repeat(np.frombuffer(vowel(0.1), "<i2")[:, None], 2, axis=1).astype("<i2").tobytes()
    mixed = to_24k(orchestrator_pb2.AudioChunk(pcm=stereo, sample_rate=RATE, channels=2))
    assert mixed == vowel(0.1)


def test_a_response_keeps_the_conversation_within_the_text_bound_beside_its_instructions():
    conv = items.Conversation(SessionLimits(buffered_audio_s=1, items=64, parts=64, audio_s=10, chars=100))
    for i in range(4):
        conv.add(user_text(f"{i}" * 30))
    with pytest.raises(RealtimeError):
        conv.add(user_text("x" * 101))  # alone past the bound
    first = conv.items[0].id
    assert conv.fit(reserved_chars=0) == [first] and len(conv.items) == 3  # 120 -> 90
    dropped = conv.fit(reserved_chars=50)  # instructions of 50: two more go
    assert len(dropped) == 2 and [i.parts[0].text[0] for i in conv.items] == ["3"]
    assert conv.fit(reserved_chars=500) == []  # the last item stays: the request path names what is too long


def test_uvicorn_has_what_the_door_websocket_protocol_relies_on():
    # connections.py counts an upgraded connection through uvicorn's upgrade (the HTTP protocol hands its
    # transport to a new protocol object) and judges the WebSocket's sends by its flow control: an upgrade
    # that renames one fails here by name, not as a door that quietly stops counting.
    from uvicorn.protocols.http import httptools_impl
    from uvicorn.protocols.websockets import websockets_sansio_impl

    upgrade = open(httptools_impl.__file__).read()
    assert "def handle_websocket_upgrade(self)" in upgrade and "self.transport.set_protocol(protocol)" in upgrade
    sansio = open(websockets_sansio_impl.__file__).read()
    for name in ("transport", "loop", "writable", "disconnected"):
        assert f"self.{name} =" in sansio or f"self.{name}:" in sansio, name
    for method in ("pause_writing", "resume_writing", "connection_lost"):
        assert callable(getattr(websockets_sansio_impl.WebSocketsSansIOProtocol, method, None)), method


def test_truncating_an_answer_deletes_its_transcript_within_its_audio():
    answer = items.assistant_message("item_a", "words never heard", audio=True)
    with pytest.raises(RealtimeError):
        items.truncate(answer, 0, 0)  # no audio was sent with it
    answer.audio_ms = 1200
    for index, end, param in ((1, 100, "content_index"), (0, 1201, "audio_end_ms"), (0, -1, "audio_end_ms")):
        with pytest.raises(RealtimeError) as e:
            items.truncate(answer, index, end)
        assert e.value.param == param
    items.truncate(answer, 0, 700)
    assert answer.parts == [] and answer.audio_ms == 700 and answer.as_dict()["content"][0]["transcript"] == ""
