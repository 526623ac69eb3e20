"""Transcriptions and translations (`/v1/audio/transcriptions`, `/v1/audio/translations`) driven by the official
`openai` SDK against an in-process orchestrator over the tiny Qwen3-Omni stages: every response_format, the
SSE stream, translations, only the Thinker running (the trace and the stages' request counters), and bad
uploads refused naming the field, with nothing held after. The tiny model's words are random: the tests check
the answers' shapes and the path, never the words."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import httpx
import openai
import pytest

from omnistage.client import AsyncOmniClient
from omnistage.planner.scrape import REQUESTS
from omnistage.v1 import common_pb2
from orchestrator_service.http_api import routes

from ..harness import example, start_stage
from ..media_builders import wav
from ..polling import wait_until
from .test_http_api import OMNI, Served, serve
from .test_orchestrator_media import PNG, tone

pytestmark = pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK's translations.create
RATE = 16000
CLIP_S = 1.5
CLIP = wav(tone(CLIP_S, RATE), RATE)
SPEECH_STAGES = ("talker", "code2wav")
TRACE = {"X-Omnistage-Trace": "1"}
# A pipeline that hears at most a second of audio, in a file of at most 64 KiB: for the bounds.
SHORT = example("qwen3-omni-tiny", lambda d: d["spec"]["topology"]["limits"].update(
    maxAudioSeconds=1, maxPartBytes=64 << 10))


@pytest.fixture(scope="module")
async def servers(model_dir):
    stages = {n: await start_stage(OMNI, n, model_dir) for n in ("thinker", *SPEECH_STAGES)}
    served = {"omni": await serve(OMNI, stages), "short": await serve(SHORT, stages)}
    yield served
    for s in served.values():
        await s.orc.drain()
    for s in stages.values():
        await s.drain()


def stage_requests(served: Served, stage: str) -> float:
    """Requests the stage's replica has ended, whatever their outcome. A stage counts a call when the call ends,
    which may be after the client has its answer: read it once the stages are idle (`Served.until_idle`)."""
    return sum(s.value for m in served.stages[stage].metrics.registry.collect() for s in m.samples
               if s.name == f"{REQUESTS}_total")


async def transcribe(served: Served, **kw):
    return await served.aio().audio.transcriptions.create(model=served.model, file=("clip.wav", CLIP), **kw)


def endpoints(served: Served):
    """The API's handlers (routes.Endpoints), reached through its app's layers: gate, key check, router."""
    routes = served.orc.api.gate.app.app.routes
    return next(r.endpoint.__self__ for r in routes if r.path == "/v1/audio/transcriptions")


async def settled(served: Served) -> None:
    """Nothing held anywhere: no HTTP request in progress, no request body in the body budget, no run, no
    admission slot, nothing on any stage."""
    await served.until_idle()
    await wait_until(lambda: served.orc.api.gate.in_progress == 0, 30, 0.05, what="no HTTP request in progress")
    assert endpoints(served).budget.held == 0
    assert served.orc.servicer.admission.inflight == 0 and not served.orc.servicer.runs


# --------------------------------------------------------------------------- formats

async def test_json_runs_only_the_thinker_and_returns_text_with_token_usage(servers):
    omni = servers["omni"]
    await omni.until_idle()
    before = {n: stage_requests(omni, n) for n in ("thinker", *SPEECH_STAGES)}
    r = await transcribe(omni, response_format="json", language="en", prompt="A tone.", temperature=0.0,
                         extra_headers=TRACE)
    assert isinstance(r, openai.types.audio.Transcription) and isinstance(r.text, str)
    assert r.usage.type == "tokens" and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # Text out needs the Thinker alone: the speech stages are never called.
    assert [s["stage"] for s in r.model_extra["omnistage_trace"]["stages"]] == ["thinker"]
    await omni.until_idle()  # the thinker's call ends (and is counted) after the answer is out
    after = {n: stage_requests(omni, n) for n in before}
    assert after["thinker"] == before["thinker"] + 1
    assert all(after[n] == before[n] for n in SPEECH_STAGES)
    await settled(omni)


async def test_text_is_plain_text(servers):
    omni = servers["omni"]
    r = await omni.aio().audio.transcriptions.with_raw_response.create(
        model=omni.model, file=("clip.wav", CLIP), response_format="text")
    assert r.headers["content-type"].startswith("text/plain")
    assert r.parse() == r.http_response.text


async def test_verbose_json_has_the_clip_length_and_one_segment_spanning_it(servers):
    omni = servers["omni"]
    r = await transcribe(omni, response_format="verbose_json", language="de")
    assert isinstance(r, openai.types.audio.TranscriptionVerbose)
    assert r.duration == CLIP_S and r.language == "de" and r.model_extra["task"] == "transcribe"
    assert [(s.id, s.start, s.end, s.text) for s in r.segments] == [(0, 0.0, CLIP_S, r.text)]
    assert r.usage.type == "duration" and r.usage.seconds == CLIP_S


async def test_srt_and_vtt_are_one_cue_spanning_the_clip(servers):
    omni = servers["omni"]
    srt = await transcribe(omni, response_format="srt")
    assert re.fullmatch(r"1\n00:00:00,000 --> 00:00:01,500\n(.*)\n\n", srt, re.DOTALL), srt
    vtt = await transcribe(omni, response_format="vtt")
    assert re.fullmatch(r"WEBVTT\n\n00:00:00\.000 --> 00:00:01\.500\n(.*)\n\n", vtt, re.DOTALL), vtt


async def test_stream_sends_text_deltas_then_done_with_the_whole_text_and_usage(servers):
    omni = servers["omni"]
    stream = await transcribe(omni, stream=True, extra_body={"temperature": 0.0})
    events = [e async for e in stream]
    deltas, done = events[:-1], events[-1]
    assert all(e.type == "transcript.text.delta" and e.delta for e in deltas) and deltas
    assert done.type == "transcript.text.done" and done.text == "".join(e.delta for e in deltas)
    assert done.usage.type == "tokens" and done.usage.output_tokens > 0
    await settled(omni)


async def test_stream_wire_format_is_the_references_events(servers):
    omni = servers["omni"]
    async with httpx.AsyncClient(base_url=omni.url, timeout=60) as http:
        r = await http.post("/audio/transcriptions", files={"file": ("clip.wav", CLIP)},
                            data={"model": omni.model, "stream": "true"}, headers=TRACE)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = r.text.split("\n\n")
    assert chunks[-1] == "" and all(c.startswith("data: ") for c in chunks[:-1])
    events = [json.loads(c[len("data: "):]) for c in chunks[:-1]]
    assert {tuple(sorted(e)) for e in events[:-1]} == {("delta", "type")}
    assert sorted(events[-1]) == ["omnistage_trace", "text", "type", "usage"]
    assert [s["stage"] for s in events[-1]["omnistage_trace"]["stages"]] == ["thinker"]


async def test_translations_answer_in_every_format(servers):
    omni = servers["omni"]
    translations = omni.aio().audio.translations
    r = await translations.create(model=omni.model, file=("clip.wav", CLIP), prompt="A tone.", extra_headers=TRACE)
    assert isinstance(r.text, str)
    assert [s["stage"] for s in r.model_extra["omnistage_trace"]["stages"]] == ["thinker"]
    verbose = await translations.create(model=omni.model, file=("clip.wav", CLIP), response_format="verbose_json")
    assert verbose.language == "english" and verbose.duration == CLIP_S and verbose.model_extra["task"] == "translate"
    assert "usage" not in r.model_extra and "usage" not in verbose.model_extra  # the reference's have none
    srt = await translations.create(model=omni.model, file=("clip.wav", CLIP), response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,500\n")
    await settled(omni)


# ------------------------------------------------------------------------- bad input

async def refused(call, param: str, status: type[openai.APIStatusError] = openai.BadRequestError) -> str:
    with pytest.raises(status) as e:
        await call
    assert e.value.body["param"] == param, e.value.body
    return e.value.body["message"]


async def test_an_upload_that_is_not_audio_is_refused_naming_file(servers):
    omni = servers["omni"]
    message = await refused(omni.aio().audio.transcriptions.create(model=omni.model, file=("x.png", PNG)), "file")
    assert "cannot decode" in message
    await refused(omni.aio().audio.translations.create(model=omni.model, file=("x.txt", b"hello")), "file")
    # streamed: refused before the stream starts, as a 400 (not an error event)
    await refused(omni.aio().audio.transcriptions.create(model=omni.model, file=("x.png", PNG), stream=True), "file")
    await settled(omni)


async def test_audio_over_the_seconds_limit_is_refused_naming_file(servers):
    short = servers["short"]
    message = await refused(transcribe(short), "file")
    assert "the limit is 1 s" in message
    await settled(short)


async def test_a_file_over_the_part_bound_is_400_and_over_the_body_bound_413_before_it_is_parsed(servers):
    short = servers["short"]
    over_part = wav(tone(0.5, 96000), 96000)  # 96 KiB: over the pipeline's 64 KiB part bound
    assert "the limit is 65536" in await refused(short.aio().audio.transcriptions.create(
        model=short.model, file=("big.wav", over_part)), "file")
    limit = endpoints(short).upload_limit
    over_body = wav(tone(1.0, 192000), 192000)  # 375 KiB: over the whole upload's bound too
    assert len(over_body) > limit
    with pytest.raises(openai.APIStatusError) as e:
        await short.aio().audio.transcriptions.create(model=short.model, file=("big.wav", over_body))
    assert e.value.status_code == 413 and e.value.code == "request_too_large"
    assert f"larger than {limit} bytes" in e.value.message
    await settled(short)


async def test_an_upload_that_stops_coming_is_408_and_leaves_the_body_budget(servers, monkeypatch):
    omni = servers["omni"]
    monkeypatch.setattr(routes, "BODY_IDLE_S", 0.5)  # the door's own idle bound is tens of seconds
    reader, writer = await asyncio.open_connection("127.0.0.1", omni.orc.api_port)
    try:
        writer.write(f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1:{omni.orc.api_port}\r\n"
                     "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n"
                     "--b\r\n".encode())  # and then silence
        await writer.drain()
        async with asyncio.timeout(60):  # a safety bound, never a measurement
            answer = await reader.read()
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    await settled(omni)


async def test_unknown_response_format_and_a_streamed_subtitle_are_refused_naming_response_format(servers):
    omni = servers["omni"]
    await refused(transcribe(omni, response_format="xml"), "response_format")
    await refused(transcribe(omni, response_format="srt", stream=True), "response_format")
    await refused(transcribe(omni, language="not a language"), "language")
    await refused(transcribe(omni, extra_body={"temperature": "warm"}), "temperature")
    await refused(transcribe(omni, include=["logprobs"]), "include")
    await refused(transcribe(omni, timestamp_granularities=["word"]), "timestamp_granularities")
    await refused(omni.aio().audio.transcriptions.create(model="whisper-1", file=("clip.wav", CLIP)), "model",
                  openai.NotFoundError)
    await settled(omni)


async def test_the_audio_language_field_is_refused_where_no_stage_reads_it(servers):
    # Over HTTP the language is folded into the Thinker's instruction (the tests above); the gRPC field that a
    # speech recognition stage forces is read by no stage here, and refused rather than dropped.
    omni = servers["omni"]
    part = common_pb2.ContentPart(audio=common_pb2.AudioPart(data=CLIP))
    async with AsyncOmniClient(f"127.0.0.1:{omni.orc.port}") as client:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate(parts=[part], language="en", outputs=["text"], max_tokens=2, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.audio.language" in e.value.details()
    await settled(omni)


async def test_a_prompt_over_the_prompt_bound_is_refused_naming_prompt(servers):
    omni = servers["omni"]
    message = await refused(transcribe(omni, prompt="x" * omni.orc.pipeline.limits.max_prompt_chars), "prompt")
    assert "has 8192 characters; this pipeline takes at most" in message
    await settled(omni)


async def test_bodies_the_sdk_cannot_send_are_refused_in_the_openai_shape(servers):
    omni = servers["omni"]
    async with httpx.AsyncClient(base_url=omni.url, timeout=60) as http:
        no_file = await http.post("/audio/transcriptions", files={"model": (None, omni.model)})
        two_files = await http.post("/audio/transcriptions", files=[("file", ("a.wav", CLIP)),
                                                                    ("file", ("b.wav", CLIP))])
        as_json = await http.post("/audio/transcriptions", json={"model": omni.model, "file": "clip.wav"})
        cut = await http.post("/audio/transcriptions", content=b"--b\r\nContent-Disposition: form-data; "
                              b'name="model"\r\n\r\nx', headers={"content-type": "multipart/form-data; boundary=b"})
        not_utf8 = await http.post("/audio/transcriptions", files={"file": ("clip.wav", CLIP),
                                                                   "prompt": (None, b"\xff\xfe")})
    for r, param in ((no_file, "file"), (two_files, "file"), (as_json, None), (cut, None), (not_utf8, "prompt")):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "multipart/form-data" in as_json.json()["error"]["message"]
    assert "closing boundary" in cut.json()["error"]["message"]
    await settled(omni)


async def test_nothing_is_held_in_the_body_budget_after_uploads(servers):
    omni = servers["omni"]
    await asyncio.gather(transcribe(omni), transcribe(omni, response_format="srt"),
                         refused(transcribe(omni, response_format="xml"), "response_format"))
    await settled(omni)
