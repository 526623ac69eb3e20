"""Qwen-Image (QwenImagePipeline: the Qwen2.5-VL text encoder over the prompt in the pipeline's template,
QwenImageTransformer2DModel over packed 2x2 latent patches with true CFG, flow matching shifted by image size, the
one-frame causal VAE) served as three stages from the published diffusers layout: it makes the image diffusers' own
QwenImagePipeline makes from the same directory, with and without true CFG; step batching never changes an image
(with the step cache on: test_step_cache.py); what the loop would run wrongly is refused by name, and
`omnistage serve` returns a PNG through both doors."""

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
from .test_sd3_stages import png_pixels, run, served_from
from .test_stage_support import assert_denoise_steps_shared

MODEL = "qwen-image-tiny"
PIPELINE = example(MODEL)
STAGES = ("text-encoder", "denoise", "vae-decode")
# The tiny pipeline's shapes: the text encoder 32 wide, a request's text tokens padded to a multiple of 64; 16
# latent channels, 8x smaller than the image (the VAE's three downsamplings), packed 2x2 into tokens of 64.
TEXT_WIDTH, TOKEN_BUCKET, LATENT_CHANNELS, VAE_SCALE = 32, 64, 16, 8
CACHE_THRESHOLD = 0.3  # the bench's choice for Qwen-Image (bench/step_cache.py); test_step_cache.py runs it


@pytest.fixture(scope="module")
def qwen_dir(model_dir):
    return model_dir / MODEL


servers = stage_servers_fixture(PIPELINE, STAGES)


@pytest.fixture(scope="module")
def reference(qwen_dir):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(qwen_dir)


def reference_images(reference, params, output_type):
    return reference(params["prompt"], negative_prompt=params.get("negative_prompt") or None,
                     true_cfg_scale=params["guidance_scale"], width=params["width"], height=params["height"],
                     num_inference_steps=params["num_inference_steps"],
                     generator=torch.Generator().manual_seed(params["seed"]), output_type=output_type).images


def assert_rows_are_the_pipelines(emb, reference, prompts) -> None:
    """Each row the pipeline's embeddings of its prompt, zero rows after them up to the request's bucket, and the
    mask saying which are the prompt's."""
    got, mask = tensor_of(emb[0], "embeddings"), tensor_of(emb[0], "embeddings_mask")
    assert got.shape[0] == len(prompts) and got.shape[1] % TOKEN_BUCKET == 0 and got.shape[2] == TEXT_WIDTH
    assert mask.dtype == torch.bool and mask.shape == got.shape[:2]
    for row, prompt in enumerate(prompts):
        with torch.inference_mode():
            want, want_mask = reference.encode_prompt(prompt)
        tokens = want.shape[1]
        assert want_mask is None  # one prompt: all its tokens, no mask
        torch.testing.assert_close(got[row, :tokens], want[0], atol=1e-5, rtol=1e-5)
        assert not got[row, tokens:].any()
        assert mask[row].tolist() == [True] * tokens + [False] * (len(mask[row]) - tokens)


@pytest.mark.parametrize("guidance, negative", [(4.0, "blurry, low quality"), (1.0, "")], ids=["true-cfg", "no-cfg"])
async def test_staged_qwen_image_makes_the_image_qwen_image_pipeline_makes(servers, reference, guidance, negative):
    from stage_service.engines.diffusers import text

    # The constants the text stage takes from QwenImagePipeline are its own.
    assert (text.QWEN_IMAGE_TEMPLATE, text.QWEN_IMAGE_DROPPED_TOKENS, text.QWEN_IMAGE_TOKENIZER_TOKENS) == (
        reference.prompt_template_encode, reference.prompt_template_encode_start_idx, reference.tokenizer_max_length)
    params = dict(prompt="a red car on a road", negative_prompt=negative, width=48, height=64, num_inference_steps=4,
                  seed=7, guidance_scale=guidance)
    emb, lat, img = await run(servers, **params)
    assert_rows_are_the_pipelines(emb, reference, [negative, params["prompt"]] if negative else [params["prompt"]])

    latents = tensor_of(lat[-1], "latents")
    assert latents.shape == (1, LATENT_CHANNELS, 64 // VAE_SCALE, 48 // VAE_SCALE)
    packed = reference_images(reference, params, "latent")  # QwenImagePipeline's latents stay packed
    want = reference._unpack_latents(packed, params["height"], params["width"], reference.vae_scale_factor)
    torch.testing.assert_close(latents, want[:, :, 0], atol=1e-4, rtol=1e-4)
    want_pixels = np.round(reference_images(reference, params, "np")[0] * 255).astype(np.int16)
    got_pixels = png_pixels(img[0])
    assert got_pixels.shape == (64, 48, 3) and np.abs(got_pixels - want_pixels).max() <= 1


async def test_the_guidance_scale_and_the_negative_prompt_change_the_image_only_under_true_cfg(servers):
    """As QwenImagePipeline: true CFG runs when the scale is above 1 and a negative prompt is given; without a
    negative prompt the scale changes nothing (one row)."""
    base = dict(prompt="a cat", width=32, height=32, num_inference_steps=3, seed=3)

    async def final(**params):
        emb = await call_stage(servers["text-encoder"].port, header(**base, **params))
        return tensor_of((await call_stage(servers["denoise"].port, header(**base, **params), emb))[-1], "latents")

    plain = await final(guidance_scale=1.0)
    assert torch.equal(await final(guidance_scale=6.0), plain)
    guided = [await final(guidance_scale=g, negative_prompt="a dog") for g in (3.0, 6.0)]
    assert (guided[0] - plain).abs().max() > 1e-3 and (guided[0] - guided[1]).abs().max() > 1e-3


async def test_prompts_of_one_length_encode_together_as_each_alone(qwen_dir):
    """The text encoder runs the prompts of one token count in one call, bit for bit as each alone."""
    from stage_service.engines.diffusers.layout import PipelineDir
    from stage_service.engines.diffusers.text import QwenImagePromptEncoder

    encoder = QwenImagePromptEncoder(PipelineDir(qwen_dir / "text_encoder"), torch.float32, batch_invariant=True)
    prompts = ["a cat", "a red car on a road", "a dog", "an astronaut riding a horse on the moon"]
    with torch.inference_mode():
        together = encoder.encode(prompts)
        alone = [encoder.encode([p]) for p in prompts]
    lengths = together["embeddings_mask"].sum(dim=1).tolist()
    assert lengths[0] == lengths[2] and len(set(lengths)) == 3  # "a cat", "a dog": one call of two
    for i, one in enumerate(alone):
        for name in ("embeddings", "embeddings_mask"):
            assert torch.equal(together[name][i:i + 1], one[name]), (prompts[i], name)


def test_the_one_frame_vae_decodes_an_image_alone_as_in_a_batch(qwen_dir):
    """Its causal 3-D convolutions and attention padded as Wan's VAE's are: each image's decode the same bit for bit
    whatever its neighbours (unpadded, a lone image's floats differ from its batched ones in the last bits)."""
    from stage_service.engines.diffusers.engines import VaeDecoder

    decoder = VaeDecoder(qwen_dir / "vae", torch.float32, torch.device("cpu"), batch_invariant=True)
    g = torch.Generator().manual_seed(0)
    latents = [torch.randn(1, LATENT_CHANNELS, 4, 6, generator=g) for _ in range(3)]
    with torch.inference_mode():  # the model's own decode of one frame, as the stage's decoder calls it
        together = decoder.vae.decode(torch.cat(latents).unsqueeze(2)).sample
        assert all(torch.equal(decoder.vae.decode(one.unsqueeze(2)).sample[0], both)
                   for one, both in zip(latents, together))
    pixels = decoder.decode(latents)
    assert pixels[0].shape == (4 * VAE_SCALE, 6 * VAE_SCALE, 3)
    assert all(np.array_equal(decoder.decode([one])[0], both) for one, both in zip(latents, pixels))


async def test_two_images_at_different_steps_share_model_calls_and_each_gets_its_image_alone(model_dir):
    # Under true CFG the long one has two rows beside the short one's one; both prompts' tokens pad to 64.
    await assert_denoise_steps_shared(
        model_dir, MODEL, dict(prompt="an astronaut riding a horse", negative_prompt="blurry", width=32, height=32,
                               num_inference_steps=100, seed=1, guidance_scale=4.0),
        dict(prompt="a cat", width=32, height=32, num_inference_steps=5, seed=2, guidance_scale=1.0), "image")


async def test_bad_text_inputs_and_sizes_are_refused_naming_what_is_wrong(servers):
    emb = await call_stage(servers["text-encoder"].port, header())
    good = {t.name: tensors.from_proto(t) for t in emb[0].tensors}
    tokens = good["embeddings"].shape[1]

    def chunk(**named):
        return stage_pb2.Chunk(stage="text-encoder", chunk_id=0, end_of_stream=True,
                               tensors=[tensors.to_proto(k, v) for k, v in named.items()])

    for bad, message in [
        (chunk(embeddings=good["embeddings"]), 'has no tensor "embeddings_mask"'),
        (chunk(embeddings=good["embeddings"], embeddings_mask=good["embeddings_mask"].long()),
         f"embeddings_mask must be [1, {tokens}] bool, got [1, {tokens}] torch.int64"),
        (chunk(embeddings=good["embeddings"], embeddings_mask=good["embeddings_mask"][:, :7]),
         f"embeddings_mask must be [1, {tokens}] bool, got [1, 7]"),
        (chunk(embeddings=torch.zeros(1, tokens, 7), embeddings_mask=good["embeddings_mask"]),
         f"embeddings must be [1 or 2, tokens, {TEXT_WIDTH}], got [1, {tokens}, 7]"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(servers["denoise"].port, header(), [bad])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()

    # A side that is not a whole number of packed patches: 8 (the VAE) x 2 (QwenImagePipeline's packing) pixels.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["denoise"].port, header(width=72, height=64), emb)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("params.image.width: must be a multiple of 16 for this QwenImageTransformer2DModel, got 72"
            in e.value.details())


@pytest.mark.parametrize("changed, why", [
    ({"zero_cond_t": True}, r"with zero_cond_t \(Qwen-Image-Edit-2511\) is not served"),
    ({"guidance_embeds": True}, r"with guidance_embeds \(guidance-distilled\) is not served"),
    ({"in_channels": 128}, r"with in_channels 128, out_channels 16 and patch_size 2 is not served"),
])
async def test_transformers_the_loop_would_run_wrongly_are_refused_by_name(qwen_dir, model_dir, tmp_path, changed,
                                                                         why):
    root = tmp_path / MODEL
    shutil.copytree(qwen_dir, root)
    cfg_file = root / "transformer" / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **changed}))
    with pytest.raises(EngineConfigError, match=why):
        srv = await start_stage(example(MODEL, served_from(root)), "denoise", model_dir)
        await srv.drain()


def test_the_split_forward_for_the_step_cache_is_the_transformers_own_bit_for_bit(qwen_dir):
    """Every row through every block (no request has a residual yet), Qwen-Image's split forward (its first block,
    then the others) is the model's own forward on two requests' rows at different timesteps, one of them with
    padded text tokens masked."""
    from diffusers import QwenImageTransformer2DModel

    from stage_service.engines.diffusers.denoisers import DENOISERS
    from stage_service.engines.diffusers.step_cache import (
        CachedRequest,
        StepCachePolicy,
        StepCacheState,
        cached_forward,
    )
    from stage_service.runtime.invariance import make_batch_invariant

    dit = QwenImageTransformer2DModel.from_pretrained(qwen_dir / "transformer").eval()
    make_batch_invariant(dit)
    call = DENOISERS["QwenImageTransformer2DModel"]
    cfg = dict(dit.config)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, LATENT_CHANNELS, 8, 6, generator=g)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    text = {"encoder_hidden_states": torch.randn(2, 9, TEXT_WIDTH, generator=g), "encoder_hidden_states_mask": mask}
    forward = {"hidden_states": call.pack(x, cfg), "timestep": torch.tensor([0.9, 0.5]), **text,
               **call.extra(x, text, torch.tensor([4.0, 1.0]), cfg)}
    assert forward["img_shapes"] == [[(1, 4, 3)]] * 2
    requests = [CachedRequest(StepCacheState(), 1, 0, 10), CachedRequest(StepCacheState(), 1, 0, 10)]
    assert call.blocks is not None
    with torch.inference_mode():
        want = dit(**forward, return_dict=False)[0]
        got, reused = cached_forward(dit, call.blocks, StepCachePolicy(CACHE_THRESHOLD), requests, forward)
    assert reused == 0 and torch.equal(got, want)


@pytest.mark.slow  # real processes, as tests/local's serve tests
def test_omnistage_serve_qwen_image_answers_both_doors_with_a_png(model_dir, tmp_path):
    """gRPC Generate (`omnistage generate`) and the OpenAI images API of one `omnistage serve`, over HTTP with a
    negative prompt (true CFG); a size the transformer cannot take is refused naming its field."""
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
                                       extra_body={"num_inference_steps": 3, "negative_prompt": "blurry",
                                                   "guidance_scale": 4.0})
        img = Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json)))
        assert img.size == (64, 32) and img.format == "PNG"
        with pytest.raises(openai.BadRequestError) as e:
            client.images.generate(model=MODEL, prompt="a red car", size="72x32",
                                   extra_body={"num_inference_steps": 3})
        assert "size: must be a multiple of 16 for this QwenImageTransformer2DModel, got 72" in str(e.value)
    finally:
        assert s.stop() == 0
    assert descendants_alive(s.pids) == []
