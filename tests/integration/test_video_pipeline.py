"""Text to video end to end on the tiny Wan checkpoint: a real orchestrator over the real text-encoder, denoise
and video VAE stages. A gRPC Generate asking for video gets the denoise loop's progress, then the frames as
VideoFrames events whose concatenation is the video diffusers' own WanPipeline makes for the same seed, the
first of them while the VAE has not decoded the last latent frame yet."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch

from omnistage.client import build_request
from omnistage.v1 import orchestrator_pb2_grpc

from ..harness import example, served_pipeline

MODEL = "wan-t2v-tiny"
PIPELINE = example(MODEL)
ASK = dict(prompt="a cat walks on grass", negative_prompt="blurry", width=48, height=32, num_frames=9,
           num_inference_steps=3, guidance_scale=5.0, seed=11, fps=12)
LATENT_FRAMES = 3  # (9 - 1) // 4 + 1


def wan_pipeline_frames(model_dir) -> np.ndarray:
    """diffusers' WanPipeline on the same directory and seed, its `np` frames as 8-bit."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(model_dir / MODEL)
    frames = pipe(ASK["prompt"], negative_prompt=ASK["negative_prompt"], height=ASK["height"], width=ASK["width"],
                  num_frames=ASK["num_frames"], num_inference_steps=ASK["num_inference_steps"],
                  guidance_scale=ASK["guidance_scale"], generator=torch.Generator().manual_seed(ASK["seed"]),
                  output_type="np").frames[0]
    return (frames * 255).round().astype(np.uint8)


def hold_second_decode(engine, until: threading.Event, held: list[bool]) -> None:
    """The VAE's second step (latent frame 2) waits until `until` is set; `held` says whether it was set
    while that step waited (True: what came before reached whoever sets it first)."""
    step, calls = engine.scheduler.step_fn, [0]

    def gated(batch):
        calls[0] += 1
        if calls[0] == 2:
            held.append(until.wait(timeout=120))  # a safety bound only: the client sets it on its first frames
        return step(batch)
    engine.scheduler.step_fn = gated


async def test_generate_streams_progress_then_the_frames_wan_pipeline_makes(model_dir):
    expected = wan_pipeline_frames(model_dir)
    seen_frames, held = threading.Event(), []
    async with served_pipeline(PIPELINE, model_dir) as (orc, stages):
        hold_second_decode(stages["vae-decode"].engine, seen_frames, held)
        events = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            async for ev in stub.Generate(build_request(outputs=["video"], **ASK), timeout=600):
                events.append(ev)
                if ev.WhichOneof("event") == "video":
                    seen_frames.set()
    kinds = [ev.WhichOneof("event") for ev in events]
    assert kinds == ["progress"] * ASK["num_inference_steps"] + ["video"] * LATENT_FRAMES + ["final"], kinds
    progress = [ev.progress for ev in events[:ASK["num_inference_steps"]]]
    assert [(p.stage, p.done, p.total, p.unit) for p in progress] == [("denoise", i + 1, 3, "steps") for i in range(3)]
    assert held == [True]  # the first frames reached the client while latent frame 2 was still to decode
    video = [ev.video for ev in events if ev.WhichOneof("event") == "video"]
    assert [(v.index, v.count, v.width, v.height, v.fps) for v in video] == [
        (0, 1, 48, 32, 12), (1, 4, 48, 32, 12), (5, 4, 48, 32, 12)]
    frames = np.concatenate([np.frombuffer(v.rgb, np.uint8).reshape(v.count, v.height, v.width, 3) for v in video])
    assert frames.shape == expected.shape
    # The denoise loop batches the [unconditional, conditional] rows in one transformer call where WanPipeline
    # makes two: float sums may round apart, by at most one level of 8 bits.
    assert int(np.abs(frames.astype(np.int16) - expected).max()) <= 1
    final = events[-1].final
    assert final.finish_reason == "stop" and final.usage.video_frames == ASK["num_frames"]


@pytest.mark.parametrize("frames, message", [(10, "params.video.num_frames: must be 4k + 1 frames"),
                                             (85, "params.video.num_frames: must be between 1 and 81, got 85")])
async def test_a_frame_count_the_pipeline_cannot_make_is_refused_before_any_stage_runs(model_dir, frames, message):
    async with served_pipeline(PIPELINE, model_dir) as (orc, stages):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(build_request(outputs=["video"], **{**ASK, "num_frames": frames}),
                                             timeout=120):
                    pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
        assert all(s.engine.unfinished() == 0 and s.servicer.inflight == 0 for s in stages.values())
