"""The staged pipeline computes what the monolithic model computes: for a fixed prompt and greedy
decoding, the same text tokens and the same codec codes as transformers'
Qwen3OmniMoeForConditionalGeneration.generate on the very same checkpoint (one published-layout
directory, each stage reading its own part of it).

The prompt ids the monolith gets are rendered here from the checkpoint's own chat template with the
checkpoint's tokenizer, as a transformers user would; the Thinker stage must have used the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omnistage.client import AsyncOmniClient
from omnistage.contract import tensors
from omnistage.tiny_models import qwen3_omni

from ..harness import call_stage, example, header, in_engine_process, served_pipeline, stage_servers, tensor_of

PIPELINE = example("qwen3-omni-tiny")
MODEL = "qwen3-omni-tiny"


def chat_ids(root: Path, content) -> list[int]:
    """The user turn `content` in the checkpoint's chat template, with the assistant generation prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root)
    template = json.loads((root / "chat_template.json").read_text())["chat_template"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], chat_template=template,
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load_monolith(root: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(root).eval()


def generate(monolith, prompt_ids: list[int], max_tokens: int, frames: int, stop_at_eos: bool = False):
    with torch.inference_mode():
        return monolith.generate(input_ids=torch.tensor([prompt_ids]), thinker_max_new_tokens=max_tokens,
                                 thinker_eos_token_id=monolith.config.im_end_token_id if stop_at_eos else None,
                                 talker_max_new_tokens=frames + 1, talker_do_sample=False)


def decoded(monolith, talker_out) -> tuple[torch.Tensor, torch.Tensor]:
    """The Talker stage's codes, and their audio decoded the way generate() decodes."""
    codes = torch.cat([tensors.from_proto(t) for c in talker_out for t in c.tensors if t.name == "codes"], 1)
    with torch.inference_mode():
        return codes, monolith.code2wav.chunked_decode(codes[None], chunk_size=300, left_context_size=25)


VLLM_THINKER = example("qwen3-omni-vllm-tiny")  # the Thinker on vLLM, rows out through our KV connector


@pytest.fixture(scope="module", params=[
    "talker-in-process", "talker-engine-process", pytest.param("thinker-vllm", marks=pytest.mark.vllm)])
async def staged(model_dir, request):
    pipeline = {"talker-in-process": PIPELINE, "talker-engine-process": in_engine_process(MODEL, "talker"),
                "thinker-vllm": VLLM_THINKER}[request.param]
    async with served_pipeline(pipeline, model_dir) as (orc, stages):
        assert (stages["talker"].engine.core is not None) == (request.param == "talker-engine-process")
        assert type(stages["thinker"].engine).__name__ == (
            "VllmThinkerEngine" if request.param == "thinker-vllm" else "ThinkerEngine")
        yield orc, stages


@pytest.fixture(scope="module")
def monolith(model_dir):
    return load_monolith(model_dir / MODEL)


@pytest.mark.parametrize("prompt,max_tokens,frames,stop_at_eos", [
    ("Hello there", 10, 30, False),
    ("Tell me a short story about the sea and the wind, please.", 6, 60, True),
])
async def test_same_text_tokens_and_codec_codes(staged, monolith, model_dir, prompt, max_tokens, frames, stop_at_eos):
    orc, stages = staged
    im_end = monolith.config.im_end_token_id
    prompt_ids = chat_ids(model_dir / MODEL, prompt)
    seq, wav = generate(monolith, prompt_ids, max_tokens, frames, stop_at_eos)
    mono_tokens = seq[0, len(prompt_ids):].tolist()
    if stop_at_eos and mono_tokens[-1] == im_end:
        mono_tokens = mono_tokens[:-1]

    # Text tokens, through the orchestrator as a client sees them.
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        r = await client.generate(prompt, max_tokens=max_tokens, ignore_eos=not stop_at_eos,
                                  max_codec_frames=frames, timeout=120)
    staged_tokens = [t for t in r.token_ids if t != im_end]
    assert staged_tokens == mono_tokens

    # Codec codes: the Talker stage's output, decoded the way generate() decodes, equals generate()'s audio.
    params = dict(prompt=prompt, max_tokens=max_tokens, ignore_eos=not stop_at_eos, max_codec_frames=frames)
    thinker_out = await call_stage(stages["thinker"].port, header(**params))
    assert tensor_of(thinker_out[0], "prompt_token_ids").tolist() == prompt_ids  # the template, as the monolith's
    talker_out = await call_stage(stages["talker"].port, header(**params), thinker_out)
    codes, from_staged_codes = decoded(monolith, talker_out)
    assert codes.shape[1] > 0 and torch.equal(from_staged_codes.float(), wav.float())


# ------------------------------------------------------------ the Talker's hidden layer comes from the config

ACCEPT_LAYER = 2  # the tiny Thinker's last layer; the default tiny model takes layer 1


@pytest.fixture(scope="module", params=["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
async def other_layer(tmp_path_factory, request):
    """A tiny model whose talker_config.accept_hidden_layer is ACCEPT_LAYER, served by Thinker and Talker.
    On vLLM the last layer's row leaves the engine before the final norm: the stage applies it."""
    root = tmp_path_factory.mktemp("accept-layer")
    qwen3_omni.build(root / MODEL, accept_hidden_layer=ACCEPT_LAYER)
    pipeline = VLLM_THINKER if request.param == "vllm" else PIPELINE
    async with stage_servers(pipeline, root, ("thinker", "talker")) as stages:
        yield root / MODEL, stages


async def test_the_thinker_sends_the_hidden_layer_the_checkpoint_names(other_layer):
    root, stages = other_layer
    monolith = load_monolith(root)
    assert monolith.config.talker_config.accept_hidden_layer == ACCEPT_LAYER
    thinker = stages["thinker"].engine
    assert (thinker.accept_layer if hasattr(thinker, "rows") else thinker.thinker.accept_layer) == ACCEPT_LAYER
    # An audio placeholder in the user turn: the Talker conditions that position on the accepted hidden
    # layer (text positions use the embeddings), so the layer shows in the codes.
    prompt_ids = chat_ids(root, [{"type": "audio"}, {"type": "text", "text": "Hello there"}])
    assert monolith.config.thinker_config.audio_token_id in prompt_ids
    _, wav = generate(monolith, prompt_ids, max_tokens=5, frames=20)

    params = dict(prompt_token_ids=prompt_ids, max_tokens=5, ignore_eos=True, max_codec_frames=20)
    thinker_out = await call_stage(stages["thinker"].port, header(**params))
    talker_out = await call_stage(stages["talker"].port, header(**params), thinker_out)
    codes, from_staged_codes = decoded(monolith, talker_out)
    assert codes.shape[1] > 0 and torch.equal(from_staged_codes.float(), wav.float())

    # The case tells layers apart: with the default layer the monolith speaks otherwise.
    monolith.config.talker_config.accept_hidden_layer = qwen3_omni.ACCEPT_HIDDEN_LAYER
    _, wav_default_layer = generate(monolith, prompt_ids, max_tokens=5, frames=20)
    assert not torch.equal(wav_default_layer.float(), wav.float())


# -------------------------------------------------------- media: the vLLM Thinker takes them only from an encoder stage

async def test_audio_without_an_encoder_stage_is_served_by_transformers_and_refused_by_vllm(staged):
    import grpc

    from omnistage.v1 import common_pb2

    from ..media_builders import wav
    from .test_omni_input import SAMPLES

    orc, stages = staged
    on_vllm = hasattr(stages["thinker"].engine, "rows")
    parts = [common_pb2.ContentPart(audio=common_pb2.AudioPart(data=wav(SAMPLES, subtype="FLOAT")))]
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        if not on_vllm:
            r = await client.generate(parts=parts, max_tokens=4, ignore_eos=True, max_codec_frames=8, timeout=120)
            assert len(r.token_ids) == 4
            return
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # at admission: the pipeline reads text only
            await client.generate(parts=parts, max_tokens=4, ignore_eos=True, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "audio" in refused.value.details()
    h = header(prompt="", max_tokens=4, ignore_eos=True)  # and at the stage, should a request reach it
    h.header.params.parts.extend(parts)
    with pytest.raises(grpc.aio.AioRpcError) as at_stage:
        await call_stage(stages["thinker"].port, h)
    assert at_stage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "encoder stage" in at_stage.value.details()


# ------------------------------------------------------------ media through an encoder stage into a vLLM Thinker

@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen3-omni", "qwen2.5-omni"])
async def test_images_and_video_through_a_vllm_thinker_give_the_transformers_pipelines_text_and_speech(model_dir,
                                                                                                       family):
    """Text, an image and a video in, text and speech out, through the orchestrator and every stage: with
    the Thinker on vLLM (3-D rotary positions; Qwen3-Omni's deepstack rows) the answer is exactly the
    transformers Thinker's (the Talker's codes from its rows, decoded to the same PCM)."""
    from .test_omni_input import part
    from .test_vllm_thinker import FAMILIES

    parts = [part("text", "Look"), part("image"), part("text", "and watch"), part("video")]
    answers = {}
    for name, pipeline in zip(("transformers", "vllm"), FAMILIES[family]):
        async with served_pipeline(pipeline, model_dir) as (orc, stages):
            assert hasattr(stages["thinker"].engine, "rows") == (name == "vllm")
            async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
                answers[name] = await client.generate(parts=parts, max_tokens=6, ignore_eos=True,
                                                      max_codec_frames=12, timeout=180)
    ref, ours = answers["transformers"], answers["vllm"]
    assert len(ref.token_ids) == 6 and ours.token_ids == ref.token_ids and ours.text == ref.text
    assert ref.pcm and ours.pcm == ref.pcm
