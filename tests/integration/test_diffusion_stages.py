"""Text encoder, denoise loop and VAE decode, each behind a real stage service on port 0."""

from __future__ import annotations

import io

import grpc
import pytest
import torch
from PIL import Image

from omnistage import tensors
from omnistage.v1 import stage_pb2

from ..harness import call_stage, example, header, start_stage

PIPELINE = example("text-to-image-tiny")


@pytest.fixture(scope="module")
async def servers(model_dir):
    srvs = {n: await start_stage(PIPELINE, n, model_dir) for n in ("text-encoder", "denoise", "vae-decode")}
    yield srvs
    for s in srvs.values():
        await s.drain()


def tensor_of(chunk, name):
    return next(tensors.from_proto(t) for t in chunk.tensors if t.name == name)


async def run(servers, **params):
    emb = await call_stage(servers["text-encoder"].port, header(**params))
    lat = await call_stage(servers["denoise"].port, header(**params), emb)
    img = await call_stage(servers["vae-decode"].port, header(**params), lat)
    return emb, lat, img


async def test_text_to_png_at_the_requested_size(servers):
    emb, lat, img = await run(servers, prompt="a red car", width=48, height=32, num_inference_steps=3, seed=1)
    e = tensor_of(emb[0], "embeddings")
    assert e.shape == (2, 77, 32)  # [unconditional, conditional] under classifier-free guidance
    assert tensor_of(lat[-1], "latents").shape == (1, 4, 16, 24)  # the tiny VAE downsamples by 2
    png = tensor_of(img[0], "image").numpy().tobytes()
    decoded = Image.open(io.BytesIO(png))
    assert decoded.size == (48, 32) and decoded.mode == "RGB"


async def test_same_seed_same_image_different_seed_different_image(servers):
    a = tensor_of((await run(servers, num_inference_steps=2, seed=5))[2][0], "image")
    b = tensor_of((await run(servers, num_inference_steps=2, seed=5))[2][0], "image")
    c = tensor_of((await run(servers, num_inference_steps=2, seed=6))[2][0], "image")
    assert torch.equal(a, b) and not torch.equal(a, c)


async def test_no_guidance_encodes_one_prompt(servers):
    emb = await call_stage(servers["text-encoder"].port, header(guidance_scale=1.0))
    assert tensor_of(emb[0], "embeddings").shape[0] == 1


async def test_wrong_latents_are_refused(servers):
    bad = stage_pb2.Chunk(stage="denoise", chunk_id=0, end_of_stream=True,
                          tensors=[tensors.to_proto("latents", torch.zeros(1, 3, 8, 8))])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["vae-decode"].port, header(), [bad])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "latents must be [1, 4, h, w]" in e.value.details()
