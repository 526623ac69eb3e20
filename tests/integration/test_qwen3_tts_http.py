"""/v1/audio/speech over the Qwen3-TTS pipeline, driven by the official `openai` SDK against an in-process
orchestrator and the tiny talker and decoder stages: the body is the PCM qwen-tts's own generate_custom_voice
gives for the input, voice and instructions (greedy, the same frame bound), whole and streamed; a voice the
checkpoint lacks is refused naming `voice`, and nothing is held after."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from orchestrator_service.http_api.translate import CODEC_FRAMES_PER_CHAR

from ..harness import example, start_stage
from .test_http_api import Served, serve

MODEL = "qwen3-tts-tiny"
TTS = example(MODEL)
TEXT = "Hello world, the quick brown fox."


@pytest.fixture(scope="module")
async def served(model_dir):
    stages = {n: await start_stage(TTS, n, model_dir) for n in ("talker", "code2wav")}
    served = await serve(TTS, stages)
    yield served
    await served.orc.drain()
    for stage in stages.values():
        await stage.drain()


@pytest.fixture(scope="module")
def reference(model_dir):
    import torch

    from omnistage.checkpoints.qwen_tts import greedy_speech, reference_model
    from stage_service.engines.omni.audio import to_pcm16

    model = reference_model(model_dir / MODEL)
    frames = max(TTS.limits.default_codec_frames, CODEC_FRAMES_PER_CHAR * len(TEXT))  # as the door budgets them

    def of(speaker: str, instruction: str | None) -> np.ndarray:
        wav, _ = greedy_speech(model, TEXT, speaker, frames, instruction)
        return to_pcm16(torch.as_tensor(wav)).numpy()
    return of


def close_to(body: bytes, expected: np.ndarray) -> bool:
    pcm = np.frombuffer(body, dtype=np.int16)
    return len(pcm) == len(expected) and int(np.abs(pcm.astype(np.int32) - expected).max()) <= 1


@pytest.mark.parametrize("voice, instructions", [("vivian", None), ("ryan", "Say it slowly, almost whispering.")])
async def test_the_speech_body_is_the_models_pcm_whole_and_streamed(served: Served, reference, voice, instructions):
    expected = reference(voice, instructions)
    extra = {"instructions": instructions} if instructions else {}
    whole = await served.aio().audio.speech.create(model=served.model, voice=voice, input=TEXT,
                                                   response_format="pcm", **extra)
    assert close_to(whole.content, expected)
    async with served.aio().audio.speech.with_streaming_response.create(
            model=served.model, voice=voice, input=TEXT, response_format="pcm", **extra) as r:
        pieces = [piece async for piece in r.iter_bytes()]
    assert close_to(b"".join(pieces), expected)
    await served.until_idle()


async def test_a_voice_the_checkpoint_lacks_is_refused_naming_it(served: Served):
    with pytest.raises(openai.BadRequestError) as e:
        await served.aio().audio.speech.create(model=served.model, voice="alloy", input=TEXT, response_format="pcm")
    assert e.value.body["param"] == "voice" and "vivian" in e.value.body["message"]
    await served.until_idle()
