"""FLUX.1 (FluxPipeline: a CLIP and a T5 text encoder, FluxTransformer2DModel over packed 2x2 latent patches with
the guidance embedding, flow matching shifted by image size, a 16-channel VAE) served as three stages from the
published diffusers layout: it makes the image diffusers' own FluxPipeline makes from the same directory, step
batching never changes an image (with the step cache on too), what the loop would run wrongly is refused by
name, and `omnistage serve` returns a PNG."""

from __future__ import annotations

import json
import shutil

import grpc
import numpy as np
import pytest
import torch

from omnistage.contract import tensors
from omnistage.v1 import stage_pb2
from stage_service.runtime.errors import EngineConfigError

from ..harness import call_stage, example, header, stage_servers_fixture, start_stage, tensor_of
from ..local.test_cli_serve import Served, descendants_alive, generate
from ..step_cache_support import SecondBlockRows, pixels, psnr_db, step_cache
from .test_sd3_stages import png_pixels, run, served_from
from .test_stage_support import assert_denoise_steps_shared

MODEL = "flux-tiny"
PIPELINE = example(MODEL)
STAGES = ("text-encoder", "denoise", "vae-decode")
# The tiny pipeline's shapes: FluxPipeline's 512 T5 tokens, 32 wide; CLIP's pooled output 32 wide; 16 latent
# channels, 8x smaller than the image (the VAE's four blocks), packed 2x2 into tokens of 64.
T5_TOKENS, T5_WIDTH, POOLED_WIDTH, LATENT_CHANNELS, VAE_SCALE = 512, 32, 32, 16, 8
CACHE_THRESHOLD = 0.3  # the bench's choice for FLUX (bench/step_cache.py)


@pytest.fixture(scope="module")
def flux_dir(model_dir):
    return model_dir / MODEL


servers = stage_servers_fixture(PIPELINE, STAGES)


@pytest.fixture(scope="module")
def reference(flux_dir):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(flux_dir)


def reference_images(reference, params, output_type):
    true_cfg = {k: params[k] for k in ("negative_prompt", "true_cfg_scale") if k in params}
    return reference(params["prompt"], width=params["width"], height=params["height"],
                     num_inference_steps=params["num_inference_steps"], guidance_scale=params["guidance_scale"],
                     generator=torch.Generator().manual_seed(params["seed"]), output_type=output_type,
                     **true_cfg).images


@pytest.mark.parametrize("guidance", [3.5, 1.0], ids=["guided", "unguided"])
async def test_staged_flux_makes_the_image_flux_pipeline_makes(servers, reference, guidance):
    params = dict(prompt="a red car on a road", width=48, height=64, num_inference_steps=4, seed=7,
                  guidance_scale=guidance)
    emb, lat, img = await run(servers, **params)

    with torch.inference_mode():
        want_emb, want_pooled, _ = reference.encode_prompt(params["prompt"], None)
    got_emb, got_pooled = tensor_of(emb[0], "embeddings"), tensor_of(emb[0], "pooled_embeddings")
    # One row whatever the guidance: FLUX.1-dev's guidance is the transformer's input.
    assert got_emb.shape == (1, T5_TOKENS, T5_WIDTH) and got_pooled.shape == (1, POOLED_WIDTH)
    torch.testing.assert_close(got_emb, want_emb, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_pooled, want_pooled, atol=1e-5, rtol=1e-5)

    latents = tensor_of(lat[-1], "latents")
    assert latents.shape == (1, LATENT_CHANNELS, 64 // VAE_SCALE, 48 // VAE_SCALE)
    packed = reference_images(reference, params, "latent")  # FluxPipeline's latents stay packed
    want = reference._unpack_latents(packed, params["height"], params["width"], reference.vae_scale_factor)
    torch.testing.assert_close(latents, want, atol=1e-4, rtol=1e-4)
    want_pixels = np.round(reference_images(reference, params, "np")[0] * 255).astype(np.int16)
    got_pixels = png_pixels(img[0])
    assert got_pixels.shape == (64, 48, 3) and np.abs(got_pixels - want_pixels).max() <= 1


async def test_true_cfg_makes_the_image_flux_pipeline_makes_over_negative_and_prompt_rows(servers, reference):
    """FluxPipeline's true classifier-free guidance: a negative prompt and true_cfg_scale above 1 run the model over
    [negative, prompt] rows, combined at true_cfg_scale, each row still taking the distilled guidance scale."""
    params = dict(prompt="a red car on a road", negative_prompt="blurry, dark", true_cfg_scale=4.0, width=32,
                  height=48, num_inference_steps=3, seed=9, guidance_scale=3.5)
    emb, lat, img = await run(servers, **params)

    with torch.inference_mode():
        pe, pooled, _ = reference.encode_prompt(params["prompt"], None)
        neg_pe, neg_pooled, _ = reference.encode_prompt(params["negative_prompt"], None)
    got_emb, got_pooled = tensor_of(emb[0], "embeddings"), tensor_of(emb[0], "pooled_embeddings")
    assert got_emb.shape == (2, T5_TOKENS, T5_WIDTH) and got_pooled.shape == (2, POOLED_WIDTH)
    torch.testing.assert_close(got_emb, torch.cat([neg_pe, pe]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_pooled, torch.cat([neg_pooled, pooled]), atol=1e-5, rtol=1e-5)

    packed = reference_images(reference, params, "latent")
    want = reference._unpack_latents(packed, params["height"], params["width"], reference.vae_scale_factor)
    latents = tensor_of(lat[-1], "latents")
    torch.testing.assert_close(latents, want, atol=1e-4, rtol=1e-4)
    plain = reference._unpack_latents(reference_images(reference, {**params, "true_cfg_scale": 1.0}, "latent"),
                                      params["height"], params["width"], reference.vae_scale_factor)
    assert (latents - plain).abs().max() > 1e-3  # the negative rows changed the image
    want_pixels = np.round(reference_images(reference, params, "np")[0] * 255).astype(np.int16)
    assert np.abs(png_pixels(img[0]) - want_pixels).max() <= 1


async def test_the_guidance_scale_reaches_the_guidance_embedding(servers):
    """Same seed, same one text row: another guidance scale is another image, as FluxPipeline's."""
    params = dict(prompt="a cat", width=32, height=32, num_inference_steps=3, seed=3)
    emb = await call_stage(servers["text-encoder"].port, header(**params, guidance_scale=3.5))
    finals = [tensor_of((await call_stage(servers["denoise"].port, header(**params, guidance_scale=g), emb))[-1],
                        "latents") for g in (3.5, 7.0)]
    assert (finals[0] - finals[1]).abs().max() > 1e-3


async def test_two_images_at_different_steps_share_model_calls_and_each_gets_its_image_alone(model_dir):
    await assert_denoise_steps_shared(
        model_dir, MODEL, dict(prompt="an astronaut riding a horse", width=32, height=32, num_inference_steps=100,
                               seed=1),
        dict(prompt="a cat", width=32, height=32, num_inference_steps=5, seed=2, guidance_scale=1.0), "image")


async def test_bad_text_inputs_sizes_and_a_negative_prompt_are_refused_naming_what_is_wrong(servers):
    for params, message in [
        (dict(negative_prompt="blurry"), "params.image.negative_prompt: a FluxPipeline reads a negative prompt only "
                                         "for its true classifier-free guidance"),
        (dict(true_cfg_scale=4.0), "params.image.true_cfg_scale: a FluxPipeline runs true classifier-free guidance "
                                   "against a negative prompt"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(servers["text-encoder"].port, header(**params))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in e.value.details()

    emb = await call_stage(servers["text-encoder"].port, header())
    good = {t.name: tensors.from_proto(t) for t in emb[0].tensors}

    def chunk(**named):
        return stage_pb2.Chunk(stage="text-encoder", chunk_id=0, end_of_stream=True,
                               tensors=[tensors.to_proto(k, v) for k, v in named.items()])

    two_rows = {k: torch.cat([v, v]) for k, v in good.items()}  # [negative, prompt] rows: not this loop's guidance
    for bad, message in [
        (chunk(embeddings=good["embeddings"]), 'has no tensor "pooled_embeddings"'),
        (chunk(embeddings=good["embeddings"], pooled_embeddings=torch.zeros(1, 7)),
         f"pooled_embeddings must be [1, {POOLED_WIDTH}], got [1, 7]"),
        (chunk(**two_rows), f"embeddings must be [1, tokens, {T5_WIDTH}], got [2, {T5_TOKENS}, {T5_WIDTH}]"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(servers["denoise"].port, header(), [bad])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:  # true classifier-free guidance: [negative, prompt] rows
        await call_stage(servers["denoise"].port, header(negative_prompt="blurry", true_cfg_scale=4.0), emb)
    assert f"embeddings must be [2, tokens, {T5_WIDTH}], got [1, {T5_TOKENS}, {T5_WIDTH}]" in e.value.details()

    # A side that is not a whole number of packed patches: 8 (the VAE) x 2 (FluxPipeline's packing) pixels.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["denoise"].port, header(width=72, height=64), emb)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.image.width: must be a multiple of 16 for this FluxTransformer2DModel, got 72" in e.value.details()


async def test_a_fill_or_control_transformer_is_refused_by_name(flux_dir, model_dir, tmp_path):
    """A FluxTransformer2DModel taking channels beyond its latents' (FLUX.1 Fill: 384 in, 64 out) would need a
    masked image's latents beside its own: the denoise stage refuses it rather than run it on latents alone."""
    root = tmp_path / MODEL
    shutil.copytree(flux_dir, root)
    cfg_file = root / "transformer" / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "in_channels": 384, "out_channels": 64}))
    with pytest.raises(EngineConfigError, match=r"a FluxTransformer2DModel with in_channels 384 and out_channels 64 "
                                                r"\(FLUX.1 Fill, Depth or Canny\) is not served"):
        srv = await start_stage(example(MODEL, served_from(root)), "denoise", model_dir)
        await srv.drain()


async def test_a_schnell_transformer_without_the_guidance_embedding_makes_flux_pipelines_image(
        servers, flux_dir, model_dir, tmp_path):
    """FLUX.1-schnell's transformer has no guidance embedding (`guidance_embeds: false`): the loop sends none, as
    FluxPipeline does, and the guidance scale changes nothing."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    root = tmp_path / MODEL
    shutil.copytree(flux_dir, root)
    dev = FluxTransformer2DModel.from_pretrained(flux_dir / "transformer")
    schnell = FluxTransformer2DModel.from_config({**dev.config, "guidance_embeds": False})
    schnell.load_state_dict({k: v for k, v in dev.state_dict().items() if ".guidance_embedder." not in k})
    shutil.rmtree(root / "transformer")
    schnell.save_pretrained(root / "transformer")
    srv = await start_stage(example(MODEL, served_from(root)), "denoise", model_dir)
    try:
        params = dict(prompt="a photo of a cat", width=32, height=32, num_inference_steps=3, seed=4)
        emb = await call_stage(servers["text-encoder"].port, header(**params))
        finals = [tensor_of((await call_stage(srv.port, header(**params, guidance_scale=g), emb))[-1], "latents")
                  for g in (0.0, 3.5)]
    finally:
        await srv.drain()
    assert torch.equal(finals[0], finals[1])
    reference = FluxPipeline.from_pretrained(root)
    packed = reference_images(reference, {**params, "guidance_scale": 3.5}, "latent")
    want = reference._unpack_latents(packed, 32, 32, reference.vae_scale_factor)
    torch.testing.assert_close(finals[0], want, atol=1e-4, rtol=1e-4)


def test_the_split_forward_for_the_step_cache_is_the_transformers_own_bit_for_bit(flux_dir):
    """Every row through every block (no request has a residual yet), FLUX's split forward (its first dual-stream
    block, then the others and every single-stream block) is the model's own forward on two requests' rows at
    different timesteps and guidance scales."""
    from diffusers import FluxTransformer2DModel

    from stage_service.engines.diffusers.denoisers import DENOISERS
    from stage_service.engines.diffusers.step_cache import (
        CachedRequest,
        StepCachePolicy,
        StepCacheState,
        cached_forward,
    )
    from stage_service.runtime.invariance import make_batch_invariant

    dit = FluxTransformer2DModel.from_pretrained(flux_dir / "transformer").eval()
    make_batch_invariant(dit)
    call = DENOISERS["FluxTransformer2DModel"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, LATENT_CHANNELS, 8, 6, generator=g)
    text = {"encoder_hidden_states": torch.randn(2, 9, T5_WIDTH, generator=g),
            "pooled_projections": torch.randn(2, POOLED_WIDTH, generator=g)}
    forward = {"hidden_states": call.pack(x, dict(dit.config)), "timestep": torch.tensor([0.9, 0.5]), **text,
               **call.extra(x, text, torch.tensor([3.5, 1.0]), dict(dit.config))}
    assert forward["img_ids"].shape == (4 * 3, 3) and forward["txt_ids"].shape == (9, 3)
    requests = [CachedRequest(StepCacheState(), 1, 0, 10), CachedRequest(StepCacheState(), 1, 0, 10)]
    assert call.blocks is not None
    with torch.inference_mode():
        want = dit(**forward, return_dict=False)[0]
        got, reused = cached_forward(dit, call.blocks, StepCachePolicy(CACHE_THRESHOLD), requests, forward)
    assert reused == 0 and torch.equal(got, want)
    assert torch.equal(call.unpack(call.pack(x, {}), x.shape, {}), x)


async def test_cached_steps_skip_the_later_blocks_and_a_request_gets_its_latents_alone_as_batched(model_dir):
    steps = 12
    params = dict(prompt="a red car on a road", width=32, height=32, num_inference_steps=steps, seed=5)
    servers = {}
    try:
        for name, edit in (("plain", None), ("cached", step_cache(CACHE_THRESHOLD))):
            servers[name] = await start_stage(example(MODEL, edit), "denoise", model_dir)
        servers["text"] = await start_stage(PIPELINE, "text-encoder", model_dir)
        servers["vae"] = await start_stage(PIPELINE, "vae-decode", model_dir)
        counted = SecondBlockRows(servers["cached"])
        emb = await call_stage(servers["text"].port, header(**params))
        latents = {name: await call_stage(servers[name].port, header(**params), emb) for name in ("plain", "cached")}
        reused = servers["cached"].metrics.registry.get_sample_value("omnistage_stage_cached_steps_total",
                                                                     {"stage": "denoise"}) or 0.0
        assert 0 < reused <= steps - 2 and counted.rows == steps - reused  # one row a step
        images = {name: pixels(await call_stage(servers["vae"].port, header(**params), latents[name]), "image")
                  for name in latents}
        assert psnr_db(images["cached"], images["plain"]) >= 30.0
    finally:
        for srv in servers.values():
            await srv.drain()

    def reused_steps(den) -> None:
        assert (den.metrics.registry.get_sample_value("omnistage_stage_cached_steps_total",
                                                      {"stage": den.stage.name}) or 0.0) > 0

    await assert_denoise_steps_shared(
        model_dir, MODEL, dict(prompt="an astronaut riding a horse", width=32, height=32, num_inference_steps=60,
                               seed=1),
        dict(prompt="a cat", width=32, height=32, num_inference_steps=8, seed=2, guidance_scale=1.0), "image",
        edit=step_cache(CACHE_THRESHOLD), check=reused_steps)


@pytest.mark.slow  # real processes, as tests/local's serve tests
def test_omnistage_serve_flux_answers_both_doors_with_a_png(model_dir, tmp_path):
    """gRPC Generate (`omnistage generate`) and the OpenAI images API of one `omnistage serve`; over HTTP a
    negative prompt is refused naming its field."""
    import base64
    import io

    import openai
    from openai import OpenAI
    from PIL import Image

    s = Served(MODEL, model_dir, tmp_path)
    try:
        out = tmp_path / "img.png"
        r = generate(s.endpoint, "--prompt", "a red car", "--width", "96", "--height", "64",
                     "--num-inference-steps", "3", "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert Image.open(io.BytesIO(out.read_bytes())).size == (96, 64)
        api = s.wait_for(r"OpenAI API: (http://127\.0\.0\.1:\d+/v1)\n", 5)
        client = OpenAI(base_url=api, api_key="unused", max_retries=0)
        reply = client.images.generate(model=MODEL, prompt="a red car", size="64x32", response_format="b64_json",
                                       extra_body={"num_inference_steps": 3})
        img = Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json)))
        assert img.size == (64, 32) and img.format == "PNG"
        with pytest.raises(openai.BadRequestError) as e:
            client.images.generate(model=MODEL, prompt="a red car", size="64x32",
                                   extra_body={"num_inference_steps": 3, "negative_prompt": "blurry"})
        assert "negative_prompt" in str(e.value) and "true_cfg_scale above 1" in str(e.value)
        reply = client.images.generate(model=MODEL, prompt="a red car", size="64x32", response_format="b64_json",
                                       extra_body={"num_inference_steps": 3, "negative_prompt": "blurry",
                                                   "true_cfg_scale": 4.0})
        assert Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json))).size == (64, 32)
    finally:
        assert s.stop() == 0
    assert descendants_alive(s.pids) == []
