"""Wan 2.1 text-to-video (UMT5 text encoder, WanTransformer3DModel over 5-D latents, UniPC flow scheduler, the
causal video VAE) served as three stages from the published diffusers layout: the frames are the ones
diffusers' own WanPipeline makes from the same directory, the denoise stage reports progress after every
step, step batching never changes a video, and sizes the model cannot take are refused by name."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from omnistage.contract import tensors
from omnistage.v1 import stage_pb2, stage_pb2_grpc

from ..harness import call_stage, example, header, stage_servers, stage_servers_fixture, start_stage, tensor_of
from .test_stage_batching import joins_a_burst
from .test_stage_cancel import chunk_every_step
from .test_stage_support import assert_denoise_steps_shared, assert_nothing_held, scheduler

MODEL = "wan-t2v-tiny"
PIPELINE = example(MODEL)
STAGES = ("text-encoder", "denoise", "vae-decode")
# The tiny pipeline's shapes: WanPipeline's 512 text tokens, UMT5 32 wide; 16 latent channels, the VAE 8x in
# space and 4x in time.
TEXT_TOKENS, TEXT_WIDTH, LATENT_CHANNELS = 512, 32, 16

servers = stage_servers_fixture(PIPELINE, STAGES)


@pytest.fixture(scope="module")
def reference(model_dir):
    """diffusers' own pipeline on the same directory."""
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(model_dir / MODEL)


async def process(port: int, first: stage_pb2.StageInput, chunks=()) -> list[stage_pb2.StageOutput]:
    """One Process call: every message the stage sends, progress reports included."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)

        async def requests():
            yield first
            for c in chunks:
                yield stage_pb2.StageInput(chunk=c)

        return [out async for out in stub.Process(requests(), timeout=120)]


def frames_of(chunks) -> np.ndarray:
    """The vae-decode stage's `video` chunks, their frames in order: uint8 [n, H, W, 3]."""
    return np.concatenate([tensor_of(c, "video").numpy() for c in chunks])


@pytest.mark.parametrize("guidance", [5.0, 1.0], ids=["guided", "unguided"])
async def test_staged_wan_makes_the_frames_wan_pipeline_makes(servers, reference, guidance):
    params = dict(prompt="a cat sitting on a red car", negative_prompt="a blue sky", width=48, height=32,
                  num_frames=9, num_inference_steps=4, seed=7, guidance_scale=guidance)
    emb = await call_stage(servers["text-encoder"].port, header(**params))
    lat = await call_stage(servers["denoise"].port, header(**params), emb)
    video = await call_stage(servers["vae-decode"].port, header(**params), lat)

    guided = guidance > 1.0
    with torch.inference_mode():
        pe, neg_pe = reference.encode_prompt(params["prompt"], params["negative_prompt"],
                                             do_classifier_free_guidance=guided, max_sequence_length=TEXT_TOKENS)
    want_emb = torch.cat([neg_pe, pe]) if guided else pe
    got_emb = tensor_of(emb[0], "embeddings")
    assert got_emb.shape == (1 + guided, TEXT_TOKENS, TEXT_WIDTH)
    assert got_emb[:, 100:].abs().sum() == 0  # trimmed to each prompt's own tokens, zeros after them
    torch.testing.assert_close(got_emb, want_emb, atol=1e-5, rtol=1e-5)

    def reference_run(output_type):
        return reference(params["prompt"], negative_prompt=params["negative_prompt"], width=params["width"],
                         height=params["height"], num_frames=params["num_frames"],
                         num_inference_steps=params["num_inference_steps"], guidance_scale=guidance,
                         generator=torch.Generator().manual_seed(params["seed"]), output_type=output_type).frames

    latents = tensor_of(lat[-1], "latents")
    assert latents.shape == (1, LATENT_CHANNELS, 3, 4, 6)  # 9 frames -> 1 + 8 / 4 latent frames; 32 x 48 / 8
    torch.testing.assert_close(latents, reference_run("latent"), atol=1e-4, rtol=1e-4)
    want = (reference_run("np")[0] * 255).round().astype(np.uint8)
    got = frames_of(video)
    assert got.shape == (9, 32, 48, 3) == want.shape
    assert np.abs(got.astype(np.int16) - want.astype(np.int16)).max() <= 1


async def test_in_bfloat16_the_frames_are_wan_pipelines_in_bfloat16(model_dir):
    """As diffusers runs Wan (its docs: the pipeline in bfloat16, the VAE in float32), WanPipeline keeps the
    latents and the scheduler's state in float32 and casts only the transformer's input: a loop stepping
    bfloat16 latents makes frames several levels off. The stages in those dtypes make WanPipeline's frames."""
    from diffusers import AutoencoderKLWan, WanPipeline

    def dtypes(doc):
        for name, dtype in (("text-encoder", "bfloat16"), ("denoise", "bfloat16"), ("vae-decode", "float32")):
            doc["spec"]["deployment"]["stages"][name]["dtype"] = dtype

    params = dict(prompt="a cat sitting on a red car", negative_prompt="a blue sky", width=48, height=32,
                  num_frames=9, num_inference_steps=8, seed=7, guidance_scale=5.0)
    async with stage_servers(example(MODEL, dtypes), model_dir) as stages:
        assert stages["denoise"].engine.dtype == torch.bfloat16
        emb = await call_stage(stages["text-encoder"].port, header(**params))
        lat = await call_stage(stages["denoise"].port, header(**params), emb)
        video = await call_stage(stages["vae-decode"].port, header(**params), lat)

    vae = AutoencoderKLWan.from_pretrained(model_dir / MODEL, subfolder="vae", dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(model_dir / MODEL, vae=vae, dtype=torch.bfloat16)
    assert (pipe.text_encoder.dtype, pipe.transformer.dtype, pipe.vae.dtype) == (torch.bfloat16,) * 2 + (torch.float32,)
    frames = pipe(params["prompt"], negative_prompt=params["negative_prompt"], width=params["width"],
                  height=params["height"], num_frames=params["num_frames"],
                  num_inference_steps=params["num_inference_steps"], guidance_scale=params["guidance_scale"],
                  generator=torch.Generator().manual_seed(params["seed"]), output_type="np").frames
    want = (frames[0] * 255).round().astype(np.uint8)
    got = frames_of(video)
    assert got.shape == want.shape
    assert np.abs(got.astype(np.int16) - want.astype(np.int16)).max() <= 1
    assert tensor_of(lat[-1], "latents").dtype == torch.float32  # as WanPipeline keeps them


def asking_progress(first: stage_pb2.StageInput) -> stage_pb2.StageInput:
    """The header asking for the stage's progress reports, as the orchestrator's does."""
    first.header.progress = True
    return first


async def test_the_denoise_stage_reports_progress_after_every_step(servers):
    params = dict(prompt="a horse on the moon", width=32, height=32, num_frames=5, num_inference_steps=5, seed=3)
    emb = await call_stage(servers["text-encoder"].port, header(**params))
    outs = await process(servers["denoise"].port, asking_progress(header(**params)), emb)

    kinds = [out.WhichOneof("kind") for out in outs]
    assert kinds == ["progress"] * 5 + ["chunk"]  # chunkSize 0: the latents once, after the last step's report
    assert [(o.progress.done, o.progress.total, o.progress.unit) for o in outs[:-1]] == \
        [(i, 5, "steps") for i in range(1, 6)]
    assert tensor_of(outs[-1].chunk, "latents").shape == (1, LATENT_CHANNELS, 2, 4, 4)
    await assert_nothing_held(servers["denoise"])


@pytest.mark.parametrize("chunk_size", [0, 1], ids=["latents-once", "latents-every-step"])
async def test_a_caller_that_does_not_ask_for_progress_gets_only_chunks(model_dir, chunk_size):
    """A client built before StageProgress existed reads any StageOutput that is not a failure as a chunk: a
    report it did not ask for would reach it as an empty chunk (and end a diffusion request wrongly)."""
    def chunked(doc):
        next(s for s in doc["spec"]["topology"]["stages"] if s["name"] == "denoise")["chunkSize"] = chunk_size

    pipeline = example(MODEL, chunked)
    enc = await start_stage(pipeline, "text-encoder", model_dir)
    den = await start_stage(pipeline, "denoise", model_dir)
    try:
        params = dict(prompt="a horse on the moon", width=32, height=32, num_frames=5, num_inference_steps=3, seed=3)
        emb = await call_stage(enc.port, header(**params))
        outs = await process(den.port, header(**params), emb)
    finally:
        await enc.drain()
        await den.drain()
    assert [o.WhichOneof("kind") for o in outs] == ["chunk"] * (3 if chunk_size else 1)
    assert [o.chunk.chunk_id for o in outs] == list(range(len(outs)))
    assert outs[-1].chunk.end_of_stream
    assert all(tensor_of(o.chunk, "latents").shape == (1, LATENT_CHANNELS, 2, 4, 4) for o in outs)


async def test_an_image_denoise_stage_reports_progress_too(model_dir):
    srv = await start_stage(example("sd3-tiny", chunk_every_step("denoise")), "denoise", model_dir)
    enc = await start_stage(example("sd3-tiny"), "text-encoder", model_dir)
    try:
        params = dict(prompt="a cat", width=32, height=32, num_inference_steps=3, seed=1)
        emb = await call_stage(enc.port, header(**params))
        outs = await process(srv.port, asking_progress(header(**params)), emb)
    finally:
        await srv.drain()
        await enc.drain()
    # chunkSize 1: each step's latents, its progress report just before it
    assert [o.WhichOneof("kind") for o in outs] == ["progress", "chunk"] * 3
    assert [o.progress.done for o in outs[::2]] == [1, 2, 3]


async def test_two_videos_at_different_steps_share_model_calls_and_each_gets_its_latents_alone(model_dir):
    await assert_denoise_steps_shared(
        model_dir, MODEL, dict(prompt="an astronaut riding a horse", width=32, height=32, num_frames=5,
                               num_inference_steps=60, seed=1),
        dict(prompt="a cat", width=32, height=32, num_frames=5, num_inference_steps=4, seed=2, guidance_scale=1.0),
        "video")


async def test_a_prompt_encodes_the_same_alone_and_in_a_batch_of_prompts(model_dir):
    enc = await start_stage(example(MODEL, scheduler("text-encoder")), "text-encoder", model_dir)
    try:
        probe = (header("probe", prompt="a red car on a road", guidance_scale=1.0), ())
        burst = [(header(f"b{i}", prompt=f"the quick brown fox {i} " * (i + 1)), ()) for i in range(8)]
        alone, joined = await joins_a_burst(enc, probe, burst, lambda cs: tensor_of(cs[0], "embeddings"))
        assert alone.shape == (1, TEXT_TOKENS, TEXT_WIDTH) and torch.equal(joined, alone)
    finally:
        await enc.drain()


async def test_bad_text_inputs_and_sizes_are_refused_naming_what_is_wrong(servers):
    emb = await call_stage(servers["text-encoder"].port, header())
    good = tensors.from_proto(emb[0].tensors[0])

    def chunk(**named):
        return stage_pb2.Chunk(stage="text-encoder", chunk_id=0, end_of_stream=True,
                               tensors=[tensors.to_proto(k, v) for k, v in named.items()])

    for hdr, chunks, message in [
        (header(), [chunk(embeddings=good[..., :8])],
         f"embeddings must be [1 or 2, tokens, {TEXT_WIDTH}], got [2, {TEXT_TOKENS}, 8]"),
        (header(width=40), emb, "params.image.width: must be a multiple of 16 for this WanTransformer3DModel, got 40"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(servers["denoise"].port, hdr, chunks)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()


async def test_frames_past_the_position_embedding_are_refused_by_name(model_dir, tmp_path):
    """A DiT whose rotary embedding covers 2 positions a side takes at most 2 latent frames (5 frames) and
    sides of 2 x 2 x 8 = 32 pixels."""
    import json
    import shutil

    root = tmp_path / MODEL
    shutil.copytree(model_dir / MODEL, root)
    cfg_file = root / "transformer" / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "rope_max_seq_len": 2}))

    def served_from_root(doc):
        for stage in doc["spec"]["topology"]["stages"]:
            stage["model"] = str(root)

    srv = await start_stage(example(MODEL, served_from_root), "denoise", model_dir)
    try:
        for params, message in [
            (dict(num_frames=9), "params.video.num_frames: must be at most 5 for this WanTransformer3DModel, got 9"),
            (dict(width=48), "params.image.width: must be at most 32 for this WanTransformer3DModel, got 48"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call_stage(srv.port, header(width=params.get("width", 32), height=32,
                                                  num_frames=params.get("num_frames", 5)), [])
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
    finally:
        await srv.drain()


@pytest.mark.parametrize("edit, message", [
    ({"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875},
     "a two-expert WanPipeline (transformer_2, boundary_ratio: Wan 2.2 A14B) is not served"),
    ({"expand_timesteps": True}, "a WanPipeline with expand_timesteps (Wan 2.2 TI2V) is not served"),
], ids=["two-experts", "expand-timesteps"])
def test_a_wan_2_2_pipeline_the_loop_would_run_wrongly_is_refused_by_name(model_dir, tmp_path, edit, message):
    """Wan 2.2 checkpoints name the same WanPipeline class; served as Wan 2.1 they would make other videos."""
    import json
    import re
    import shutil

    from stage_service.engines.registry import create_engine
    from stage_service.runtime.errors import EngineConfigError

    root = tmp_path / MODEL
    shutil.copytree(model_dir / MODEL, root)
    index_file = root / "model_index.json"
    index_file.write_text(json.dumps({**json.loads(index_file.read_text()), **edit}))
    pipeline = example(MODEL, lambda doc: [s.update(model=str(root)) for s in doc["spec"]["topology"]["stages"]])
    engine = create_engine(pipeline, pipeline.stage("denoise"), model_dir)
    with pytest.raises(EngineConfigError, match=re.escape(f"{index_file}: {message}")):
        engine.load()
