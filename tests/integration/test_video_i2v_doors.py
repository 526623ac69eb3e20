"""Image to video end to end on the tiny Wan image-to-video checkpoint: real text-encoder, image-encoder, denoise
and video VAE stages under a real orchestrator with a real SQLite job store. The reference image goes in as
`input_reference` on /v1/videos (a multipart file as the openai SDK uploads it, or a data: URL in JSON) or as an
image part on gRPC Generate, and makes the same video either way; a request without exactly one decodable image
is refused at submission, naming `input_reference`, and nothing is queued."""

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
from .test_video_jobs import JOB_BOUND_S, MEAN_ERROR_LEVELS, client, completed, decode_mp4, orchestrator
from .test_wan_i2v_stages import image_part, reference_png

MODEL = "wan-i2v-tiny"
PIPELINE = example(MODEL)
ASK = dict(prompt="a cat walks on grass", size="48x32",
           extra_body={"seed": 5, "num_frames": 5, "fps": 8, "num_inference_steps": 2, "negative_prompt": "blurry"})
GENERATE_ASK = dict(prompt="a cat walks on grass", negative_prompt="blurry", width=48, height=32, num_frames=5,
                    num_inference_steps=2, seed=5, fps=8)

servers = stage_servers_fixture(PIPELINE)
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


async def generated_frames(orc, png: bytes) -> np.ndarray:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        request = build_request(outputs=["video"], parts=[image_part(png)], **GENERATE_ASK)
        frames = [np.frombuffer(ev.video.rgb, np.uint8).reshape(ev.video.count, ev.video.height, ev.video.width, 3)
                  async for ev in stub.Generate(request, timeout=JOB_BOUND_S) if ev.WhichOneof("event") == "video"]
    return np.concatenate(frames)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


async def test_a_reference_image_makes_the_same_video_through_either_door(servers, tmp_path):
    png = reference_png()
    async with orchestrator(servers, tmp_path, PIPELINE, jobs_store=f"sqlite:///{tmp_path}/jobs.db") as orc:
        expected = await generated_frames(orc, png)
        assert expected.shape == (5, 32, 48, 3)
        sdk = client(orc)
        uploaded = await asyncio.to_thread(sdk.videos.create, model=MODEL,
                                           input_reference=("ref.png", png, "image/png"), **ASK)
        as_json = await asyncio.to_thread(  # OpenAI's image reference object, the image inline
            httpx.post, f"http://127.0.0.1:{orc.api_port}/v1/videos",
            json={"model": MODEL, "prompt": ASK["prompt"], "size": ASK["size"], **ASK["extra_body"],
                  "input_reference": {"image_url": data_url(png)}}, timeout=30)
        assert as_json.status_code == 200, as_json.text
        for video_id in (uploaded.id, as_json.json()["id"]):
            await completed(sdk, video_id)
            thumb = (await asyncio.to_thread(sdk.videos.download_content, video_id, variant="thumbnail")).read()
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(thumb))), expected[0])  # PNG: exactly frame 0
            frames, fps = decode_mp4((await asyncio.to_thread(sdk.videos.download_content, video_id)).read())
            assert fps == 8 and frames.shape == expected.shape
            assert np.abs(frames.astype(int) - expected.astype(int)).mean() < MEAN_ERROR_LEVELS
        other = await generated_frames(orc, reference_png(seed=9))
        assert not np.array_equal(other, expected)  # the image steers the video


async def test_a_request_without_one_decodable_image_is_refused_by_name_and_nothing_is_queued(servers, tmp_path):
    async with orchestrator(servers, tmp_path, PIPELINE, jobs_store=f"sqlite:///{tmp_path}/jobs.db") as orc:
        sdk = client(orc)
        for kw, param, words in ((dict(), "input_reference", "send exactly one image part, got 0"),
                                 (dict(input_reference=("ref.png", b"\x89PNG not really", "image/png")),
                                  "input_reference", None)):
            with pytest.raises(openai.BadRequestError) as e:
                await asyncio.to_thread(sdk.videos.create, model=MODEL, **ASK, **kw)
            assert e.value.body["param"] == param, e.value.body
            assert words is None or words in e.value.body["message"], e.value.body
        for reference, param, words in (({"image_url": "https://example.com/cat.png"}, "input_reference.image_url",
                                         "not fetched"),
                                        ({"file_id": "file-abc"}, "input_reference.file_id", "file ids"),
                                        ({"image_url": "data:text/plain;base64,AA=="}, "input_reference.image_url",
                                         "not an image"),
                                        (7, "input_reference", "must be an image")):
            answer = await asyncio.to_thread(
                httpx.post, f"http://127.0.0.1:{orc.api_port}/v1/videos",
                json={"model": MODEL, "prompt": "x", "input_reference": reference}, timeout=30)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == param and words in error["message"], error
        assert (await asyncio.to_thread(sdk.videos.list)).data == []

        async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            two = [image_part(reference_png()), image_part(reference_png(seed=1))]
            for parts, words in (([], "got 0"), (two, "has 2 media parts")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(build_request(outputs=["video"], parts=parts, **GENERATE_ASK),
                                                 timeout=60):
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "params.parts" in e.value.details() and words in e.value.details()
