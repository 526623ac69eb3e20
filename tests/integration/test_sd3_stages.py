"""The SD3-style DiT pipeline (CLIP-L + CLIP-G text encoders, SD3Transformer2DModel, flow matching, a
16-channel VAE) served as three stages from the published diffusers layout: it makes the image diffusers'
own StableDiffusion3Pipeline makes from the same directory, step batching never changes an image, and
`omnistage serve` returns a PNG."""

from __future__ import annotations

import io
import json
import shutil

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.contract import tensors
from omnistage.v1 import stage_pb2

from ..harness import call_stage, example, header, stage_servers_fixture, start_stage, tensor_of
from ..local.test_cli_serve import serves_a_png
from .test_stage_support import assert_denoise_steps_shared

MODEL = "sd3-tiny"
PIPELINE = example(MODEL)
STAGES = ("text-encoder", "denoise", "vae-decode")
# The tiny pipeline's shapes: 77 CLIP tokens + 256 (absent) T5 tokens, 96 wide; pooled 32 + 48 wide.
TEXT_TOKENS, JOINT_WIDTH, POOLED_WIDTH, LATENT_CHANNELS = 77 + 256, 96, 80, 16


@pytest.fixture(scope="module")
def sd3_dir(model_dir):
    return model_dir / MODEL


servers = stage_servers_fixture(PIPELINE, STAGES)


@pytest.fixture(scope="module")
def reference(sd3_dir):
    """diffusers' own pipeline on the same directory (it goes without T5, as the tiny model does)."""
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline.from_pretrained(sd3_dir, text_encoder_3=None, tokenizer_3=None)


async def run(servers, **params):
    emb = await call_stage(servers["text-encoder"].port, header(**params))
    lat = await call_stage(servers["denoise"].port, header(**params), emb)
    img = await call_stage(servers["vae-decode"].port, header(**params), lat)
    return emb, lat, img


def served_from(path):
    """A pipeline edit: every stage serves the pipeline directory at `path`."""
    def edit(doc):
        for stage in doc["spec"]["topology"]["stages"]:
            stage["model"] = str(path)
    return edit


def png_pixels(chunk) -> np.ndarray:
    png = tensor_of(chunk, "image").numpy().tobytes()
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


@pytest.mark.parametrize("guidance", [5.0, 1.0], ids=["guided", "unguided"])
async def test_staged_sd3_makes_the_image_stable_diffusion3_pipeline_makes(servers, reference, guidance):
    params = dict(prompt="a red car on a road", negative_prompt="a blue sky", width=48, height=64,
                  num_inference_steps=4, seed=7, guidance_scale=guidance)
    emb, lat, img = await run(servers, **params)

    guided = guidance > 1.0
    with torch.inference_mode():
        pe, neg_pe, pooled, neg_pooled = reference.encode_prompt(
            params["prompt"], None, None, negative_prompt=params["negative_prompt"], do_classifier_free_guidance=guided)
    want_emb = torch.cat([neg_pe, pe]) if guided else pe
    want_pooled = torch.cat([neg_pooled, pooled]) if guided else pooled
    got_emb, got_pooled = tensor_of(emb[0], "embeddings"), tensor_of(emb[0], "pooled_embeddings")
    assert got_emb.shape == (1 + guided, TEXT_TOKENS, JOINT_WIDTH) and got_pooled.shape == (1 + guided, POOLED_WIDTH)
    torch.testing.assert_close(got_emb, want_emb, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_pooled, want_pooled, atol=1e-5, rtol=1e-5)

    def reference_run(output_type):
        return reference(params["prompt"], negative_prompt=params["negative_prompt"], width=params["width"],
                         height=params["height"], num_inference_steps=params["num_inference_steps"],
                         guidance_scale=guidance, generator=torch.Generator().manual_seed(params["seed"]),
                         output_type=output_type).images

    latents = tensor_of(lat[-1], "latents")
    assert latents.shape == (1, LATENT_CHANNELS, 32, 24)  # the tiny VAE downsamples by 2
    torch.testing.assert_close(latents, reference_run("latent"), atol=1e-4, rtol=1e-4)
    want_png = np.asarray(reference_run("pil")[0], dtype=np.int16)
    got_png = png_pixels(img[0])
    assert got_png.shape == (64, 48, 3) and np.abs(got_png - want_png).max() <= 1


async def test_two_images_at_different_steps_share_model_calls_and_each_gets_its_image_alone(model_dir):
    await assert_denoise_steps_shared(
        model_dir, MODEL, dict(prompt="an astronaut riding a horse", width=32, height=32, num_inference_steps=100,
                               seed=1),
        dict(prompt="a cat", width=32, height=32, num_inference_steps=5, seed=2, guidance_scale=1.0), "image")


async def test_bad_text_inputs_and_sizes_are_refused_naming_what_is_wrong(servers, model_dir):
    emb = await call_stage(servers["text-encoder"].port, header())
    good = {t.name: tensors.from_proto(t) for t in emb[0].tensors}

    def chunk(**named):
        return stage_pb2.Chunk(stage="text-encoder", chunk_id=0, end_of_stream=True,
                               tensors=[tensors.to_proto(k, v) for k, v in named.items()])

    for bad, message in [
        (chunk(embeddings=good["embeddings"]), 'has no tensor "pooled_embeddings"'),
        (chunk(embeddings=good["embeddings"], pooled_embeddings=torch.zeros(2, 7)),
         f"pooled_embeddings must be [2, {POOLED_WIDTH}], got [2, 7]"),
        (chunk(embeddings=good["embeddings"][..., :32], pooled_embeddings=good["pooled_embeddings"]),
         f"embeddings must be [1 or 2, tokens, {JOINT_WIDTH}], got [2, {TEXT_TOKENS}, 32]"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(servers["denoise"].port, header(), [bad])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()

    # Past what the DiT's position embedding covers (64 patches of 2 latents of 2 pixels a side).
    wide = example(MODEL, lambda d: d["spec"]["topology"]["limits"].update(maxImageSide=512))
    srv = await start_stage(wide, "denoise", model_dir)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(srv.port, header(width=320, height=64), emb)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "params.image.width: must be at most 256 for this SD3Transformer2DModel, got 320" in e.value.details()
    finally:
        await srv.drain()


async def test_a_resolution_shifted_flow_schedule_is_the_pipelines(servers, sd3_dir, model_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    root = tmp_path / MODEL  # the same pipeline, its scheduler shifted by image size (as FLUX's and SD3.5's may be)
    shutil.copytree(sd3_dir, root)
    sched_file = root / "scheduler" / "scheduler_config.json"
    sched_file.write_text(json.dumps({**json.loads(sched_file.read_text()), "use_dynamic_shifting": True}))
    srv = await start_stage(example(MODEL, served_from(root)), "denoise", model_dir)
    try:
        params = dict(prompt="a photo of a cat", width=64, height=32, num_inference_steps=3, seed=4, guidance_scale=4.0)
        emb = await call_stage(servers["text-encoder"].port, header(**params))
        shifted = tensor_of((await call_stage(srv.port, header(**params), emb))[-1], "latents")
        fixed = tensor_of((await call_stage(servers["denoise"].port, header(**params), emb))[-1], "latents")
    finally:
        await srv.drain()
    reference = StableDiffusion3Pipeline.from_pretrained(root, text_encoder_3=None, tokenizer_3=None)
    want = reference(params["prompt"], width=64, height=32, num_inference_steps=3, guidance_scale=4.0,
                     generator=torch.Generator().manual_seed(4), output_type="latent").images
    torch.testing.assert_close(shifted, want, atol=1e-4, rtol=1e-4)
    assert (shifted - fixed).abs().max() > 1e-2  # the shift changed the schedule


@pytest.fixture(scope="module")
def sd3_with_t5(sd3_dir, tmp_path_factory):
    """The tiny pipeline with a tiny T5 encoder added (`text_encoder_3`, `tokenizer_3`), as SD3 is published."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    from omnistage.tiny_models.tokenizers_local import CORPUS

    root = tmp_path_factory.mktemp("sd3-t5") / MODEL
    shutil.copytree(sd3_dir, root)
    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.train_from_iterator(CORPUS * 20, trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False))
    vocab = [tuple(v) for v in json.loads(unigram.to_str())["model"]["vocab"]]
    tokenizer = T5TokenizerFast(vocab=vocab, extra_ids=0)
    torch.manual_seed(0)
    t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=JOINT_WIDTH, d_kv=16, d_ff=64, num_layers=1,
                                 num_heads=4))
    t5.save_pretrained(root / "text_encoder_3")
    tokenizer.save_pretrained(root / "tokenizer_3")
    index = json.loads((root / "model_index.json").read_text())
    index.update(text_encoder_3=["transformers", type(t5).__name__],
                 tokenizer_3=["transformers", type(tokenizer).__name__])
    (root / "model_index.json").write_text(json.dumps(index))
    return root


async def test_with_t5_the_text_stage_encodes_as_stable_diffusion3_pipeline(sd3_with_t5, model_dir):
    from diffusers import StableDiffusion3Pipeline

    srv = await start_stage(example(MODEL, served_from(sd3_with_t5)), "text-encoder", model_dir)
    try:
        emb = await call_stage(srv.port, header(prompt="a cat sitting on a red car", negative_prompt="a dog"))
    finally:
        await srv.drain()
    reference = StableDiffusion3Pipeline.from_pretrained(sd3_with_t5)
    assert reference.text_encoder_3 is not None
    with torch.inference_mode():
        pe, neg_pe, pooled, neg_pooled = reference.encode_prompt("a cat sitting on a red car", None, None,
                                                                 negative_prompt="a dog")
    got = tensor_of(emb[0], "embeddings")
    assert got.shape == (2, TEXT_TOKENS, JOINT_WIDTH) and got[:, 77:].abs().sum() > 0  # T5 tokens, not zeros
    torch.testing.assert_close(got, torch.cat([neg_pe, pe]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tensor_of(emb[0], "pooled_embeddings"), torch.cat([neg_pooled, pooled]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # real processes, as tests/local's serve tests
def test_omnistage_serve_sd3_returns_a_png(model_dir, tmp_path):
    serves_a_png(MODEL, model_dir, tmp_path)
