"""Media parts at admission: the orchestrator decodes them before any stage work, refuses a bad one with
INVALID_ARGUMENT naming it (no stage ever sees it), bounds the time decoding takes, and keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnistage.client import AsyncOmniClient, audio_part, image_part, pcm_part, video_part
from omnistage.v1 import common_pb2
from orchestrator_service.server import OrchestratorServer

from ..harness import example, small_lm, start_stage
from ..media_builders import png, wav
from ..polling import wait_until
from .test_orchestrator_fuzz import LM_LIMITS, LM_ORCHESTRATOR

OMNI = example("qwen3-omni-tiny")
# The same stages, with a decode bound no real image meets.
OMNI_HASTY = example("qwen3-omni-tiny", lambda d: d["spec"]["topology"].setdefault("limits", {}).update(
    mediaDecodeSeconds=0.001))
LLM = small_lm(LM_LIMITS, LM_ORCHESTRATOR)
rng = np.random.default_rng(5)


def tone(seconds: float, rate: int = 16000) -> np.ndarray:
    return (0.3 * np.sin(np.arange(int(rate * seconds)) / 7)).astype(np.float32)


PNG = png(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8))


async def orchestrator(pipeline, endpoints: dict[str, str]) -> OrchestratorServer:
    orc = OrchestratorServer(pipeline, {n: [a] for n, a in endpoints.items()})
    await orc.start(wait_for_stages=30)
    return orc


@pytest.fixture(scope="module")
async def omni(model_dir):
    """The Thinker alone (text output), behind an orchestrator with the pipeline's limits and one with a
    decode bound of a millisecond."""
    thinker = await start_stage(OMNI, "thinker", model_dir)
    address = {"thinker": f"127.0.0.1:{thinker.port}"}
    orcs = [await orchestrator(OMNI, address), await orchestrator(OMNI_HASTY, address)]
    clients = [AsyncOmniClient(f"127.0.0.1:{o.port}") for o in orcs]
    yield clients, orcs, thinker
    for c in clients:
        await c.close()
    for o in orcs:
        await o.drain()
    await thinker.drain()


async def stage_requests(stage) -> float:
    """Calls the stage has ended. A call is counted when it ends, which may be after its client has the answer
    (the last request of the test before): read once the stage has no call running."""
    await wait_until(lambda: stage.servicer.inflight == 0, 30, 0.05, what="the stage's calls ended")
    return sum(s.value for m in stage.metrics.requests.collect() for s in m.samples if s.name.endswith("_total"))


BAD_PARTS = [
    ([image_part(b"GIF89a not really")], "params.parts[0].image: cannot decode (not PNG, JPEG or WebP)"),
    (["Listen:", audio_part(b"RIFF\x00\x00")], "params.parts[1].audio: cannot decode"),
    ([image_part(PNG), video_part([PNG, PNG], [1.0, 0.5])],
     "params.parts[1].video: timestamps must increase"),
    ([image_part(PNG[: len(PNG) // 3])], "params.parts[0].image: cannot decode (PNG data is corrupt or truncated)"),
]


@pytest.mark.parametrize("parts,message", BAD_PARTS, ids=[m.split(":")[0] for _, m in BAD_PARTS])
async def test_a_bad_part_is_invalid_argument_naming_it_and_reaches_no_stage(omni, parts, message):
    (client, _), (orc, _), thinker = omni
    invalid = orc.metrics.requests.labels("invalid")._value.get()
    seen = await stage_requests(thinker)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.generate("What is this?", parts=parts, outputs=["text"], max_tokens=2, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(message)
    assert orc.metrics.requests.labels("invalid")._value.get() == invalid + 1
    assert await stage_requests(thinker) == seen  # refused before any stage work
    r = await client.generate("Hello", outputs=["text"], max_tokens=2, timeout=60)  # still serving
    assert r.final is not None and r.text


async def test_media_decode_time_is_in_the_trace(omni):
    (client, _), (orc, _), _ = omni
    r = await client.generate("Describe both.", parts=[image_part(PNG), audio_part(wav(tone(0.5)))], outputs=["text"],
                              max_tokens=2, return_trace=True, timeout=120)
    assert r.final.trace.media_decode_ms > 0 and r.text
    assert orc.metrics.media_decode_seconds._sum.get() > 0
    text_only = await client.generate("Hello", outputs=["text"], max_tokens=2, return_trace=True, timeout=60)
    assert text_only.final.trace.media_decode_ms == 0


async def test_decoding_past_its_bound_is_invalid_argument_and_the_orchestrator_keeps_serving(omni):
    (_, hasty), (_, orc), thinker = omni
    big = png(rng.integers(0, 256, (1000, 1000, 3), dtype=np.uint8))  # tens of ms to decode, bound: 1 ms
    seen = await stage_requests(thinker)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await hasty.generate("What is this?", parts=[image_part(big)], outputs=["text"], max_tokens=2, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "params.parts: decoding took longer than 0.001 s"
    assert await stage_requests(thinker) == seen
    r = await hasty.generate("Hello", outputs=["text"], max_tokens=2, timeout=60)
    assert r.final is not None


async def test_media_to_a_text_only_pipeline_is_refused_naming_the_part(model_dir):
    stage = await start_stage(LLM, "llm", model_dir)
    orc = await orchestrator(LLM, {"llm": f"127.0.0.1:{stage.port}"})
    try:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.generate("What is this?", parts=["Look:", image_part(PNG)], timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == "params.parts[1].image: this pipeline reads no image (it reads text)"
            r = await client.generate("Hello", max_tokens=2, timeout=60)
            assert r.final is not None
            # Text parts are the prompt's text for a text-only stage: parts then prompt, as written.
            whole = await client.generate("Hello there, friend", max_tokens=4, ignore_eos=True, timeout=60)
            parts = await client.generate(", friend", parts=["Hello", " there"], max_tokens=4, ignore_eos=True,
                                          timeout=60)
            assert parts.text == whole.text
            assert parts.final.usage.prompt_tokens == whole.final.usage.prompt_tokens
    finally:
        await orc.drain()
        await stage.drain()


# The tokens the processor places for media, and the chat markers: text carrying them is plain text.
SPECIAL_TOKENS = ["<|audio_pad|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|audio_start|>",
                  "<|im_start|>"]
media_bytes = st.one_of(st.binary(max_size=512), st.just(PNG), st.builds(lambda n: PNG[:n], st.integers(0, len(PNG))))
parts = st.lists(st.one_of(
    st.text(max_size=20).map(lambda t: common_pb2.ContentPart(text=t)),
    st.builds(lambda a, token, b: common_pb2.ContentPart(text=a + token + b), st.text(max_size=5),
              st.sampled_from(SPECIAL_TOKENS), st.text(max_size=5)),
    media_bytes.map(image_part),
    media_bytes.map(lambda b: common_pb2.ContentPart(audio=common_pb2.AudioPart(data=b))),
    st.builds(lambda b, rate, ch: pcm_part(b, rate, ch), st.binary(max_size=256), st.integers(0, 400_000),
              st.integers(0, 40)),
    st.builds(lambda frames, times: common_pb2.ContentPart(video=common_pb2.VideoPart(
        frames=[common_pb2.ImagePart(data=f) for f in frames], timestamps=times)),
        st.lists(media_bytes, max_size=3), st.lists(st.floats(allow_nan=True), max_size=3)),
    st.just(common_pb2.ContentPart())), max_size=4)


async def test_fuzzed_parts_end_ok_or_invalid_argument_and_the_service_stays_healthy(omni):
    (client, _), (orc, _), _ = omni
    loop = asyncio.get_running_loop()
    outcomes = {"ok": 0, "invalid": 0}

    async def call(request_parts):
        try:
            r = await client.generate("Hi", parts=request_parts, outputs=["text"], max_tokens=1, timeout=60)
            assert r.final is not None
            outcomes["ok"] += 1
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            assert e.details().startswith("params."), e.details()
            outcomes["invalid"] += 1

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(parts)
    def run(request_parts):
        asyncio.run_coroutine_threadsafe(call(request_parts), loop).result(120)

    await asyncio.to_thread(run)
    assert outcomes["ok"] > 0 and outcomes["invalid"] > 0
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}")
    try:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    finally:
        await channel.close()
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
