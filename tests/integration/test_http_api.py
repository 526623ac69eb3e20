"""The OpenAI-compatible HTTP API driven by the official `openai` SDK (sync and async, streaming and not)
against in-process orchestrators (`OrchestratorServer(api_port=0)`) over the tiny example pipelines:
chat with text and audio out, media parts in, speech, images, models, every error code with the SDK's
own exception classes, clients that go away mid-stream (nothing left on any stage), and the SSE wire
format itself over plain `http.client`."""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import socket

import numpy as np
import openai
import pytest
import soundfile
from PIL import Image

from orchestrator_service.http_api import responses
from orchestrator_service.server import OrchestratorServer

from ..harness import example, start_stage
from ..media_builders import wav
from ..polling import wait_until
from ..sdk_clients import kept
from .test_orchestrator_control import nothing_left
from .test_orchestrator_media import PNG, tone

OMNI = example("qwen3-omni-tiny")
IMAGES = example("text-to-image-tiny")


def thinker_only(doc: dict) -> None:
    """The Thinker alone: a pipeline with text out only."""
    doc["spec"]["topology"].update(stages=doc["spec"]["topology"]["stages"][:1],
                                   outputs=[{"modality": "text", "stage": "thinker"}])
    for stage in ("talker", "code2wav"):
        del doc["spec"]["deployment"]["stages"][stage]


TEXT_ONLY = example("qwen3-omni-tiny", thinker_only)
# One request at a time and none waiting: a second is refused at once.
TIGHT = example("qwen3-omni-tiny", lambda d: d["spec"]["deployment"]["orchestrator"].update(
    maxInflight=1, maxQueued=0))
KEYS = ("first-key", "second-key")
AUDIO = dict(modalities=["text", "audio"], max_tokens=6, seed=11)
RATE = 24000  # the tiny Qwen3-Omni Code2Wav's sample rate
# A request that takes seconds: for clients that give up and deadlines that pass.
LONG = dict(messages=[{"role": "user", "content": "a long answer"}], max_tokens=256, modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"}, extra_body={"ignore_eos": True})


class Served:
    """An orchestrator serving the HTTP API over stage servers that are already up."""

    def __init__(self, orc: OrchestratorServer, stages: dict):
        self.orc, self.stages = orc, stages
        self.url = f"http://127.0.0.1:{orc.api_port}/v1"
        self.model = orc.pipeline.name

    def sync(self, **kw) -> openai.OpenAI:
        return kept(openai.OpenAI(base_url=self.url, api_key=kw.pop("api_key", "none"), max_retries=0, **kw))

    def aio(self, **kw) -> openai.AsyncOpenAI:
        # kept, not left to the garbage collector (tests/sdk_clients.py: how that unregisters a server's socket)
        return kept(openai.AsyncOpenAI(base_url=self.url, api_key=kw.pop("api_key", "none"), max_retries=0, **kw))

    def idle(self) -> bool:
        return nothing_left(self.orc, self.stages) and all(s.data_plane.held_bytes == 0 for s in self.stages.values())

    async def until_idle(self) -> None:
        await wait_until(self.idle, 30, 0.05, what="nothing left on any stage",
                         detail=lambda: {n: (s.servicer.inflight, s.data_plane.held_bytes)
                                         for n, s in self.stages.items()} | {"runs": len(self.orc.servicer.runs)})


async def serve(pipeline, stages: dict, **kw) -> Served:
    orc = OrchestratorServer(pipeline, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()}, api_port=0, **kw)
    await orc.start(wait_for_stages=30)
    return Served(orc, stages)


@pytest.fixture(scope="module")
async def servers(model_dir):
    omni_stages = {n: await start_stage(OMNI, n, model_dir) for n in ("thinker", "talker", "code2wav")}
    image_stages = {n: await start_stage(IMAGES, n, model_dir) for n in ("text-encoder", "denoise", "vae-decode")}
    served = {
        "omni": await serve(OMNI, omni_stages),
        "images": await serve(IMAGES, image_stages),
        "text": await serve(TEXT_ONLY, {"thinker": omni_stages["thinker"]}),
        "keyed": await serve(OMNI, omni_stages, api_keys=KEYS),
        "tight": await serve(TIGHT, omni_stages),
        "broken": await serve(OMNI, omni_stages),
    }
    # The Talker's replicas are gone, as when Kubernetes drops a dead pod from the Service's endpoints.
    served["broken"].orc.router.set_endpoints("talker", [])
    yield served
    for s in served.values():
        await s.orc.drain()
    for s in (*omni_stages.values(), *image_stages.values()):
        await s.drain()


async def hang_up(stream: openai.AsyncStream) -> None:
    """Close a stream mid-way: the SDK's iterators over it (which its close() leaves to the garbage
    collector, noisily), then the connection."""
    await stream._iterator.aclose()
    await stream.close()


def samples(encoded: bytes) -> tuple[np.ndarray, int]:
    data, rate = soundfile.read(io.BytesIO(encoded), dtype="int16")
    return data, rate


def pcm(pieces: list[str]) -> np.ndarray:
    return np.frombuffer(b"".join(base64.b64decode(p) for p in pieces), dtype="<i2")


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def user(*content) -> list[dict]:
    return [{"role": "user", "content": list(content) if len(content) > 1 or not isinstance(content[0], str)
             else content[0]}]


# --------------------------------------------------------------------------- models

async def test_models_list_the_pipeline_with_its_modalities(servers):
    omni = servers["omni"]
    listed = await asyncio.to_thread(lambda: omni.sync().models.list().data)
    assert [m.id for m in listed] == [omni.model]
    card = (await omni.aio().models.retrieve(omni.model)).model_dump()
    assert card["output_modalities"] == ["text", "audio"] and "image" in card["input_modalities"]
    assert card["stages"] == ["thinker", "talker", "code2wav"]
    with pytest.raises(openai.NotFoundError) as e:
        await omni.aio().models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found" and e.value.param == "model"


# ----------------------------------------------------------------------------- chat

async def test_chat_with_audio_out_returns_text_and_a_wav_that_decodes(servers):
    omni = servers["omni"]
    r = await asyncio.to_thread(lambda: omni.sync().chat.completions.create(
        model=omni.model, messages=user("Hello there"), audio={"voice": "ethan", "format": "wav"}, **AUDIO))
    message = r.choices[0].message
    assert message.content and message.audio.transcript == message.content
    audio, rate = samples(base64.b64decode(message.audio.data))
    assert rate == RATE and len(audio) > 0
    assert r.usage.completion_tokens == 6 or r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The audio id stands for this answer in a later turn until it expires (an hour on).
    assert message.audio.id.startswith("audio_") and message.audio.expires_at == r.created + 3600


async def test_streamed_pcm_equals_the_non_streamed_audio(servers):
    omni = servers["omni"]
    client = omni.aio()
    whole = await client.chat.completions.create(model=omni.model, messages=user("Sing"),
                                                 audio={"voice": "chelsie", "format": "wav"}, **AUDIO)
    stream = await client.chat.completions.create(model=omni.model, messages=user("Sing"), stream=True,
                                                  stream_options={"include_usage": True},
                                                  audio={"voice": "chelsie", "format": "pcm16"}, **AUDIO)
    text, pieces, transcript, reasons, usage = [], [], [], [], None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            audio = choice.delta.audio
            text.append(choice.delta.content or "")
            transcript.append(audio and audio.transcript or "")
            if audio and audio.data:
                pieces.append(audio.data)
            reasons.append(choice.finish_reason)
    expected, rate = samples(base64.b64decode(whole.choices[0].message.audio.data))
    assert len(pieces) >= 1 and np.array_equal(pcm(pieces), expected)
    assert "".join(text) == "".join(transcript) == whole.choices[0].message.content
    assert [r for r in reasons if r] == [whole.choices[0].finish_reason]
    assert usage.completion_tokens == whole.usage.completion_tokens


async def test_image_and_audio_parts_reach_the_thinker_in_order(servers):
    omni = servers["omni"]
    client = omni.aio()
    plain = await client.chat.completions.create(model=omni.model, messages=user("What is this?"), max_tokens=2)
    decoded = omni.orc.metrics.media_decode_seconds._sum.get()
    r = await client.chat.completions.create(model=omni.model, max_tokens=2, messages=user(
        {"type": "image_url", "image_url": {"url": data_url("image/png", PNG)}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(tone(0.5))).decode(), "format": "wav"}},
        {"type": "text", "text": "What is this?"}))
    assert r.choices[0].message.content and r.choices[0].message.audio is None
    assert omni.orc.metrics.media_decode_seconds._sum.get() > decoded
    # The Thinker's processor put the picture's and the sound's tokens into the prompt.
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 10
    with pytest.raises(openai.BadRequestError) as e:  # a broken second part is named as the client sent it
        await client.chat.completions.create(model=omni.model, max_tokens=2, messages=user(
            {"type": "text", "text": "Look:"},
            {"type": "image_url", "image_url": {"url": data_url("image/png", b"no")}}))
    assert e.value.param == "messages[0].content[1]" and "cannot decode" in e.value.message


async def test_a_stop_string_ends_the_answer_before_it_streamed_or_not(servers):
    omni = servers["omni"]
    client = omni.aio()
    kw = dict(model=omni.model, messages=user("Tell me a story"), max_tokens=24, extra_body={"ignore_eos": True})
    full = (await client.chat.completions.create(**kw)).choices[0].message.content
    assert len(full) > 8
    stop = full[len(full) // 2: len(full) // 2 + 3]
    before = full[:full.index(stop)]
    r = await client.chat.completions.create(stop=[stop, "\x00never"], **kw)
    assert r.choices[0].message.content == before and r.choices[0].finish_reason == "stop"
    stream = await client.chat.completions.create(stop=stop, stream=True, **kw)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == before
    assert chunks[-1].choices[0].finish_reason == "stop"
    await omni.until_idle()  # the rest of the request was cancelled


# --------------------------------------------------------------------------- speech

async def test_speech_comes_back_in_the_asked_format(servers):
    omni = servers["omni"]
    client = omni.aio()
    for fmt in ("wav", "flac", "mp3"):
        r = await client.audio.speech.create(model=omni.model, voice="ethan", input="Hello there", response_format=fmt)
        audio, rate = samples(r.content)
        assert rate == RATE and len(audio) > 0, fmt
        assert r.response.headers["content-type"].startswith({"wav": "audio/wav", "flac": "audio/flac",
                                                               "mp3": "audio/mpeg"}[fmt])
    async with client.audio.speech.with_streaming_response.create(
            model=omni.model, voice="ethan", input="Hello there", response_format="pcm") as r:
        raw = b"".join([piece async for piece in r.iter_bytes()])
        assert r.headers["x-sample-rate"] == str(RATE)
    assert len(raw) > 0 and len(raw) % 2 == 0


async def test_speech_as_server_sent_events(servers):
    omni = servers["omni"]

    def events() -> list[dict]:
        with omni.sync().audio.speech.with_streaming_response.create(
                model=omni.model, voice="aiden", input="One two three", stream_format="sse") as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            return [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]

    got = await asyncio.to_thread(events)
    assert {e["type"] for e in got[:-1]} == {"speech.audio.delta"} and got[-1]["type"] == "speech.audio.done"
    assert sum(len(base64.b64decode(e["audio"])) for e in got[:-1]) > 0
    assert got[-1]["usage"]["input_tokens"] > 0


# --------------------------------------------------------------------------- images

async def test_images_decode_to_the_asked_size_one_per_seed(servers):
    served = servers["images"]
    r = await asyncio.to_thread(lambda: served.sync().images.generate(
        model=served.model, prompt="a red car", size="64x48", n=2, response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 5}))
    pictures = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in r.data]
    assert [p.size for p in pictures] == [(64, 48), (64, 48)] and pictures[0].format == "PNG"
    assert pictures[0].tobytes() != pictures[1].tobytes()  # seeds 5 and 6
    raw = await served.aio().images.with_raw_response.generate(
        model=served.model, prompt="a red car", size="64x48", n=2,
        extra_body={"num_inference_steps": 2, "seed": 5, "return_trace": True})
    again = raw.parse()
    assert base64.b64decode(again.data[0].b64_json) == base64.b64decode(r.data[0].b64_json)
    assert len(raw.headers["x-request-id"].split(",")) == 2  # one id per image's request
    traces = again.model_extra["omnistage_trace"]  # one per image, in order
    assert [[s["stage"] for s in t["stages"]] for t in traces] == [["text-encoder", "denoise", "vae-decode"]] * 2


# --------------------------------------------------------------------------- errors

BAD_CHATS = [
    (dict(temperature="hot"), "temperature"),
    (dict(max_tokens=100_000), "max_tokens"),
    (dict(max_completion_tokens=0), "max_completion_tokens"),
    (dict(n=2), "n"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]),
     "tools[0].function.parameters"),
    (dict(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}), "audio.voice"),
    (dict(modalities=["text", "audio"], audio={"voice": "ethan", "format": "aac"}), "audio.format"),
    (dict(modalities=["text", "audio"], stream=True, audio={"voice": "ethan", "format": "wav"}), "audio.format"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url",
                                                  "image_url": {"url": "https://example.com/cat.png"}}]}]),
     "messages[0].content[0].image_url.url"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
     "messages[1].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), "messages[0].content[0].text"),
]


@pytest.mark.parametrize("kw,param", BAD_CHATS, ids=[p for _, p in BAD_CHATS])
async def test_bad_chat_requests_are_400_naming_the_field(servers, kw, param):
    omni = servers["omni"]
    kw = {"model": omni.model, "messages": user("hi"), "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        await omni.aio().chat.completions.create(**kw)
    assert e.value.param == param and param in e.value.message and e.value.type == "invalid_request_error"


async def test_a_pipeline_that_cannot_do_it_is_400_naming_the_field(servers):
    with pytest.raises(openai.BadRequestError) as e:
        await servers["images"].aio().audio.speech.create(model=servers["images"].model, voice="x", input="hi")
    assert e.value.param == "model" and "cannot speak" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await servers["omni"].aio().images.generate(model=servers["omni"].model, prompt="a cat")
    assert e.value.param == "model" and "makes no images" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await servers["text"].aio().chat.completions.create(model=servers["text"].model, messages=user("hi"),
                                                            modalities=["text", "audio"], audio={"voice": "ethan",
                                                                                                 "format": "wav"})
    assert e.value.param == "modalities[1]" and "no audio output" in e.value.message
    images = servers["images"].aio()
    for kw, param in ((dict(size="64"), "size"), (dict(size="60x60"), "size"), (dict(response_format="url"),
                                                                                  "response_format")):
        with pytest.raises(openai.BadRequestError) as e:
            await images.images.generate(model=servers["images"].model, prompt="a cat", **kw)
        assert e.value.param == param
    with pytest.raises(openai.BadRequestError) as e:
        await servers["omni"].aio().audio.speech.create(model=servers["omni"].model, voice="ethan", input="hi",
                                                        speed=1.5)
    assert e.value.param == "speed"


async def test_an_unknown_model_is_404(servers):
    with pytest.raises(openai.NotFoundError) as e:
        await servers["omni"].aio().chat.completions.create(model="gpt-4o", messages=user("hi"))
    assert e.value.code == "model_not_found" and e.value.param == "model"


async def test_api_keys_are_required_when_configured(servers):
    keyed = servers["keyed"]
    for key in ("wrong", "first-key-but-longer", "first-ke"):
        with pytest.raises(openai.AuthenticationError) as e:
            await keyed.aio(api_key=key).models.list()
        assert e.value.code == "invalid_api_key"
    for key in KEYS:
        r = await keyed.aio(api_key=key).chat.completions.create(model=keyed.model, messages=user("hi"), max_tokens=2)
        assert r.choices[0].message.content is not None

    def get(path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", keyed.orc.api_port, timeout=10)
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()

    status, body = await asyncio.to_thread(get, "/v1/models")  # no key at all
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert (await asyncio.to_thread(get, "/health"))[0] == 200  # open: probes carry no key


async def test_overload_is_429_with_retry_after(servers):
    tight = servers["tight"]
    client = tight.aio()
    holding = await client.chat.completions.create(model=tight.model, messages=user("a long answer"), stream=True,
                                                   max_tokens=64, extra_body={"ignore_eos": True})
    await holding.__anext__()  # admitted and running: the only slot is taken
    try:
        with pytest.raises(openai.RateLimitError) as e:
            await client.chat.completions.create(model=tight.model, messages=user("hi"), max_tokens=2)
        assert e.value.code == "rate_limit_exceeded"
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        await hang_up(holding)
    await tight.until_idle()


async def test_a_stage_that_is_down_is_503_naming_it(servers):
    broken = servers["broken"]
    with pytest.raises(openai.InternalServerError) as e:
        await broken.aio().chat.completions.create(model=broken.model, messages=user("hi"), max_tokens=2,
                                                   modalities=["text", "audio"], audio={"voice": "ethan",
                                                                                        "format": "wav"})
    assert e.value.status_code == 503 and e.value.body["stage"] == "talker" and "stage talker" in e.value.message


async def test_a_passed_deadline_is_504_and_leaves_nothing(servers):
    omni = servers["omni"]
    with pytest.raises(openai.InternalServerError) as e:
        await omni.aio().chat.completions.create(model=omni.model, extra_headers={"X-Request-Timeout": "0.3"},
                                                 **LONG)
    assert e.value.status_code == 504 and e.value.code == "timeout"
    await omni.until_idle()
    with pytest.raises(openai.BadRequestError) as e:
        await omni.aio().chat.completions.create(model=omni.model, messages=user("hi"),
                                                 extra_headers={"X-Request-Timeout": "soon"})
    assert e.value.param == "X-Request-Timeout"


async def test_the_trace_header_returns_the_trace_one_entry_per_stage(servers):
    omni = servers["omni"]
    r = await omni.aio().chat.completions.create(model=omni.model, messages=user("Hello"),
                                                 audio={"voice": "ethan", "format": "wav"},
                                                 extra_headers={"X-Omnistage-Trace": "1"}, **AUDIO)
    trace = r.model_extra["omnistage_trace"]
    assert [s["stage"] for s in trace["stages"]] == ["thinker", "talker", "code2wav"]
    assert all(s["queue_ms"] >= 0 and s["compute_ms"] > 0 for s in trace["stages"])
    # each stage's work units, a string as protobuf's JSON writes a 64-bit integer
    assert [s["unit"] for s in trace["stages"]] == ["tokens", "frames", "chunks"]
    assert all(int(s["units"]) > 0 for s in trace["stages"])
    assert trace["total_ms"] > 0 and "admission_wait_ms" in trace
    plain = await omni.aio().chat.completions.create(model=omni.model, messages=user("Hello"), max_tokens=2)
    assert "omnistage_trace" not in (plain.model_extra or {})


# ------------------------------------------------------------------- clients gone

async def test_a_client_that_gives_up_on_a_whole_answer_cancels_it(servers):
    omni = servers["omni"]
    cancelled = omni.orc.metrics.requests.labels("cancelled")._value.get()
    with pytest.raises(openai.APITimeoutError):
        await omni.aio(timeout=0.3).chat.completions.create(model=omni.model, **LONG)
    await omni.until_idle()
    assert omni.orc.metrics.requests.labels("cancelled")._value.get() == cancelled + 1


async def test_a_hundred_streaming_clients_that_leave_mid_stream_leave_nothing_held(servers):
    omni = servers["omni"]
    client = omni.aio()

    async def leave_early(i: int) -> int:
        stream = await client.chat.completions.create(
            model=omni.model, messages=user(f"Tell me story {i}"), stream=True, max_tokens=48,
            modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"}, extra_body={"ignore_eos": True})
        seen = 0
        for seen in range(1, 3 + i % 3):  # the role chunk, then a delta or two
            await stream.__anext__()
        await hang_up(stream)
        return seen

    cancelled = omni.orc.metrics.requests.labels("cancelled")._value.get()
    seen = await asyncio.gather(*[leave_early(i) for i in range(100)])
    assert all(s >= 2 for s in seen)
    await omni.until_idle()
    assert omni.orc.metrics.requests.labels("cancelled")._value.get() == cancelled + 100
    r = await client.chat.completions.create(model=omni.model, messages=user("still there?"), max_tokens=2)
    assert r.choices[0].message.content is not None


async def test_a_client_that_stops_reading_is_cancelled_after_the_stall_bound(servers, monkeypatch):
    """A raw socket that sends a streaming request and never reads: once the connection's buffers are
    full the response waits on its send, and past the stall bound the request is cancelled in every stage."""
    omni = servers["omni"]
    monkeypatch.setattr(responses, "SEND_STALL_S", 0.5)
    cancelled = omni.orc.metrics.requests.labels("cancelled")._value.get()
    body = json.dumps({"model": omni.model, "messages": user("a long answer"), "stream": True, "max_tokens": 256,
                       "ignore_eos": True, "modalities": ["text", "audio"],
                       "audio": {"voice": "ethan", "format": "pcm16"}}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", omni.orc.api_port))
    try:
        # The server's side of the connection with a small send buffer too (the kernel's own on loopback
        # would hold the whole answer): the buffers fill after a few events.
        connections = omni.orc.api._server.server_state.connections
        served = await wait_until(lambda: [c for c in connections if c.transport.get_extra_info("peername") ==
                                           sock.getsockname()], what="the connection accepted")
        served[0].transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await wait_until(lambda: omni.orc.metrics.requests.labels("cancelled")._value.get() == cancelled + 1, 60,
                         what="the stalled request cancelled", detail=lambda: len(omni.orc.servicer.runs))
        await omni.until_idle()
        assert not omni.orc.servicer.runs and omni.orc.servicer.admission.inflight == 0
    finally:
        sock.close()


# ------------------------------------------------------------------------ the wire

async def test_answers_leave_without_waiting_for_an_ack(servers):
    """Every accepted connection has TCP_NODELAY: without it Nagle holds an answer's body behind its
    headers until the client's delayed ACK (40 ms on every response)."""
    omni = servers["omni"]
    sock = socket.create_connection(("127.0.0.1", omni.orc.api_port))
    try:
        connections = omni.orc.api._server.server_state.connections
        served = await wait_until(lambda: [c for c in connections if c.transport.get_extra_info("peername") ==
                                           sock.getsockname()], what="the connection accepted")
        server_side = served[0].transport.get_extra_info("socket")
        assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


async def test_the_sse_wire_format_over_plain_http(servers):
    omni = servers["omni"]

    def post() -> tuple[int, str, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", omni.orc.api_port, timeout=60)
        body = json.dumps({"model": omni.model, "messages": [{"role": "user", "content": "Hello"}], "stream": True,
                           "max_tokens": 4, "stream_options": {"include_usage": True}, "return_trace": True,
                           "n": None, "ignore_eos": None})
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("content-type"), r.read()

    status, content_type, raw = await asyncio.to_thread(post)
    assert status == 200 and content_type.startswith("text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and all(e.startswith(b"data: ") for e in events[:-1])
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == omni.model for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    # The trace comes on the chunk with the finish reason, and only there.
    assert [c for c in chunks if "omnistage_trace" in c] == [chunks[-2]]
    assert [s["stage"] for s in chunks[-2]["omnistage_trace"]["stages"]] == ["thinker"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert len({c["id"] for c in chunks}) == 1
