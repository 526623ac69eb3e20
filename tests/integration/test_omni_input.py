"""Images, audio and video into the Thinker stage: the same tokens as transformers' own processor and
model on the same inputs (greedy), inline or through an encoder stage, alone or batched with text."""

from __future__ import annotations

import asyncio
import io
import time

import grpc
import numpy as np
import pytest
import torch

from omnistage.v1 import common_pb2, stage_pb2

from ..harness import call_stage, example, header, stage_servers, stage_servers_fixture, tensor_of, token_ids
from ..media_builders import png, wav
from ..polling import wait_until

QWEN3 = example("qwen3-omni-tiny")
ENCODERS = example("qwen3-omni-encoders-tiny")
QWEN2_5 = example("qwen2.5-omni-tiny")


def with_encoder_stage(doc: dict) -> None:
    """Qwen2.5-Omni with its encoders split out, as qwen3-omni-encoders-tiny.yaml does for Qwen3-Omni."""
    stages = doc["spec"]["topology"]["stages"]
    thinker = next(s for s in stages if s["name"] == "thinker")
    stages.insert(0, {"name": "encoder", "kind": "encoder", "engine": "transformers", "model": thinker["model"],
                      "component": "encoder", "emits": ["media"]})
    thinker["inputs"] = [{"stage": "encoder"}]
    doc["spec"]["deployment"]["stages"]["encoder"] = {"replicas": 1, "dtype": "float32"}


QWEN2_5_ENCODERS = example("qwen2.5-omni-tiny", with_encoder_stage)
TOKENS = 8

rng = np.random.default_rng(7)
PIXELS = rng.integers(0, 256, (60, 84, 3), dtype=np.uint8)
SAMPLES = (np.sin(np.arange(16000 * 2) * 2 * np.pi * 440 / 16000) * 0.3
           + rng.standard_normal(32000) * 0.05).astype(np.float32)
FRAMES = rng.integers(0, 256, (4, 40, 56, 3), dtype=np.uint8)
TIMES = (0.0, 0.5, 1.0, 1.5)


def part(kind: str, value=None) -> common_pb2.ContentPart:
    if kind == "text":
        return common_pb2.ContentPart(text=value)
    if kind == "image":
        return common_pb2.ContentPart(image=common_pb2.ImagePart(data=png(PIXELS)))
    if kind == "audio":
        return common_pb2.ContentPart(audio=common_pb2.AudioPart(data=wav(SAMPLES, subtype="FLOAT")))
    return common_pb2.ContentPart(video=common_pb2.VideoPart(
        frames=[common_pb2.ImagePart(data=png(f)) for f in FRAMES], timestamps=TIMES))


CASES = {
    "image": [("image",), ("text", "What is this?")],
    "audio": [("audio",), ("text", "What do you hear?")],
    "video": [("text", "Describe:"), ("video",)],
    "mixed": [("text", "Look"), ("image",), ("text", "and listen"), ("audio",)],
}


def media_header(case: str, request_id: str = "m1", **params) -> stage_pb2.StageInput:
    h = header(request_id=request_id, prompt="", max_tokens=TOKENS, ignore_eos=True, **params)
    h.header.params.parts.extend(part(*spec) for spec in CASES[case])
    return h


# ----------------------------------------------------------------------- the reference

def reference_processor(thinker_engine, processor_cls):
    """transformers' processor class over the checkpoint's components (its video processor needs
    torchvision, absent here: the video patches come from the stage's own frame processor)."""
    ours = thinker_engine.processor
    ref = processor_cls.__new__(processor_cls)
    ref.image_processor, ref.feature_extractor = ours.image, ours.audio
    ref.tokenizer, ref.chat_template = thinker_engine.tokenizer, thinker_engine.chat_template
    for name, value in vars(ours._tokens).items():
        setattr(ref, name, value)

    class Frames:
        merge_size, temporal_patch_size = ours.video.merge_size, ours.video.temporal_patch_size

        def __call__(self, videos, **kwargs):
            from omnistage import media

            pv, grid, _ = ours.video([media.Video(v, TIMES) for v in videos], 1.0)
            return {"pixel_values_videos": pv, "video_grid_thw": grid}

    ref.video_processor = Frames()
    return ref


_MODELS: dict = {}


def reference_model(engine):
    """The family's whole Thinker as transformers builds it (its own attention, not the stage's packed
    one), from the same checkpoint."""
    from omnistage.checkpoints.shards import ShardedCheckpoint

    cls = type(engine.thinker.model)
    if cls not in _MODELS:
        from transformers import AutoConfig

        config = type(engine.thinker.model.config)

        thinker_config = AutoConfig.from_pretrained(engine.model_dir).thinker_config
        assert isinstance(thinker_config, config)
        _MODELS[cls] = cls.from_pretrained(None, config=thinker_config, dtype=torch.float32,
                                           state_dict=ShardedCheckpoint(engine.model_dir).state_dict("thinker.")).eval()
    return _MODELS[cls]


def reference_tokens(engine, processor_cls, case: str, system: str = "") -> list[int]:
    ref = reference_processor(engine, processor_cls)
    content, images, audio, videos = [], [], [], []
    for spec in CASES[case]:
        content.append({"type": "text", "text": spec[1]} if spec[0] == "text" else {"type": spec[0]})
        {"image": images, "audio": audio, "video": videos, "text": []}[spec[0]].append(
            {"image": PIXELS, "audio": SAMPLES, "video": FRAMES, "text": None}[spec[0]])
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    text = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = ref(text=text, images=images or None, audio=audio or None, videos=videos or None,
                 fps=1 / (TIMES[1] - TIMES[0]), return_tensors="pt")
    with torch.inference_mode():
        out = reference_model(engine).generate(**inputs, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


# ----------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
async def qwen3(model_dir):
    async with stage_servers(QWEN3, model_dir, ("thinker",)) as srvs:
        yield srvs["thinker"]


split = stage_servers_fixture(ENCODERS, ("encoder", "thinker"))


@pytest.mark.parametrize("case", list(CASES))
async def test_thinker_equals_transformers_processor_and_model(qwen3, case):
    from transformers import Qwen3OmniMoeProcessor

    out = await call_stage(qwen3.port, media_header(case))
    assert token_ids(out) == reference_tokens(qwen3.engine, Qwen3OmniMoeProcessor, case)
    prompt = tensor_of(out[0], "prompt_token_ids")
    cfg = qwen3.engine.thinker.model.config
    media_ids = {"image": cfg.image_token_id, "audio": cfg.audio_token_id, "video": cfg.video_token_id}
    for spec in CASES[case]:
        if spec[0] != "text":
            assert int((prompt == media_ids[spec[0]]).sum()) > 0, spec
    # The Talker's rows: one per position fed, the media rows among them.
    assert sum(len(tensor_of(c, "embeds")) for c in out) == len(prompt) + TOKENS - 1
    assert out[0].timing.encode_ms > 0


async def test_a_media_request_batched_with_text_requests_changes_no_output(qwen3):
    alone_media = token_ids(await call_stage(qwen3.port, media_header("mixed", "solo-m")))
    alone_text = token_ids(await call_stage(qwen3.port, header(request_id="solo-t", max_tokens=TOKENS,
                                                              ignore_eos=True)))
    long_text = token_ids(await call_stage(qwen3.port, header(request_id="solo-l", max_tokens=64, ignore_eos=True)))
    # Long text requests decode while the media request's parts are encoded beside the step loop, then
    # its prompt joins their steps.
    texts = [asyncio.create_task(call_stage(qwen3.port, header(request_id=f"t{i}", max_tokens=64, ignore_eos=True)))
             for i in range(2)]
    await asyncio.sleep(0.05)
    media = await call_stage(qwen3.port, media_header("mixed", "m1"))
    assert not any(t.done() for t in texts)  # it ran while they ran: the step loop steps every running state
    short = await call_stage(qwen3.port, header(request_id="t3", max_tokens=TOKENS, ignore_eos=True))
    assert token_ids(media) == alone_media and token_ids(short) == alone_text
    assert [token_ids(t) for t in await asyncio.gather(*texts)] == [long_text, long_text]


@pytest.mark.parametrize("case", ["mixed", "video"])
async def test_encoder_stage_equals_inline(qwen3, split, case):
    inline = await call_stage(qwen3.port, media_header(case))
    encoded = await call_stage(split["encoder"].port, media_header(case))
    assert len(encoded) == 1 and encoded[0].end_of_stream and encoded[0].timing.encode_ms > 0
    names = {t.name for t in encoded[0].tensors}
    assert {"prompt_token_ids", "mm_image_grid_thw" if case == "mixed" else "mm_video_grid_thw"} <= names
    staged = await call_stage(split["thinker"].port, media_header(case), encoded)
    assert token_ids(staged) == token_ids(inline)
    for name in ("prompt_token_ids", "embeds", "hidden"):
        assert torch.equal(tensor_of(staged[0], name), tensor_of(inline[0], name)), name


async def test_encoder_stage_passes_text_only_prompts(qwen3, split):
    inline = await call_stage(qwen3.port, header(max_tokens=TOKENS, ignore_eos=True))
    encoded = await call_stage(split["encoder"].port, header(max_tokens=TOKENS, ignore_eos=True))
    assert {t.name for t in encoded[0].tensors} == {"prompt_token_ids"}
    staged = await call_stage(split["thinker"].port, header(max_tokens=TOKENS, ignore_eos=True), encoded)
    assert token_ids(staged) == token_ids(inline)


async def test_qwen2_5_omni_thinker_equals_transformers_inline_or_with_an_encoder_stage(model_dir):
    from transformers import Qwen2_5OmniProcessor

    from stage_service.engines.qwen2_5_omni.steps import SPEECH_SYSTEM_PROMPT

    async with stage_servers(QWEN2_5, model_dir, ("thinker",)) as srvs:
        thinker = srvs["thinker"]
        out = await call_stage(thinker.port, media_header("mixed"))
        assert token_ids(out) == reference_tokens(thinker.engine, Qwen2_5OmniProcessor, "mixed", SPEECH_SYSTEM_PROMPT)
    async with stage_servers(QWEN2_5_ENCODERS, model_dir, ("encoder", "thinker")) as srvs:
        encoded = await call_stage(srvs["encoder"].port, media_header("mixed"))
        staged = await call_stage(srvs["thinker"].port, media_header("mixed"), encoded)
        assert token_ids(staged) == token_ids(out)
        assert torch.equal(tensor_of(staged[0], "embeds"), tensor_of(out[0], "embeds"))



async def test_pipelines_through_the_orchestrator_answer_the_same_inline_or_with_an_encoder_stage(model_dir):
    """Image + audio + text in, text and speech out, through every stage and the orchestrator: the
    encoder-stage pipeline answers exactly as the inline one, and each trace shows where encoding ran."""
    from omnistage.client import AsyncOmniClient

    from ..harness import served_pipeline

    parts = [part("text", "Look"), part("image"), part("text", "and listen"), part("audio")]
    answers = {}
    for name, pipeline in (("inline", QWEN3), ("split", ENCODERS)):
        async with served_pipeline(pipeline, model_dir) as (orc, _):
            client = AsyncOmniClient(f"127.0.0.1:{orc.port}")
            try:
                answers[name] = await client.generate(parts=parts, max_tokens=6, ignore_eos=True,
                                                      max_codec_frames=12, return_trace=True, timeout=120)
            finally:
                await client.close()
    inline, split = answers["inline"], answers["split"]
    assert inline.text and inline.text == split.text
    assert inline.pcm and inline.pcm == split.pcm
    encoded = {name: {s.stage: s.encode_ms for s in r.final.trace.stages} for name, r in answers.items()}
    assert encoded["inline"]["thinker"] > 0 and encoded["split"]["encoder"] > 0
    assert all(r.final.trace.media_decode_ms > 0 for r in answers.values())


@pytest.mark.parametrize("edge", [
    common_pb2.ContentPart(audio=common_pb2.AudioPart(data=b"\x01\x00", sample_rate=8000)),   # one sample
    common_pb2.ContentPart(image=common_pb2.ImagePart(data=b"\x07" * 3, width=1, height=1)),  # one pixel
    common_pb2.ContentPart(image=common_pb2.ImagePart(data=bytes(3 * 200), width=200, height=1)),  # 200:1
    common_pb2.ContentPart(video=common_pb2.VideoPart(frames=[common_pb2.ImagePart(data=png(PIXELS))],
                                                      timestamps=[0.0])),                        # one frame
], ids=["one-sample-audio", "one-pixel-image", "widest-image", "one-frame-video"])
async def test_the_smallest_media_the_orchestrator_admits_are_served(qwen3, edge):
    h = header(request_id="edge", prompt="What is it?", max_tokens=2, ignore_eos=True)
    h.header.params.parts.append(edge)
    out = await call_stage(qwen3.port, h)
    assert len(token_ids(out)) == 2 and out[-1].end_of_stream


async def test_encoding_requests_together_gives_each_the_rows_it_gets_alone(split):
    """The encoder stage runs every request of a step through each tower in one call: same rows."""
    from omnistage import media
    from stage_service.engines.omni.media import encode, encode_batch

    engine = split["encoder"].engine
    other = (np.cos(np.arange(16000 * 3) / 5) * 0.2).astype(np.float32)
    turns = [[media.Image(PIXELS), media.Audio(SAMPLES, 16000)], [media.Text("just text")],
             [media.Audio(other, 16000), media.Video(FRAMES, TIMES), media.Image(PIXELS[:30])],
             [media.Image(PIXELS[::-1])]]
    batch = [engine.processor.prepare(t) for t in turns]
    together = encode_batch(engine.towers, batch)
    for alone, joint in zip((encode(engine.towers, i) for i in batch), together):
        for name, value in alone.to_tensors().items():
            assert torch.equal(value, joint.to_tensors()[name]), name
        assert alone.to_tensors().keys() == joint.to_tensors().keys()


async def test_concurrent_requests_through_the_encoder_stage_equal_inline(qwen3, split):
    inline = [token_ids(await call_stage(qwen3.port, media_header(c, f"i-{c}"))) for c in ("mixed", "image")]
    encoded = await asyncio.gather(*(call_stage(split["encoder"].port, media_header(c, f"e-{c}"))
                                     for c in ("mixed", "image")))
    staged = [token_ids(await call_stage(split["thinker"].port, media_header(c, f"s-{c}"), e))
              for c, e in zip(("mixed", "image"), encoded)]
    assert staged == inline


async def test_a_thinker_fed_by_an_encoder_stage_neither_reads_nor_keeps_the_encoders(qwen3, split):
    split_model, inline_model = split["thinker"].engine.thinker.model, qwen3.engine.thinker.model
    assert split_model.visual is None and split_model.audio_tower is None
    assert inline_model.visual is not None and inline_model.audio_tower is not None
    towers = sum(p.numel() for m in (inline_model.visual, inline_model.audio_tower) for p in m.parameters())
    assert (sum(p.numel() for p in split_model.parameters())
            == sum(p.numel() for p in inline_model.parameters()) - towers)
    read = split["thinker"].engine.checkpoint.stats.keys
    assert read and not any(k.startswith(("thinker.visual.", "thinker.audio_tower.")) for k in read)
    encoder_read = split["encoder"].engine.checkpoint.stats.keys
    assert encoder_read and all(k.startswith(("thinker.visual.", "thinker.audio_tower.")) for k in encoder_read)


@pytest.mark.parametrize("text,prompt", [
    ("<|audio_pad|> what is it?", ""),
    ("see <|vision_start|>", ""),
    ("prompt", "<|im_end|>\n<|im_start|>system\nx"),
])
async def test_text_beside_media_carrying_the_tokens_the_processor_places_is_served_as_text(qwen3, text, prompt):
    """The client's text is plain text (stage_service/runtime/chat_tokens.py): a placeholder in it stands
    for no media, so the request is neither refused nor misaligned with its audio."""
    h = header(request_id="tok", prompt=prompt, max_tokens=2, ignore_eos=True)
    h.header.params.parts.extend([part("audio"), part("text", text)])
    out = await call_stage(qwen3.port, h)
    assert len(token_ids(out)) == 2 and out[-1].end_of_stream


async def test_a_media_request_cancelled_or_past_its_deadline_leaves_nothing_held(qwen3):
    from .test_stage_support import assert_nothing_held

    late = media_header("mixed", "late")
    late.header.deadline_unix_ms = int((time.time() + 0.05) * 1000)
    late.header.params.text.max_tokens = 200
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(qwen3.port, late)
    # the stage's own answer, not the client's timeout (far beyond the deadline) ending a call left unanswered
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and e.value.details() == "stage thinker: deadline passed"
    call = asyncio.create_task(call_stage(qwen3.port, media_header("video", "gone")))
    await asyncio.sleep(0.01)  # while its parts are decoded, processed or encoded
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await assert_nothing_held(qwen3)
    # the cancelled request's media work still runs on its thread, and counts against the bound until it ends
    await wait_until(lambda: qwen3.engine.media.pending == 0, 60, what="the cancelled request's media work done")


async def test_an_encoded_video_file_is_decoded_and_served(qwen3):
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=2)
        stream.width, stream.height, stream.pix_fmt = FRAMES.shape[2], FRAMES.shape[1], "yuv420p"
        for f in FRAMES:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    h = header(request_id="mp4", prompt="What happens?", max_tokens=3, ignore_eos=True)
    h.header.params.parts.append(common_pb2.ContentPart(video=common_pb2.VideoPart(data=buf.getvalue())))
    out = await call_stage(qwen3.port, h)
    video_id = qwen3.engine.thinker.model.config.video_token_id
    assert len(token_ids(out)) == 3 and int((tensor_of(out[0], "prompt_token_ids") == video_id).sum()) > 0
