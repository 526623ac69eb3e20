"""FLUX.1 Kontext image editing (FluxKontextPipeline) served as four stages from the published diffusers layout: the
text encoders and the image to edit (the VAE's encoder, at its preferred Kontext resolution) feed the denoise loop,
which puts the image's latent tokens after the noise's at every step; the edited image is the one diffusers' own
FluxKontextPipeline makes from the same directory, two edits batched are each the edit made alone, and what cannot
be edited is refused by name."""

from __future__ import annotations

import io

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.contract import tensors
from omnistage.v1 import stage_pb2
from stage_service.runtime.errors import EngineConfigError

from ..harness import call_stage, example, header, stage_servers_fixture, start_stage, tensor_of
from .test_sd3_stages import png_pixels
from .test_stage_support import assert_denoise_steps_shared
from .test_wan_i2v_stages import image_part, reference_png, without_image_stage

MODEL = "flux-kontext-tiny"
PIPELINE = example(MODEL)
STAGES = ("text-encoder", "image-encoder", "denoise", "vae-decode")
LATENT_CHANNELS, VAE_SCALE = 16, 8
# A 56 x 40 picture, cut down to whole 16-pixel patches (48 x 32), is 3:2: Kontext's 1248 x 832.
PICTURE = dict(height=40, width=56)
RESIZED = (832, 1248)  # (height, width)
PICTURE_LATENTS = (RESIZED[0] // VAE_SCALE, RESIZED[1] // VAE_SCALE)

servers = stage_servers_fixture(PIPELINE, STAGES)


@pytest.fixture(scope="module")
def reference(model_dir):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(model_dir / MODEL)
    pipe.set_progress_bar_config(disable=True)
    return pipe


async def staged(servers, params: dict, png: bytes, request_id: str = "r1"):
    first = header(request_id=request_id, parts=[image_part(png)], **params)
    emb = await call_stage(servers["text-encoder"].port, first)
    ref = await call_stage(servers["image-encoder"].port, first)
    lat = await call_stage(servers["denoise"].port, first, [*emb, *ref])
    img = await call_stage(servers["vae-decode"].port, first, lat)
    return ref, lat, img


def reference_edit(reference, params: dict, png: bytes, output_type: str):
    """FluxKontextPipeline's edit at the request's size: its `max_area` the size's, so that it keeps it (it scales
    any size to 1024 x 1024's area otherwise)."""
    return reference(image=Image.open(io.BytesIO(png)), prompt=params["prompt"], width=params["width"],
                     height=params["height"], max_area=params["width"] * params["height"],
                     num_inference_steps=params["num_inference_steps"], guidance_scale=params["guidance_scale"],
                     generator=torch.Generator().manual_seed(params["seed"]), output_type=output_type).images


async def test_staged_kontext_makes_the_edit_flux_kontext_pipeline_makes(servers, reference):
    params = dict(prompt="make the car red", width=48, height=32, num_inference_steps=3, seed=7, guidance_scale=2.5)
    png = reference_png(**PICTURE)
    ref, lat, img = await staged(servers, params, png)

    image_latents = tensor_of(ref[0], "image_latents")
    assert image_latents.shape == (1, LATENT_CHANNELS, *PICTURE_LATENTS)
    processor = reference.image_processor
    pixels = processor.preprocess(processor.resize(Image.open(io.BytesIO(png)), *RESIZED), *RESIZED)
    with torch.inference_mode():
        want = reference._encode_vae_image(pixels, torch.Generator())
    torch.testing.assert_close(image_latents, want, atol=1e-5, rtol=1e-5)

    latents = tensor_of(lat[-1], "latents")
    assert latents.shape == (1, LATENT_CHANNELS, 32 // VAE_SCALE, 48 // VAE_SCALE)
    packed = reference_edit(reference, params, png, "latent")  # the noise's tokens alone: the image's are cut off
    want = reference._unpack_latents(packed, params["height"], params["width"], reference.vae_scale_factor)
    torch.testing.assert_close(latents, want, atol=1e-4, rtol=1e-4)
    want_pixels = np.round(reference_edit(reference, params, png, "np")[0] * 255).astype(np.int16)
    got_pixels = png_pixels(img[0])
    assert got_pixels.shape == (32, 48, 3) and np.abs(got_pixels - want_pixels).max() <= 1


async def test_the_image_to_edit_steers_the_edit(servers):
    params = dict(prompt="make it red", width=32, height=32, num_inference_steps=2, seed=3)
    _, one, _ = await staged(servers, params, reference_png(**PICTURE, seed=1), "a")
    _, other, _ = await staged(servers, params, reference_png(**PICTURE, seed=2), "b")
    assert not torch.equal(tensor_of(one[-1], "latents"), tensor_of(other[-1], "latents"))


async def test_two_edits_at_different_steps_share_model_calls_and_each_gets_its_latents_alone(model_dir):
    """Pictures of one aspect ratio share a Kontext resolution, so their steps share model calls."""
    await assert_denoise_steps_shared(
        model_dir, MODEL, dict(prompt="make it night", width=32, height=32, num_inference_steps=30, seed=1,
                               parts=[image_part(reference_png(**PICTURE, seed=4))]),
        dict(prompt="add a cat", width=32, height=32, num_inference_steps=4, seed=2, guidance_scale=1.0,
             parts=[image_part(reference_png(**PICTURE, seed=5))]),
        "image", encoders=("text-encoder", "image-encoder"))


@pytest.mark.parametrize("parts, message", [
    ([], "image editing takes one reference image, got 0"),
    ([image_part(reference_png(height=8, width=64))], "the image to edit must be at least 16 x 16 pixels"),
    ([image_part(b"not an image at all")], "params.parts[0].image"),
], ids=["none", "too-small", "undecodable"])
async def test_the_image_stage_refuses_anything_but_one_image_it_can_resize(servers, parts, message):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["image-encoder"].port, header(parts=parts, width=32, height=32))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


async def test_a_denoise_stage_without_the_image_latents_is_told_which_tensor(servers):
    params = dict(width=32, height=32, num_inference_steps=2)
    emb = await call_stage(servers["text-encoder"].port, header(**params))

    def image_chunk(**named) -> stage_pb2.Chunk:
        return stage_pb2.Chunk(stage="image-encoder", chunk_id=0, end_of_stream=True,
                               tensors=[tensors.to_proto(k, v) for k, v in named.items()])

    for bad, message in [
        (image_chunk(), 'no input stage sent a tensor "image_latents"'),
        (image_chunk(image_latents=torch.zeros(1, LATENT_CHANNELS, 5, 4)),
         f"image_latents must be [1, {LATENT_CHANNELS}, h, w] with h and w multiples of 2, got [1, 16, 5, 4]"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(servers["denoise"].port, header(**params), [*emb, bad])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()


async def test_a_kontext_transformer_without_its_image_stage_is_refused_at_start(model_dir):
    with pytest.raises(EngineConfigError, match="a FluxKontextPipeline.*needs an input from an image-encoder stage"):
        await start_stage(without_image_stage(MODEL), "denoise", model_dir)
