"""The Wan video VAE as a stage (stage_service/engines/diffusers/video_vae.py) on the tiny Wan checkpoint: it
streams the frames latent frame by latent frame (1 frame, then 4 per latent frame, one chunk each at
chunkSize 1), and together they are the frames of one whole `AutoencoderKLWan.decode` as WanPipeline
un-normalizes and converts them; requests decoded in one step share the VAE's model calls and get the frames
they get alone, bit for bit (batch invariance, the default) or, with it off, within a level of 8 bits; latents
of another shape are refused naming it; a call cancelled between two latent frames leaves nothing held."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
import torch

from omnistage.contract import tensors
from omnistage.v1 import stage_pb2

from ..harness import all_queued, call_stage, example, header, stage_servers_fixture, start_stage, tensor_of
from ..polling import wait_until
from .test_stage_batching import batched_steps
from .test_stage_support import Call, assert_nothing_held

MODEL = "wan-t2v-tiny"
PIPELINE = example(MODEL)
Z_DIM, SPATIAL = 16, 8  # the tiny VAE's latent channels and spatial scale
SIZE = dict(width=48, height=32, num_frames=9)  # 3 latent frames of 4 x 6

servers = stage_servers_fixture(PIPELINE, ("vae-decode",))


def latents_chunk(latents: torch.Tensor) -> stage_pb2.Chunk:
    return stage_pb2.Chunk(stage="denoise", chunk_id=0, end_of_stream=True,
                           tensors=[tensors.to_proto("latents", latents)])


def pipeline_frames(model_dir, latents: torch.Tensor, padded: bool = False) -> np.ndarray:
    """What WanPipeline does with its final latents: un-normalize, one whole decode, `output_type="np"`
    frames, as 8-bit; `padded`: its VAE padded as the stage's is for batch invariance."""
    from diffusers import AutoencoderKLWan
    from diffusers.video_processor import VideoProcessor

    from stage_service.engines.diffusers.video_vae import batch_invariant_decode

    vae = AutoencoderKLWan.from_pretrained(model_dir / MODEL / "vae").eval()
    if padded:
        batch_invariant_decode(vae)
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
    with torch.inference_mode():
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
    frames = VideoProcessor(vae_scale_factor=SPATIAL).postprocess_video(video, output_type="np")[0]
    return (frames * 255).round().astype(np.uint8)


async def test_frames_stream_by_latent_frame_and_equal_one_whole_decode(servers, model_dir):
    latents = torch.randn(1, Z_DIM, 3, SIZE["height"] // SPATIAL, SIZE["width"] // SPATIAL,
                          generator=torch.Generator().manual_seed(3))
    out = await call_stage(servers["vae-decode"].port, header(**SIZE), [latents_chunk(latents)])
    frames = [tensor_of(c, "video").numpy() for c in out]
    assert [f.shape for f in frames] == [(1, 32, 48, 3), (4, 32, 48, 3), (4, 32, 48, 3)]
    assert [c.finish_reason for c in out] == ["", "", "stop"] and out[-1].end_of_stream
    video = np.concatenate(frames)
    assert np.array_equal(video, pipeline_frames(model_dir, latents, padded=True))  # bit for bit
    # WanPipeline's own VAE takes the batch-of-one kernels, which round apart in the float frames' last bits
    assert int(np.abs(video.astype(np.int16) - pipeline_frames(model_dir, latents)).max()) <= 1
    await assert_nothing_held(servers["vae-decode"])


def shared_calls(doc):
    doc["spec"]["deployment"]["stages"]["vae-decode"]["engineArgs"] = {"batch_invariant": False}


def latents_of(seed: int) -> torch.Tensor:
    return torch.randn(1, Z_DIM, 3, 4, 6, generator=torch.Generator().manual_seed(seed))


async def decoded_together(srv, seeds) -> list[np.ndarray]:
    """The frames of one request per seed, all in the VAE's scheduler before its first step."""
    async def one(seed):
        out = await call_stage(srv.port, header(request_id=f"r{seed}", **SIZE), [latents_chunk(latents_of(seed))])
        return np.concatenate([tensor_of(c, "video").numpy() for c in out])
    return await all_queued(srv.engine.scheduler, asyncio.gather(*(one(s) for s in seeds)), len(seeds))


async def test_requests_decoded_in_one_step_get_the_frames_they_get_alone(servers):
    srv = servers["vae-decode"]
    alone = [(await decoded_together(srv, [seed]))[0] for seed in (1, 2)]
    before = batched_steps(srv)
    together = await decoded_together(srv, [1, 2])
    assert batched_steps(srv) > before
    assert all(np.array_equal(a, t) for a, t in zip(alone, together))
    await assert_nothing_held(srv)


async def test_a_step_of_three_requests_is_one_model_call_and_each_gets_its_frames_alone_bit_for_bit(servers):
    srv = servers["vae-decode"]
    calls = []
    hook = srv.engine.vae.decoder.register_forward_hook(lambda module, args, out: calls.append(len(out)))
    try:
        alone = [(await decoded_together(srv, [seed]))[0] for seed in (1, 2, 3)]
        assert calls == [1] * 9  # 3 latent frames each
        calls.clear()
        together = await decoded_together(srv, [1, 2, 3])
        assert calls == [3, 3, 3]  # one call per latent frame for the three
        assert all(np.array_equal(a, t) for a, t in zip(alone, together))
        await assert_nothing_held(srv)
    finally:
        hook.remove()


async def test_without_batch_invariance_requests_share_the_vaes_model_calls(model_dir):
    srv = await start_stage(example(MODEL, shared_calls), "vae-decode", model_dir)
    calls = []
    hook = srv.engine.vae.decoder.register_forward_hook(lambda module, args, out: calls.append(len(out)))
    try:
        alone = [(await decoded_together(srv, [seed]))[0] for seed in (1, 2)]
        assert calls == [1] * 6  # 3 latent frames each
        # alone, the batch-of-one kernels: WanPipeline's frames bit for bit
        assert all(np.array_equal(a, pipeline_frames(model_dir, latents_of(s))) for a, s in zip(alone, (1, 2)))
        calls.clear()
        together = await decoded_together(srv, [1, 2])
        assert calls == [2, 2, 2]  # one call per latent frame for both
        # a batch of two rounds the float frames apart from a batch of one in the last bits
        assert all(int(np.abs(a.astype(np.int16) - t).max()) <= 1 for a, t in zip(alone, together))
        await assert_nothing_held(srv)
    finally:
        hook.remove()
        await srv.drain()


async def test_latents_of_another_shape_are_refused_naming_the_shape(servers):
    wrong = torch.zeros(1, Z_DIM, 2, 4, 6)  # 2 latent frames for a 9-frame request (which has 3)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["vae-decode"].port, header(**SIZE), [latents_chunk(wrong)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "latents must be [1, 16, 3, 4, 6] for 9 frames of 48x32, got [1, 16, 2, 4, 6]" in e.value.details()
    await assert_nothing_held(servers["vae-decode"])


async def test_a_call_cancelled_between_latent_frames_leaves_nothing_held(servers):
    srv = servers["vae-decode"]
    sched, go = srv.engine.scheduler, threading.Event()
    step, steps = sched.step_fn, [0]

    def second_waits(batch):  # latent frame 2 waits until the call is cancelled (a safety bound only)
        steps[0] += 1
        if steps[0] == 2:
            go.wait(timeout=120)
        return step(batch)
    sched.step_fn = second_waits
    try:
        latents = torch.randn(1, Z_DIM, 3, 4, 6, generator=torch.Generator().manual_seed(5))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            call = Call(channel, header(request_id="cancelled", **SIZE), [latents_chunk(latents)])
            await wait_until(lambda: len(call.chunks) == 1, 120, what="the first frame")
            call.cancel()
            assert await call.outcome() == grpc.StatusCode.CANCELLED
    finally:
        go.set()
        sched.step_fn = step
    assert [tensor_of(c, "video").shape[0] for c in call.chunks] == [1]
    await assert_nothing_held(srv)


def test_a_video_vae_stage_declaring_images_does_not_start(model_dir):
    from stage_service.engines.registry import create_engine
    from stage_service.runtime.errors import EngineConfigError

    def images(doc):
        doc["spec"]["topology"]["stages"][2]["emits"] = ["image"]
        doc["spec"]["topology"]["outputs"] = [{"modality": "image", "stage": "vae-decode"}]
    pipeline = example(MODEL, images)
    with pytest.raises(EngineConfigError, match="its emits must list video"):
        create_engine(pipeline, pipeline.stage("vae-decode"), model_dir)


@pytest.mark.parametrize("neighbours", [1, 3])
def test_a_lone_decode_is_the_same_float_for_float_as_in_a_batch(model_dir, neighbours):
    """Below the 8-bit frames: every latent frame's decoder output of a request, alone, equals its rows decoded
    beside others, to the last bit (the attention's lone call rounded apart before it was padded too)."""
    from diffusers import AutoencoderKLWan

    from stage_service.engines.diffusers.video_vae import batch_invariant_decode

    vae = batch_invariant_decode(AutoencoderKLWan.from_pretrained(model_dir / MODEL / "vae").eval())
    entries = vae._cached_conv_counts["decoder"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, Z_DIM, 2, 4, 6, generator=g) * 2
    batch = torch.cat([x, *(torch.randn(1, Z_DIM, 2, 4, 6, generator=g) * 2 for _ in range(neighbours))])

    def decoded(z):
        cache, out = [None] * entries, []
        with torch.inference_mode():
            for i in range(z.shape[2]):
                out.append(vae.decoder(vae.post_quant_conv(z[:, :, i:i + 1]), feat_cache=cache, feat_idx=[0],
                                       first_chunk=i == 0)[:1])
        return out

    for alone, batched in zip(decoded(x), decoded(batch)):
        assert torch.equal(alone, batched)
