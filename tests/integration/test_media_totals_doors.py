"""A request's media totals at both front doors of a real orchestrator (its decode workers real processes)
over the tiny Thinker: parts whose sum passes maxRequestAudioSeconds are INVALID_ARGUMENT on gRPC and a 400
in the OpenAI shape over HTTP, naming the total, its limit and the amount; a request just under is served;
and every decode slot is free afterwards, with the workers that decoded still alive."""

from __future__ import annotations

import base64

import grpc
import numpy as np
import openai
import pytest

from omnistage.client import AsyncOmniClient, audio_part
from orchestrator_service.media_check import DECODE_WORKERS
from orchestrator_service.server import OrchestratorServer

from ..harness import example, start_stage
from ..media_builders import wav
from ..polling import wait_until

# One audio part may be 1 s; a request's audio parts together 1.5 s.
TOTALS = example("qwen3-omni-tiny", lambda d: (
    d["spec"]["topology"].update(stages=d["spec"]["topology"]["stages"][:1],
                                 outputs=[{"modality": "text", "stage": "thinker"}]),
    [d["spec"]["deployment"]["stages"].pop(s) for s in ("talker", "code2wav")],
    d["spec"]["topology"].setdefault("limits", {}).update(maxAudioSeconds=1, maxRequestAudioSeconds=1.5)))
OVER = "brings the request's audio to 1.8 s; the limit per request is 1.5 s (maxRequestAudioSeconds)"


def clip(seconds: float) -> bytes:
    return wav((0.3 * np.sin(np.arange(int(16000 * seconds)) / 7)).astype(np.float32))


@pytest.fixture(scope="module")
async def door(model_dir):
    thinker = await start_stage(TOTALS, "thinker", model_dir)
    orc = OrchestratorServer(TOTALS, {"thinker": [f"127.0.0.1:{thinker.port}"]}, api_port=0)
    await orc.start(wait_for_stages=30)
    client = AsyncOmniClient(f"127.0.0.1:{orc.port}")
    yield orc, client
    await client.close()
    await orc.drain()
    await thinker.drain()


async def all_slots_free(orc: OrchestratorServer) -> None:
    await wait_until(lambda: orc.media.free_slots == DECODE_WORKERS, 60, what="every decode slot free",
                     detail=lambda: orc.media.free_slots)
    assert orc.media.live_workers() >= 1  # the worker that refused the request lives on, idle


async def test_grpc_parts_past_the_request_total_are_invalid_argument_and_just_under_is_served(door):
    orc, client = door
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.generate("What is this?", parts=[audio_part(clip(0.6)) for _ in range(3)], outputs=["text"],
                              max_tokens=2, timeout=120)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"params.parts[2].audio: {OVER}"
    await all_slots_free(orc)
    r = await client.generate("What is this?", parts=[audio_part(clip(0.7)), audio_part(clip(0.7))],
                              outputs=["text"], max_tokens=2, timeout=120)
    assert r.final is not None
    await all_slots_free(orc)


async def test_http_parts_past_the_request_total_are_400_in_the_openai_shape(door):
    orc, _ = door
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{orc.api_port}/v1", api_key="none", max_retries=0)

    def sound(seconds: float) -> dict:
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip(seconds)).decode(),
                                                       "format": "wav"}}
    try:
        with pytest.raises(openai.BadRequestError) as e:
            await api.chat.completions.create(model=orc.pipeline.name, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "text", "text": "Hear:"}] + [sound(0.6)] * 3}])
        assert e.value.status_code == 400 and e.value.type == "invalid_request_error"
        assert e.value.param == "messages[0].content[3]" and OVER in e.value.message
        await all_slots_free(orc)
        r = await api.chat.completions.create(model=orc.pipeline.name, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hear:"}, sound(0.7), sound(0.7)]}])
        assert r.choices[0].message.content
        await all_slots_free(orc)
    finally:
        await api.close()
