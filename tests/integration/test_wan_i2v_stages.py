"""Wan 2.1 image-to-video served as four stages from the published diffusers layout (WanImageToVideoPipeline): the
UMT5 text encoder and the reference image's stage (CLIP vision encoder + the VAE's encoder) both feed the denoise
loop, whose video VAE decode makes the frames diffusers' own WanImageToVideoPipeline makes from the same directory;
batching never changes a video; a request without exactly one image, or an image-to-video model without its image
stage, is refused by name."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.api import Pipeline
from omnistage.contract import tensors
from omnistage.v1 import common_pb2, stage_pb2
from stage_service.runtime.errors import EngineConfigError

from ..harness import call_stage, example, header, stage_servers_fixture, start_stage, tensor_of
from .test_stage_batching import joins_a_burst
from .test_stage_support import assert_denoise_steps_shared
from .test_wan_stages import frames_of

MODEL = "wan-i2v-tiny"
PIPELINE = example(MODEL)
STAGES = ("text-encoder", "image-encoder", "denoise", "vae-decode")
TEXT_TOKENS = 512
# The tiny CLIP: 32 x 32 pixels in 8 x 8 patches (16 tokens and the class token), 32 wide; the condition: 4 mask
# channels + 16 latent channels.
IMAGE_TOKENS, IMAGE_WIDTH, CONDITION_CHANNELS = 17, 32, 20

servers = stage_servers_fixture(PIPELINE, STAGES)


def reference_png(height: int = 40, width: int = 56, seed: int = 0) -> bytes:
    """A random RGB picture as PNG bytes: not the video's size (the stage resizes it as the pipeline does)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def image_part(data: bytes) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(image=common_pb2.ImagePart(data=data))


@pytest.fixture(scope="module")
def reference(model_dir):
    """diffusers' own pipeline on the same directory."""
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline.from_pretrained(model_dir / MODEL)


def prompt_embeddings(reference, prompt: str, negative: str, guided: bool):
    """WanPipeline's prompt encoding over the i2v pipeline's own tokenizer and text encoder (the i2v class's
    own cleaning calls ftfy, which is not installed here)."""
    from diffusers import WanPipeline

    t2v = WanPipeline(tokenizer=reference.tokenizer, text_encoder=reference.text_encoder, transformer=None,
                      vae=reference.vae, scheduler=reference.scheduler)
    with torch.inference_mode():
        return t2v.encode_prompt(prompt, negative, do_classifier_free_guidance=guided,
                                 max_sequence_length=TEXT_TOKENS)


async def staged(servers, params, png: bytes, request_id: str = "r1"):
    first = header(request_id=request_id, parts=[image_part(png)], **params)
    emb = await call_stage(servers["text-encoder"].port, first)
    cond = await call_stage(servers["image-encoder"].port, first)
    lat = await call_stage(servers["denoise"].port, first, [*emb, *cond])
    video = await call_stage(servers["vae-decode"].port, first, lat)
    return emb, cond, lat, video


@pytest.mark.parametrize("guidance", [5.0, 1.0], ids=["guided", "unguided"])
async def test_staged_wan_i2v_makes_the_frames_wan_image_to_video_pipeline_makes(servers, reference, guidance):
    params = dict(prompt="a cat sitting on a red car", negative_prompt="a blue sky", width=48, height=32,
                  num_frames=9, num_inference_steps=4, seed=7, guidance_scale=guidance)
    png = reference_png()
    emb, cond, lat, video = await staged(servers, params, png)

    image = Image.open(io.BytesIO(png))
    with torch.inference_mode():
        want_image = reference.encode_image(image, torch.device("cpu"))
    got_image = tensor_of(cond[0], "image_embeddings")
    assert got_image.shape == (1, IMAGE_TOKENS, IMAGE_WIDTH)
    torch.testing.assert_close(got_image, want_image, atol=1e-5, rtol=1e-5)
    condition = tensor_of(cond[0], "condition")
    assert condition.shape == (1, CONDITION_CHANNELS, 3, 4, 6) and condition.dtype == torch.float32
    assert condition[0, :4, 0].eq(1).all() and condition[0, :4, 1:].eq(0).all()  # the first frame's mask

    guided = guidance > 1.0
    pe, neg_pe = prompt_embeddings(reference, params["prompt"], params["negative_prompt"], guided)
    torch.testing.assert_close(tensor_of(emb[0], "embeddings"), torch.cat([neg_pe, pe]) if guided else pe,
                               atol=1e-5, rtol=1e-5)

    def reference_run(output_type):
        return reference(image, prompt_embeds=pe, negative_prompt_embeds=neg_pe, width=params["width"],
                         height=params["height"], num_frames=params["num_frames"],
                         num_inference_steps=params["num_inference_steps"], guidance_scale=guidance,
                         generator=torch.Generator().manual_seed(params["seed"]), output_type=output_type).frames

    want_latents = reference_run("latent")
    got_latents = tensor_of(lat[-1], "latents")
    assert got_latents.shape == want_latents.shape == (1, 16, 3, 4, 6)
    torch.testing.assert_close(got_latents.float(), want_latents.float(), atol=1e-5, rtol=1e-4)
    want = (reference_run("np")[0] * 255).round().astype(np.uint8)
    got = frames_of(video)
    assert got.shape == want.shape == (9, 32, 48, 3)
    # the VAE stage pads a lone decode to a batch of 2 (batch invariance): at most a level of 8 bits apart
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


async def test_the_reference_image_steers_the_video(servers):
    params = dict(prompt="a red car", width=48, height=32, num_frames=5, num_inference_steps=2, seed=3,
                  guidance_scale=1.0)
    *_, one = await staged(servers, params, reference_png(seed=1), "a")
    *_, other = await staged(servers, params, reference_png(seed=2), "b")
    assert not np.array_equal(frames_of(one), frames_of(other))


async def test_two_videos_at_different_steps_share_model_calls_and_each_gets_its_latents_alone(model_dir):
    await assert_denoise_steps_shared(
        model_dir, MODEL, dict(prompt="an astronaut riding a horse", width=32, height=32, num_frames=5,
                               num_inference_steps=60, seed=1, parts=[image_part(reference_png(seed=4))]),
        dict(prompt="a cat", width=32, height=32, num_frames=5, num_inference_steps=4, seed=2, guidance_scale=1.0,
             parts=[image_part(reference_png(seed=5))]),
        "video", encoders=("text-encoder", "image-encoder"))


async def test_a_reference_conditions_the_same_alone_and_in_a_batch_of_references(servers):
    """The image stage's batch (one CLIP call over the queued references) changes no request's tensors."""
    def tensors_of(chunks):
        return {name: tensor_of(chunks[-1], name) for name in ("image_embeddings", "condition")}

    params = dict(width=48, height=32, num_frames=5)
    probe = (header("probe", parts=[image_part(reference_png(seed=4))], **params), ())
    burst = [(header(f"b{i}", parts=[image_part(reference_png(seed=10 + i, height=24 + 8 * i))], **params), ())
             for i in range(6)]
    alone, joined = await joins_a_burst(servers["image-encoder"], probe, burst, tensors_of)
    for name in alone:
        assert torch.equal(joined[name], alone[name]), name


@pytest.mark.parametrize("parts, message", [
    ([], "image-to-video takes one reference image, got 0"),
    ([image_part(reference_png()), image_part(reference_png(seed=1))], "has 2 media parts; the limit is 1"),
    ([image_part(b"not an image at all")], "params.parts[0].image"),
], ids=["none", "two", "undecodable"])
async def test_the_image_stage_refuses_anything_but_one_image(servers, parts, message):
    import grpc

    first = header(parts=parts, width=48, height=32, num_frames=5, num_inference_steps=2)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["image-encoder"].port, first)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


@pytest.mark.parametrize("size, message", [
    (dict(width=40, height=32, num_frames=5), "params.image.width: must be a multiple of 16"),
    (dict(width=48, height=32, num_frames=6), "params.video.num_frames: must be 4k + 1"),
], ids=["side", "frames"])
async def test_the_image_stage_refuses_a_size_the_denoise_stage_would_before_encoding(servers, size, message):
    import grpc

    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["image-encoder"].port, header(parts=[image_part(reference_png())], **size))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()


async def test_a_denoise_stage_missing_the_condition_is_told_which_tensor(servers):
    import grpc

    params = dict(width=48, height=32, num_frames=5, num_inference_steps=2)
    emb = await call_stage(servers["text-encoder"].port, header(**params))
    with pytest.raises(grpc.aio.AioRpcError) as e:  # the image stage's edge ends with nothing on it
        await call_stage(servers["denoise"].port, header(**params), [*emb, _ended("image-encoder")])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'no input stage sent a tensor "image_embeddings"' in e.value.details()
    assert '"image-encoder" (none)' in e.value.details()
    bad = stage_pb2.Chunk(stage="image-encoder", chunk_id=0, end_of_stream=True,
                          tensors=[tensors.to_proto("image_embeddings", torch.zeros(1, IMAGE_TOKENS, IMAGE_WIDTH))])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["denoise"].port, header(**params), [*emb, bad])
    assert 'no input stage sent a tensor "condition"' in e.value.details()


def _ended(stage: str) -> stage_pb2.Chunk:
    return stage_pb2.Chunk(stage=stage, chunk_id=0, end_of_stream=True)


async def test_an_image_to_video_model_without_its_image_stage_is_refused_at_start(model_dir):
    """The i2v DiT served from a topology whose denoise stage reads the text encoder alone."""
    pipeline = without_image_stage(MODEL)
    with pytest.raises(EngineConfigError, match="needs an input from an image-encoder stage"):
        await start_stage(pipeline, "denoise", model_dir)


def without_image_stage(model: str) -> Pipeline:
    """The example of `model` with its image-encoder stage taken out, and every edge from it."""
    def edit(doc):
        topology = doc["spec"]["topology"]
        topology["stages"] = [s for s in topology["stages"] if s["name"] != "image-encoder"]
        for s in topology["stages"]:
            s["inputs"] = [i for i in s.get("inputs", []) if i["stage"] != "image-encoder"]
        doc["spec"]["deployment"]["stages"].pop("image-encoder")
    return example(model, edit)


async def test_a_text_to_video_model_fed_an_image_stage_is_refused_at_start(model_dir):
    """What the image stage would send, the text-to-video DiT would drop: refused, naming the input."""
    def edit(doc):
        stages = doc["spec"]["topology"]["stages"]
        stages.insert(1, {"name": "image-encoder", "kind": "encoder", "engine": "diffusers", "model": "wan-t2v-tiny",
                          "component": "image_encoder", "emits": ["embeddings"]})
        next(s for s in stages if s["name"] == "denoise")["inputs"].append({"stage": "image-encoder"})
        doc["spec"]["deployment"]["stages"]["image-encoder"] = {"replicas": 1}
    with pytest.raises(EngineConfigError, match="takes no reference image.*image-encoder"):
        await start_stage(example("wan-t2v-tiny", edit), "denoise", model_dir)
