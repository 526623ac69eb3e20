"""The staged Qwen3-TTS pipeline (talker -> codec decoder) computes what the model computes: for a fixed text,
speaker and instruction, greedy, the same codec frames and the same PCM (within one 16-bit step: the stage
decodes chunk by chunk with left context, the reference in one piece) as qwen-tts's own `generate_custom_voice`
on the same checkpoint; two requests sharing the talker's steps get each the frames it gets alone, and so do four
under a KV budget that holds two (preempted and fed again); a voice the checkpoint lacks and an empty text are
refused naming the field. Through gRPC Generate and the stages alone."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest
import torch

from omnistage.client import AsyncOmniClient

from ..harness import all_queued, call_stage, example, header, served_pipeline, stage_servers, tensor_of

MODEL = "qwen3-tts-tiny"
PIPELINE = example(MODEL)
FRAMES = 12  # codec frames: past the first chunk (5), so the decoder decodes with left context
TEXTS = ["Hello world, the quick brown fox.", "Tell me a short story about the sea.",
         "Hello"]  # one token: nothing left to read after the prompt's first text token


@pytest.fixture(scope="module")
async def staged(model_dir):
    async with served_pipeline(PIPELINE, model_dir) as (orc, stages):
        yield orc, stages


@pytest.fixture(scope="module")
def reference(model_dir):
    """qwen-tts generating one request at a time, greedy, reading the text as it speaks (non_streaming_mode
    off: what the staged talker does), with a frame bound as the staged request's."""
    from omnistage.checkpoints.qwen_tts import greedy_speech, reference_model
    from stage_service.engines.omni.audio import to_pcm16

    model = reference_model(model_dir / MODEL)

    def generate(text: str, speaker: str, instruction: str | None = None, language: str = "Auto"):
        wav, rate = greedy_speech(model, text, speaker, FRAMES, instruction, language)
        assert rate == 24000
        return to_pcm16(torch.as_tensor(wav)).numpy()
    return generate


def pcm_of(result) -> np.ndarray:
    return np.frombuffer(bytes(result.pcm), dtype=np.int16)


@pytest.mark.parametrize("which,speaker,instruction,language", [
    (0, "vivian", "", ""), (1, "ryan", "Speak slowly, in a low voice.", ""), (0, "dylan", "", "chinese"),
    (1, "vivian", "", "english"), (2, "vivian", "", "")])
async def test_the_pcm_equals_qwen_tts_generate(staged, reference, which, speaker, instruction, language):
    orc, _ = staged
    expected = reference(TEXTS[which], speaker, instruction or None, language or "Auto")
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        r = await client.generate(TEXTS[which], speaker=speaker, instructions=instruction, language=language,
                                  max_codec_frames=FRAMES, outputs=["audio"], timeout=120)
    pcm = pcm_of(r)
    assert r.sample_rate == 24000 and r.audio_chunks >= 2  # the first chunk (5 frames) comes before the rest
    assert len(pcm) == len(expected) and np.abs(expected).max() > 1000  # the tiny codec is not silent
    assert np.abs(pcm.astype(np.int32) - expected).max() <= 1
    # The requests are told apart: another speaker, another text, an instruction each change the speech.
    assert not np.array_equal(reference(TEXTS[which], "ryan" if speaker != "ryan" else "vivian"), expected)


async def test_two_requests_batched_get_each_the_frames_it_gets_alone(staged):
    _, stages = staged
    stage = stages["talker"]

    def ask(i: int, tag: str):
        return header(f"{tag}-{i}", prompt=TEXTS[i], speaker=("vivian", "ryan")[i], max_codec_frames=FRAMES)

    def frames(chunks) -> list:
        return torch.cat([tensor_of(c, "codes") for c in chunks], dim=1).T.tolist()
    alone = [frames(await call_stage(stage.port, ask(i, "alone"))) for i in range(2)]
    together = await all_queued(stage.engine.scheduler, asyncio.gather(
        *(call_stage(stage.port, ask(i, "together")) for i in range(2))), 2)
    assert [frames(c) for c in together] == alone and alone[0] != alone[1]
    assert all(len(f) == FRAMES for f in alone)


async def refused(call, field: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details(), e.value.details()
    return e.value.details()


async def test_a_voice_the_checkpoint_lacks_and_an_empty_text_are_refused_naming_the_field(staged):
    orc, stages = staged
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        message = await refused(client.generate("Hello", speaker="alloy", outputs=["audio"], timeout=60),
                                "params.audio.speaker")
        assert "vivian" in message  # the refusal lists the checkpoint's voices
        await refused(client.generate("   ", speaker="vivian", outputs=["audio"], timeout=60), "params.prompt")
        await refused(client.generate("Hello", speaker="vivian", language="klingon", outputs=["audio"], timeout=60),
                      "params.audio.language")
    # The talker refuses them itself (a stage may be called by others than the orchestrator).
    talker = stages["talker"].port
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(talker, header("bad-voice", prompt="Hello", speaker="nobody"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.audio.speaker" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(talker, header("empty", prompt="", speaker="vivian"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.prompt" in e.value.details()


def with_kv_budget(kv_cache_bytes: int):
    def edit(doc):
        doc["spec"]["deployment"]["stages"]["talker"]["engineArgs"] = {"kvCacheBytes": kv_cache_bytes}
    return example(MODEL, edit)


async def test_under_a_kv_budget_for_two_every_request_gets_its_unbounded_frames(staged, model_dir):
    """Four requests under a budget that holds two at their longest: each gets the frames it gets unbounded
    (some preempted on the way and their rows fed again); a request that could never fit is refused at once."""
    from stage_service.engines.omni.talker_core import talker_kv_per_token
    from stage_service.runtime.kv_budget import KvPages

    _, stages = staged
    unbounded_stage = stages["talker"]

    def ask(i: int, frames: int = FRAMES):
        return header(f"kv-{i}", prompt=TEXTS[i % 2], speaker=("vivian", "ryan", "dylan", "ryan")[i],
                      max_codec_frames=frames)
    unbounded = [await call_stage(unbounded_stage.port, ask(i)) for i in range(4)]
    pages = KvPages(talker_kv_per_token(unbounded_stage.engine.talker, unbounded_stage.engine.dtype))
    longest = unbounded_stage.engine.talker.prompt_rows([]) + FRAMES
    async with stage_servers(with_kv_budget(2 * pages.bytes_for(longest)), model_dir, ("talker",)) as servers:
        talker = servers["talker"]
        bounded = await all_queued(talker.engine.scheduler,
                                   asyncio.gather(*(call_stage(talker.port, ask(i)) for i in range(4))), 4)
        assert [torch.cat([tensor_of(c, "codes") for c in b], 1).tolist() for b in bounded] == \
            [torch.cat([tensor_of(c, "codes") for c in u], 1).tolist() for u in unbounded]
        sched = talker.engine.scheduler
        assert sched.preemptions > 0 and 0 < sched.kv_peak <= 2 * pages.bytes_for(longest)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(talker.port, ask(0, frames=3 * longest))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "params.audio.max_codec_frames" in e.value.details()


def variant(model_dir, tmp_path, **config):
    """A model store holding the tiny checkpoint with `config`'s keys changed in its config.json (every other
    file linked)."""
    src, dst = model_dir / MODEL, tmp_path / MODEL
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    (dst / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **config}))
    return tmp_path


@pytest.mark.parametrize("key, value", [("tts_model_type", "voice_design"),
                                        ("tokenizer_type", "qwen3_tts_tokenizer_25hz")])
def test_a_checkpoint_the_family_cannot_serve_is_refused_naming_its_config_key(model_dir, tmp_path, key, value):
    from omnistage.checkpoints.configs import CheckpointError
    from stage_service.engines.qwen3_tts.steps import TtsTalker

    with pytest.raises(CheckpointError, match=f"{key} '{value}' is not served"):
        TtsTalker(variant(model_dir, tmp_path, **{key: value}) / MODEL)


async def test_the_small_custom_voice_model_refuses_an_instruction_as_qwen_tts_gives_it_none(model_dir, tmp_path):
    """qwen-tts drops the instruction for its 0.6B CustomVoice model: the talker refuses one rather than speak a
    prompt the model never saw."""
    store = variant(model_dir, tmp_path, tts_model_size="0b6")
    async with stage_servers(PIPELINE, store, ("talker",)) as servers:
        port = servers["talker"].port
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(port, header("instructed", prompt="Hello", speaker="vivian", instructions="Slowly."))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.audio.instructions" in e.value.details()
        assert await call_stage(port, header("plain", prompt="Hello", speaker="vivian", max_codec_frames=3))
