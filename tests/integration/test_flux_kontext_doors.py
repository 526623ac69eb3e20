"""Image editing end to end on the tiny FLUX.1 Kontext checkpoint: real text-encoder, image-encoder, denoise and
VAE stages under a real orchestrator. The image to edit goes in as the openai SDK uploads it to /v1/images/edits
(multipart), as a data: URL in a JSON body, or as an image part on gRPC Generate, and makes the same image every
way; what cannot be edited (no image, two, a mask, an image past the pipeline's limits, bytes that are no image) is
refused naming its field, before any stage works."""

from __future__ import annotations

import asyncio
import base64
import io

import grpc
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from omnistage.client import build_request
from omnistage.v1 import orchestrator_pb2_grpc

from ..harness import example, stage_servers_fixture
from .test_video_jobs import client, orchestrator
from .test_wan_i2v_stages import image_part, reference_png

MODEL = "flux-kontext-tiny"
PIPELINE = example(MODEL)
ASK = dict(prompt="make the car red", size="48x32", response_format="b64_json",
           extra_body={"seed": 5, "num_inference_steps": 2, "guidance_scale": 2.5})
GENERATE_ASK = dict(prompt="make the car red", width=48, height=32, num_inference_steps=2, seed=5, guidance_scale=2.5)

servers = stage_servers_fixture(PIPELINE)


def pixels(png: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"))


async def generated(orc, png: bytes) -> np.ndarray:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        request = build_request(outputs=["image"], parts=[image_part(png)], **GENERATE_ASK)
        images = [ev.image.png async for ev in stub.Generate(request, timeout=120)
                  if ev.WhichOneof("event") == "image"]
    assert len(images) == 1
    return pixels(images[0])


async def test_an_edit_makes_the_same_image_through_either_door(servers, tmp_path):
    png = reference_png(height=40, width=56)
    async with orchestrator(servers, tmp_path, PIPELINE) as orc:
        expected = await generated(orc, png)
        assert expected.shape == (32, 48, 3)
        sdk = client(orc)
        uploaded = await asyncio.to_thread(sdk.images.edit, model=MODEL, image=("in.png", png, "image/png"), **ASK)
        assert uploaded.size == "48x32" and len(uploaded.data) == 1
        assert np.array_equal(pixels(base64.b64decode(uploaded.data[0].b64_json)), expected)
        as_json = await asyncio.to_thread(
            httpx.post, f"http://127.0.0.1:{orc.api_port}/v1/images/edits",
            json={"model": MODEL, "prompt": ASK["prompt"], "size": ASK["size"], **ASK["extra_body"],
                  "images": [{"image_url": "data:image/png;base64," + base64.b64encode(png).decode()}]}, timeout=60)
        assert as_json.status_code == 200, as_json.text
        assert np.array_equal(pixels(base64.b64decode(as_json.json()["data"][0]["b64_json"])), expected)
        two = await asyncio.to_thread(sdk.images.edit, model=MODEL, image=("in.png", png, "image/png"),
                                      **{**ASK, "n": 2})  # seeds 5 and 6: the first is the same edit
        assert np.array_equal(pixels(base64.b64decode(two.data[0].b64_json)), expected)
        assert not np.array_equal(pixels(base64.b64decode(two.data[1].b64_json)), expected)


def solid_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, format="PNG")  # one colour: few bytes, many pixels
    return buf.getvalue()


async def test_what_cannot_be_edited_is_refused_by_name_before_any_stage_works(servers, tmp_path):
    png = reference_png(height=40, width=56)
    async with orchestrator(servers, tmp_path, PIPELINE) as orc:
        sdk = client(orc)
        refusals = [
            (dict(image=[("a.png", png, "image/png"), ("b.png", png, "image/png")]), "image",
             "edits one image: send exactly one, got 2"),
            (dict(image=("a.png", png, "image/png"), mask=("m.png", png, "image/png")), "mask", "reads no mask"),
            (dict(image=("big.png", solid_png(2100, 2100), "image/png")), "image", "pixels"),
            (dict(image=("a.png", b"these bytes are no image", "image/png")), "image", "image"),
        ]
        for kw, param, words in refusals:
            with pytest.raises(openai.BadRequestError) as e:
                await asyncio.to_thread(sdk.images.edit, model=MODEL, prompt="make it red", **kw)
            body = e.value.body
            assert isinstance(body, dict) and body.get("param") == param, (kw.keys(), body)
            assert words in body["message"], body
        # no image at all (the SDK cannot send that): a form of the text fields alone
        reply = await asyncio.to_thread(httpx.post, f"http://127.0.0.1:{orc.api_port}/v1/images/edits",
                                        files={"prompt": (None, "make it red")}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "image"
        assert "send exactly one, got 0" in reply.json()["error"]["message"]
        admitted = orc.servicer.metrics.registry.get_sample_value("omnistage_requests_admitted_total") or 0.0
        assert admitted == 0  # nothing reached the stages
