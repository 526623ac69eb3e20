"""Text encoder, denoise loop and VAE decode, each behind a real stage service on port 0."""

from __future__ import annotations

import asyncio
import io

import grpc
import pytest
import torch
from PIL import Image

from omnistage.contract import tensors
from omnistage.v1 import stage_pb2

from ..harness import call_stage, example, header, in_engine_process, stage_servers, stage_servers_fixture, tensor_of
from .test_stage_support import Call, assert_nothing_held

PIPELINE = example("text-to-image-tiny")


servers = stage_servers_fixture(PIPELINE, ("text-encoder", "denoise", "vae-decode"))


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


def latents_chunk(seed: int, height: int = 16, width: int = 16) -> stage_pb2.Chunk:
    t = torch.randn(1, 4, height, width, generator=torch.Generator().manual_seed(seed))
    return stage_pb2.Chunk(stage="denoise", chunk_id=0, end_of_stream=True, tensors=[tensors.to_proto("latents", t)])


@pytest.fixture(scope="module")
async def vae_process(model_dir):
    """The VAE stage with its model in an engine process (`engineArgs.engine_process: true`)."""
    async with stage_servers(in_engine_process("text-to-image-tiny", "vae-decode"), model_dir,
                             ("vae-decode",)) as srvs:
        assert srvs["vae-decode"].engine.core is not None
        yield srvs["vae-decode"]


async def test_the_vae_in_an_engine_process_makes_the_pngs_of_the_stage_process(servers, vae_process):
    """The same PNG bytes as the VAE in the stage process, for a burst of two latent shapes (each shape
    decoded in its own batches), and nothing left in the engine process."""
    shapes = [(16, 16), (16, 24)]
    requests = [(header(f"r{i}"), [latents_chunk(i, *shapes[i % 2])]) for i in range(12)]
    want = await asyncio.gather(*(call_stage(servers["vae-decode"].port, *r) for r in requests))
    got = await asyncio.gather(*(call_stage(vae_process.port, *r) for r in requests))
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(tensor_of(g[0], "image"), tensor_of(w[0], "image")), f"request {i}"
    assert Image.open(io.BytesIO(tensor_of(got[1][0], "image").numpy().tobytes())).size == (48, 32)
    await assert_nothing_held(vae_process)
    assert await vae_process.engine.scheduler.run_on_worker(vae_process.engine.core.stats) == (0, 0)


@pytest.mark.parametrize("placement", ["stage process", "engine process"])
async def test_vae_calls_cancelled_in_flight_leave_nothing_and_the_others_get_their_pngs(servers, vae_process,
                                                                                         placement):
    """Every third call is cancelled as soon as it is sent (before its decode, during it, or while its PNG is
    encoded): each ends cancelled or done, the others get the PNG they get alone, and nothing is held."""
    srv = servers["vae-decode"] if placement == "stage process" else vae_process
    requests = [(header(f"c{i}"), [latents_chunk(100 + i)]) for i in range(24)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        calls = [Call(ch, *r) for r in requests]
        for c in calls[::3]:
            c.cancel()
        codes = [await asyncio.wait_for(c.outcome(), 120) for c in calls]
    for i, (code, c) in enumerate(zip(codes, calls)):
        if i % 3:
            assert code == grpc.StatusCode.OK, f"call {i}: {code}"
        else:
            assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK), f"call {i}: {code}"
        if code == grpc.StatusCode.OK:
            alone = await call_stage(servers["vae-decode"].port, header(f"a{i}"), [latents_chunk(100 + i)])
            assert torch.equal(tensor_of(c.chunks[0], "image"), tensor_of(alone[0], "image")), f"call {i}"
    await assert_nothing_held(srv)
    if srv.engine.core is not None:
        assert await srv.engine.scheduler.run_on_worker(srv.engine.core.stats) == (0, 0)
