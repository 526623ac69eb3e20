"""Voices a client can find, checked before any stage runs, on both front doors: the voices read from the tiny
Qwen3-Omni and Qwen2.5-Omni checkpoints, listed (model cards, `GET /v1/audio/voices`, DescribePipeline), a
request's voice omitted / "default" / in another case spoken in the default or the checkpoint's spelling, and an
unknown or OpenAI voice refused (400 `audio.voice` / INVALID_ARGUMENT `params.audio.speaker`, listing the
voices) with no stage having seen the request. A checkpoint the orchestrator cannot read leaves the check to
the Talker, as before; a file naming a voice its checkpoint lacks does not start."""

from __future__ import annotations

import base64
import logging

import grpc
import httpx
import numpy as np
import openai
import pytest

from omnistage.checkpoints.voices import pipeline_voices
from omnistage.client import AsyncOmniClient
from omnistage.planner.scrape import REQUESTS
from omnistage.v1 import orchestrator_pb2
from orchestrator_service.server import OrchestratorServer
from orchestrator_service.voices import VoiceError

from ..harness import example, start_stage
from .test_http_api import OMNI, TEXT_ONLY, Served, serve, user

QWEN2_5 = example("qwen2.5-omni-tiny")
# The tiny Qwen3-Omni's voices (tiny_models.qwen3_omni.SPEAKERS, as its config.json lists them) and its default:
# the voice Qwen3-Omni's own generate() speaks in.
QWEN3_VOICES, QWEN3_DEFAULT = ["aiden", "chelsie", "ethan"], "ethan"
ALIASED = example("qwen3-omni-tiny", lambda d: d["spec"]["topology"]["limits"].update(
    defaultVoice="Chelsie", voiceAliases={"alloy": "AIDEN"}))
AUDIO = dict(modalities=["text", "audio"], max_tokens=4, seed=7)
KEY = "voices-key"


def with_limits(name: str, **limits):
    return example(name, lambda d: d["spec"]["topology"]["limits"].update(limits))


def elsewhere(doc: dict) -> None:
    """Every stage's checkpoint in a folder the model store lacks: the orchestrator cannot read its voices."""
    for stage in doc["spec"]["topology"]["stages"]:
        stage["model"] = "no-such-checkpoint"


@pytest.fixture(scope="module")
async def servers(model_dir):
    stages = {n: await start_stage(OMNI, n, model_dir) for n in ("thinker", "talker", "code2wav")}
    served = {
        "omni": await serve(OMNI, stages),
        "aliased": await serve(ALIASED, stages),
        "text": await serve(TEXT_ONLY, {"thinker": stages["thinker"]}),
    }
    # Qwen2.5-Omni with no stage running: a voice that passes the check meets "no replicas" (503), one that
    # does not is refused first (400).
    q25 = OrchestratorServer(QWEN2_5, {}, api_port=0)
    await q25.start()
    served["qwen2.5"] = Served(q25, {})
    keyed = OrchestratorServer(QWEN2_5, {}, api_port=0, api_keys=(KEY,))
    await keyed.start()
    served["keyed"] = Served(keyed, {})
    yield served
    for s in served.values():
        await s.orc.drain()
    for s in stages.values():
        await s.drain()


def seen(stage) -> float:
    """Requests a stage server has ended, whatever their outcome: what it saw."""
    return sum(s.value for m in stage.metrics.registry.collect() for s in m.samples if s.name == f"{REQUESTS}_total")


async def stages_saw(served: Served, send) -> dict[str, float]:
    """How many more requests each stage saw while `send()` ran, once nothing is left in flight (before and after:
    a stage counts a call when it ends, which may be after its client has the answer)."""
    await served.until_idle()
    before = {n: seen(s) for n, s in served.stages.items()}
    await send()
    await served.until_idle()
    return {n: seen(s) - before[n] for n, s in served.stages.items()}


async def chat_audio(served: Served, voice: str | None, **kw):
    audio = {"format": "wav"} | ({"voice": voice} if voice is not None else {})
    r = await served.aio().chat.completions.create(model=served.model, messages=user("Hello"), audio=audio,
                                                   **AUDIO, **kw)
    return np.frombuffer(base64.b64decode(r.choices[0].message.audio.data), dtype=np.uint8)


# ------------------------------------------------------------------ reading the tiny checkpoints

def test_both_tiny_checkpoints_name_their_voices(model_dir):
    q3, q25 = pipeline_voices(OMNI, model_dir), pipeline_voices(QWEN2_5, model_dir)
    assert list(q3.names) == QWEN3_VOICES and q3.default == QWEN3_DEFAULT
    assert q25.names == ("Chelsie", "Ethan") and q25.default == "Chelsie"  # spk_dict.pt's own spelling
    assert pipeline_voices(TEXT_ONLY, model_dir) is None


# ------------------------------------------------------------------ listing

async def test_model_cards_list_the_voices_of_audio_pipelines(servers):
    omni, text = servers["omni"], servers["text"]
    listed = (await omni.aio().models.list()).data
    assert listed[0].model_dump()["voices"] == QWEN3_VOICES and listed[0].model_dump()["default_voice"] == "ethan"
    card = (await omni.aio().models.retrieve(omni.model)).model_dump()
    assert card["voices"] == QWEN3_VOICES and card["default_voice"] == QWEN3_DEFAULT
    card = (await servers["qwen2.5"].aio().models.retrieve(servers["qwen2.5"].model)).model_dump()
    assert card["voices"] == ["Chelsie", "Ethan"] and card["default_voice"] == "Chelsie"
    card = (await text.aio().models.retrieve(text.model)).model_dump()
    assert "voices" not in card and "default_voice" not in card  # text out only


async def test_the_voices_route_lists_voices_default_and_aliases(servers):
    async with httpx.AsyncClient() as http:
        body = (await http.get(f"{servers['aliased'].url}/audio/voices")).json()
        assert body == {"object": "list", "model": "qwen3-omni-tiny", "voices": QWEN3_VOICES,
                        "default_voice": "chelsie", "aliases": {"alloy": "aiden"}, "uploaded_voices": []}
        r = await http.get(f"{servers['qwen2.5'].url}/audio/voices", params={"model": servers["qwen2.5"].model})
        assert r.status_code == 200 and r.json()["voices"] == ["Chelsie", "Ethan"]
        assert r.json()["default_voice"] == "Chelsie"
        r = await http.get(f"{servers['text'].url}/audio/voices")
        assert r.status_code == 200 and r.json()["voices"] == [] and r.json()["default_voice"] is None
        r = await http.get(f"{servers['omni'].url}/audio/voices", params={"model": "tts-1"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


async def test_the_voices_route_takes_the_api_keys(servers):
    url = f"{servers['keyed'].url}/audio/voices"
    async with httpx.AsyncClient() as http:
        refused = await http.get(url)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        listed = await http.get(url, headers={"Authorization": f"Bearer {KEY}"})
        assert listed.status_code == 200 and listed.json()["voices"] == ["Chelsie", "Ethan"]


async def test_describe_pipeline_lists_the_voices(servers):
    async with AsyncOmniClient(f"127.0.0.1:{servers['qwen2.5'].orc.port}") as client:
        info = await client.stub.DescribePipeline(orchestrator_pb2.DescribePipelineRequest(), timeout=30)
    assert list(info.voices) == ["Chelsie", "Ethan"] and info.default_voice == "Chelsie"
    async with AsyncOmniClient(f"127.0.0.1:{servers['text'].orc.port}") as client:
        info = await client.stub.DescribePipeline(orchestrator_pb2.DescribePipelineRequest(), timeout=30)
    assert list(info.voices) == [] and info.default_voice == ""


# ------------------------------------------------------------------ the default, and any case

async def test_default_omitted_and_another_case_speak_as_the_named_voice(servers):
    omni = servers["omni"]
    expected = await chat_audio(omni, QWEN3_DEFAULT)
    for voice in ("default", None, "", "ETHAN", "Default"):
        assert np.array_equal(await chat_audio(omni, voice), expected), voice
    speech = [await omni.aio().audio.speech.create(model=omni.model, voice=v, input="Hi", response_format="wav")
              for v in ("default", "Ethan")]
    assert speech[0].content == speech[1].content


async def test_the_files_default_voice_and_aliases_are_spoken(servers):
    aliased = servers["aliased"]
    assert np.array_equal(await chat_audio(aliased, "default"), await chat_audio(servers["omni"], "chelsie"))
    assert np.array_equal(await chat_audio(aliased, "Alloy"), await chat_audio(servers["omni"], "aiden"))


async def test_the_grpc_door_speaks_the_default_for_default_or_no_voice(servers):
    async with AsyncOmniClient(f"127.0.0.1:{servers['omni'].orc.port}") as client:
        runs = [await client.generate("Hello", max_tokens=4, seed=7, max_codec_frames=15, speaker=s, timeout=120)
                for s in ("default", "", "Ethan")]
    assert all(len(r.pcm) > 0 for r in runs) and runs[0].pcm == runs[1].pcm == runs[2].pcm


# ------------------------------------------------------------------ refused before any stage ran

REFUSED = [("nobody", "is not a voice of this pipeline"), ("alloy", "is an OpenAI voice this pipeline does not map"),
           ("shimmer", "is an OpenAI voice this pipeline does not map")]


@pytest.mark.parametrize("voice, why", REFUSED)
async def test_an_unknown_chat_voice_is_400_before_any_stage_ran(servers, voice, why):
    omni = servers["omni"]
    errors = []

    async def send():
        with pytest.raises(openai.BadRequestError) as e:
            await chat_audio(omni, voice)
        errors.append(e.value)
    assert await stages_saw(omni, send) == {"thinker": 0, "talker": 0, "code2wav": 0}
    assert errors[0].param == "audio.voice" and why in errors[0].message
    assert "aiden, chelsie, ethan (default ethan)" in errors[0].message


async def test_an_unknown_voice_on_a_stream_is_400_before_any_event(servers):
    omni = servers["omni"]
    errors = []

    async def send():
        with pytest.raises(openai.BadRequestError) as e:
            await omni.aio().chat.completions.create(model=omni.model, messages=user("Hello"), stream=True,
                                                     audio={"voice": "coral", "format": "pcm16"}, **AUDIO)
        errors.append(e.value)
    assert await stages_saw(omni, send) == {"thinker": 0, "talker": 0, "code2wav": 0}
    assert errors[0].param == "audio.voice" and "coral" in errors[0].message


async def test_an_unknown_speech_voice_is_400_naming_voice(servers):
    omni = servers["omni"]
    errors = []

    async def send():
        with pytest.raises(openai.BadRequestError) as e:
            await omni.aio().audio.speech.create(model=omni.model, voice="echo", input="Hi", response_format="wav")
        errors.append(e.value)
    assert await stages_saw(omni, send) == {"thinker": 0, "talker": 0, "code2wav": 0}
    assert errors[0].param == "voice" and "echo" in errors[0].message and "aiden, chelsie, ethan" in errors[0].message


async def test_an_unknown_grpc_speaker_is_invalid_argument_before_any_stage_ran(servers):
    omni = servers["omni"]
    errors = []

    async def send():
        async with AsyncOmniClient(f"127.0.0.1:{omni.orc.port}") as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.generate("Hello", max_tokens=4, speaker="nobody", timeout=120)
        errors.append(e.value)
    assert await stages_saw(omni, send) == {"thinker": 0, "talker": 0, "code2wav": 0}
    assert errors[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert errors[0].details().startswith("params.audio.speaker:") and "aiden, chelsie, ethan" in errors[0].details()


async def test_the_voice_is_checked_only_when_audio_is_asked_for(servers):
    omni = servers["omni"]
    r = await omni.aio().chat.completions.create(model=omni.model, messages=user("Hello"), max_tokens=2,
                                                 audio={"voice": "nobody", "format": "wav"}, modalities=["text"])
    assert r.choices[0].message.content is not None
    async with AsyncOmniClient(f"127.0.0.1:{omni.orc.port}") as client:
        r = await client.generate("Hello", max_tokens=2, speaker="nobody", outputs=["text"], timeout=120)
    assert r.final.finish_reason


async def test_a_qwen2_5_voice_is_checked_before_its_stages_are_looked_for(servers):
    q25 = servers["qwen2.5"]
    with pytest.raises(openai.BadRequestError) as e:
        await chat_audio(q25, "aiden")
    assert e.value.param == "audio.voice" and "Chelsie, Ethan (default Chelsie)" in e.value.message
    for voice in ("ethan", "default", None):  # past the check: no stage is running
        with pytest.raises(openai.InternalServerError) as unavailable:
            await chat_audio(q25, voice)
        assert unavailable.value.status_code == 503


# ------------------------------------------------------------------ unknown voices, wrong files

async def test_an_unreadable_checkpoint_leaves_the_voice_to_the_talker(servers, caplog):
    stages = servers["omni"].stages
    with caplog.at_level(logging.INFO, logger="omnistage.orchestrator"):
        unread = await serve(example("qwen3-omni-tiny", elsewhere), stages)
    try:
        assert "cannot read the voices" in caplog.text and "no-such-checkpoint" in caplog.text
        card = (await unread.aio().models.retrieve(unread.model)).model_dump()
        assert card["voices"] == [] and card["default_voice"] is None
        assert len(await chat_audio(unread, "default")) > 0   # the stage's own default voice
        before = seen(stages["thinker"])
        with pytest.raises(openai.BadRequestError) as e:
            await chat_audio(unread, "nobody")
        assert e.value.param == "audio.voice" and 'unknown speaker "nobody"' in e.value.message  # the Talker's
        await unread.until_idle()
        assert seen(stages["thinker"]) == before + 1  # as before: the Thinker ran
    finally:
        await unread.orc.drain()


@pytest.mark.parametrize("limits, why", [(dict(defaultVoice="nobody"), "limits.defaultVoice"),
                                         (dict(voiceAliases={"alloy": "nobody"}), "limits.voiceAliases.alloy")])
def test_a_file_naming_a_voice_its_checkpoint_lacks_does_not_start(model_dir, limits, why):
    with pytest.raises(VoiceError, match=why):
        OrchestratorServer(with_limits("qwen3-omni-tiny", **limits), {})
