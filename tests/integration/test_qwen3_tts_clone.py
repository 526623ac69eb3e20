"""Voice cloning on the staged Qwen3-TTS Base pipeline (talker -> codec decoder) computes what the model computes:
for a fixed reference clip (tones synthesised at 16 kHz, so the clip is resampled to the encoders' 24 kHz), greedy,
the same PCM (within one 16-bit step: the stage decodes chunk by chunk with left context, the reference in one
piece) as qwen-tts's own `generate_voice_clone` on the same checkpoint, in x-vector mode (no transcript) and in ICL
mode (the clip's transcript: its codes in the talker's prompt and before the decoder's first frames, their audio
not emitted); two requests with different clips sharing the talker's steps get each the frames it gets alone; and
what a Base checkpoint cannot take (no clip, two clips, a named voice, an instruction, a clip that is not audio or
is too long) and a clip on a CustomVoice checkpoint are refused naming the field."""

from __future__ import annotations

import asyncio
import io

import grpc
import numpy as np
import pytest
import soundfile
import torch

from omnistage.client import AsyncOmniClient
from omnistage.v1 import common_pb2

from ..harness import all_queued, call_stage, example, header, served_pipeline, stage_servers, tensor_of

MODEL = "qwen3-tts-base-tiny"
PIPELINE = example(MODEL)
FRAMES = 12  # codec frames: past the first chunk (5), so the decoder decodes with left context
RATE = 16000  # the clips' own rate (the encoders read 24 kHz)
TEXTS = ["Hello world, the quick brown fox.", "Tell me a short story about the sea."]
# Transcripts: with the text, one is longer than a clip's frames (13 for one second, 10 for 0.8 s: the rest of
# the text is read a row a step), the other with the first text shorter than the first clip's (the end of text and
# pad rows lie under its last frames).
REF_TEXTS = ["This is the reference clip, spoken slowly and clearly by the voice to clone.", "Hi."]


def tones(freqs: tuple[float, ...], seconds: float = 1.0) -> np.ndarray:
    """A deterministic clip at RATE: the sum of `freqs`, as 16-bit samples."""
    t = np.arange(int(seconds * RATE)) / RATE
    return np.round(sum(0.2 * np.sin(2 * np.pi * f * t) for f in freqs) * 32767).astype(np.int16)


CLIPS = [tones((220.0, 440.0)), tones((330.0, 990.0, 1500.0), 0.8)]


def wav(samples: np.ndarray) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


def clip_part(samples: np.ndarray) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(audio=common_pb2.AudioPart(data=wav(samples)))


@pytest.fixture(scope="module")
async def staged(model_dir):
    async with served_pipeline(PIPELINE, model_dir) as (orc, stages):
        yield orc, stages


@pytest.fixture(scope="module")
def reference(model_dir):
    """qwen-tts cloning one request at a time, greedy, reading the text as it speaks, with the staged frame bound;
    the clip as the stage decodes it (16-bit samples over 32768) at its own rate."""
    from omnistage.checkpoints.qwen_tts import greedy_speech, reference_model
    from stage_service.engines.omni.audio import to_pcm16

    model = reference_model(model_dir / MODEL)

    def generate(text: str, clip: np.ndarray, ref_text: str | None, language: str = "Auto") -> np.ndarray:
        samples = (clip.astype(np.float32) / 32768).astype(np.float32)
        wav_, rate = greedy_speech(model, text, "", FRAMES, language=language, clip=(samples, RATE),
                                   ref_text=ref_text)
        assert rate == 24000
        return to_pcm16(torch.as_tensor(wav_)).numpy()
    return generate


def pcm_of(result) -> np.ndarray:
    return np.frombuffer(bytes(result.pcm), dtype=np.int16)


@pytest.mark.parametrize("text,clip,ref_text,language", [
    (0, 0, None, ""), (1, 1, None, "english"), (0, 0, 0, ""), (1, 1, 1, ""), (0, 0, 1, "chinese")])
async def test_the_pcm_equals_qwen_tts_generate_voice_clone(staged, reference, text, clip, ref_text, language):
    orc, _ = staged
    transcript = None if ref_text is None else REF_TEXTS[ref_text]
    expected = reference(TEXTS[text], CLIPS[clip], transcript, language or "Auto")
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        r = await client.generate(TEXTS[text], parts=[clip_part(CLIPS[clip])], ref_text=transcript or "",
                                  language=language, max_codec_frames=FRAMES, outputs=["audio"], timeout=120)
    pcm = pcm_of(r)
    assert r.sample_rate == 24000 and r.audio_chunks >= 2
    assert len(pcm) == len(expected) and np.abs(expected).max() > 1000
    assert np.abs(pcm.astype(np.int32) - expected).max() <= 1
    # The clip is heard: another clip gives other speech.
    assert not np.array_equal(reference(TEXTS[text], CLIPS[1 - clip], transcript, language or "Auto"), expected)


async def test_two_cloning_requests_batched_get_each_the_frames_it_gets_alone(staged):
    _, stages = staged
    stage = stages["talker"]

    def ask(i: int, tag: str):
        return header(f"{tag}-{i}", prompt=TEXTS[i], parts=[clip_part(CLIPS[i])], ref_text=REF_TEXTS[i] if i else "",
                      max_codec_frames=FRAMES)

    def frames(chunks) -> list:
        return torch.cat([tensor_of(c, "codes") for c in chunks], dim=1).T.tolist()
    alone_chunks = [await call_stage(stage.port, ask(i, "alone")) for i in range(2)]
    alone = [frames(c) for c in alone_chunks]
    together = await all_queued(stage.engine.scheduler, asyncio.gather(
        *(call_stage(stage.port, ask(i, "together")) for i in range(2))), 2)
    assert [frames(c) for c in together] == alone and alone[0] != alone[1]
    # ICL mode hands the decoder the clip's codes (10 frames for 0.8 s) with the first chunk only.
    assert tensor_of(alone_chunks[1][0], "context_codes").shape == (4, 10)
    assert all("context_codes" not in c.tensors for c in alone_chunks[1][1:] + alone_chunks[0])


async def refused(call, field: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details(), e.value.details()
    return e.value.details()


async def test_what_a_base_checkpoint_cannot_take_is_refused_naming_the_field(staged):
    orc, stages = staged
    clip = clip_part(CLIPS[0])
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        def ask(**kw):
            return client.generate(TEXTS[0], outputs=["audio"], timeout=60, **kw)
        assert "reference clip" in await refused(ask(), "params.parts")
        assert "ref_text" in await refused(ask(ref_text="Hi."), "params.parts")
        await refused(ask(parts=[clip, clip_part(CLIPS[1])]), "params.parts")
        # the orchestrator knows a Base checkpoint has no named voices, and says so before any stage runs
        assert "no named voices" in await refused(ask(parts=[clip], speaker="vivian"), "params.audio.speaker")
        assert "0.25 s" in await refused(ask(parts=[clip_part(tones((440.0,), 0.1))]), "params.parts[0].audio")
        await refused(ask(parts=[clip], instructions="Slowly."), "params.audio.instructions")
        await refused(ask(parts=[clip], ref_text="  "), "params.audio.ref_text")
        not_audio = common_pb2.ContentPart(audio=common_pb2.AudioPart(data=b"GIF89a not a clip at all"))
        await refused(ask(parts=[not_audio]), "params.parts[0].audio")
        await refused(ask(parts=[clip_part(tones((440.0,), 31.0))]), "params.parts[0].audio")  # maxAudioSeconds 30
    # The talker refuses them itself (a stage may be called by others than the orchestrator).
    talker = stages["talker"].port
    for params, field in [({}, "params.parts"), ({"parts": [clip], "instructions": "Slowly."},
                                                 "params.audio.instructions"),
                          ({"parts": [clip], "speaker": "vivian"}, "params.audio.speaker")]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(talker, header("bad", prompt=TEXTS[0], **params))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


async def test_a_clip_on_a_custom_voice_checkpoint_is_refused_naming_the_checkpoint_kind(model_dir):
    async with stage_servers(example("qwen3-tts-tiny"), model_dir, ("talker",)) as servers:
        port = servers["talker"].port
        for params, field in [({"parts": [clip_part(CLIPS[0])]}, "params.parts[0].audio"),
                              ({"ref_text": "Hi."}, "params.audio.ref_text")]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call_stage(port, header("clip", prompt=TEXTS[0], speaker="vivian", **params))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in e.value.details() and "CustomVoice" in e.value.details()


def test_the_kv_bound_counts_the_reference_frames(staged):
    """An ICL prompt holds the clip's frames: the talker's KV bound counts them."""
    _, stages = staged
    talker = stages["talker"].engine.talker
    assert talker.prompt_rows([], 13) == talker.prompt_rows([]) + 13
