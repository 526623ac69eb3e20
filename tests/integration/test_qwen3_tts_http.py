"""/v1/audio/speech over the Qwen3-TTS pipelines, driven by the official `openai` SDK against an in-process
orchestrator and the tiny talker and decoder stages: the body is the PCM qwen-tts's own generate_custom_voice
gives for the input, voice and instructions (greedy, the same frame bound), whole and streamed; a voice the
checkpoint lacks is refused naming `voice`, and nothing is held after. On the Base pipeline (voice cloning) the
body is generate_voice_clone's for `ref_audio` (a data: URL) and `ref_text`; a clip by link, ref_text with
x_vector_only_mode and a named voice are refused naming the field.
"""

from __future__ import annotations

import base64
import contextlib

import numpy as np
import openai
import pytest

from orchestrator_service.http_api.translate import CODEC_FRAMES_PER_CHAR

from ..harness import example, start_stage
from .test_http_api import Served, serve

MODEL, BASE = "qwen3-tts-tiny", "qwen3-tts-base-tiny"
TTS, CLONING = example(MODEL), example(BASE)
TEXT = "Hello world, the quick brown fox."


@contextlib.asynccontextmanager
async def serving(pipeline, model_dir):
    """The pipeline's talker and decoder stages and an orchestrator serving the HTTP API over them."""
    stages = {n: await start_stage(pipeline, n, model_dir) for n in ("talker", "code2wav")}
    served = await serve(pipeline, stages)
    try:
        yield served
    finally:
        await served.orc.drain()
        for stage in stages.values():
            await stage.drain()


@pytest.fixture(scope="module")
async def served(model_dir):
    async with serving(TTS, model_dir) as served:
        yield served


@pytest.fixture(scope="module")
async def served_base(model_dir):
    async with serving(CLONING, model_dir) as served:
        yield served


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


def frames_for(text: str) -> int:
    return max(TTS.limits.default_codec_frames, CODEC_FRAMES_PER_CHAR * len(text))  # as the door budgets them


async def test_the_speech_body_clones_the_reference_clip(served_base: Served, model_dir):
    import torch

    from omnistage.checkpoints.qwen_tts import greedy_speech, reference_model
    from stage_service.engines.omni.audio import to_pcm16

    from .test_qwen3_tts_clone import CLIPS, RATE, REF_TEXTS, wav

    clip = CLIPS[0]
    model = reference_model(model_dir / BASE)
    ref = (clip.astype(np.float32) / 32768, RATE)
    expected = to_pcm16(torch.as_tensor(greedy_speech(model, TEXT, "", frames_for(TEXT), clip=ref,
                                                      ref_text=REF_TEXTS[0])[0])).numpy()
    data_url = "data:audio/wav;base64," + base64.b64encode(wav(clip)).decode()
    body = await served_base.aio().audio.speech.create(model=served_base.model, voice="default", input=TEXT,
                                                       response_format="pcm",
                                                       extra_body={"ref_audio": data_url, "ref_text": REF_TEXTS[0]})
    assert close_to(body.content, expected)
    await served_base.until_idle()


@pytest.mark.parametrize("extra, voice, param", [
    ({"ref_audio": "https://example.com/voice.wav"}, "default", "ref_audio"),
    ({"ref_audio": "data:audio/wav;base64,UklGRg==", "ref_text": "Hi.", "x_vector_only_mode": True}, "default",
     "x_vector_only_mode"),
    ({"ref_text": "Hi."}, "default", "ref_text"),
    ({}, "default", "ref_audio"),
    ({"ref_audio": "data:audio/wav;base64,UklGRg==", "x_vector_only_mode": True}, "vivian", "voice")])
async def test_cloning_fields_that_cannot_be_served_are_refused_naming_them(served_base: Served, extra, voice,
                                                                           param):
    from .test_qwen3_tts_clone import CLIPS, wav

    if extra.get("ref_audio", "").endswith("UklGRg=="):  # a real clip where the refusal is about something else
        extra = {**extra, "ref_audio": "data:audio/wav;base64," + base64.b64encode(wav(CLIPS[0])).decode()}
    with pytest.raises(openai.BadRequestError) as e:
        await served_base.aio().audio.speech.create(model=served_base.model, voice=voice, input=TEXT,
                                                    response_format="pcm", extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    await served_base.until_idle()
