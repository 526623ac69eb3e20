"""The Qwen-Image family's declarations and its denoiser entry, read without loading a model: the family table, the
classes its checkpoint names, the limits taken from QwenImagePipeline's own defaults, its packing, image shapes,
true CFG and schedule, the rows and token buckets of its prompt encoding, and the transformers it refuses."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from omnistage.api import accepted_inputs
from omnistage.checkpoints.components import allowed
from omnistage.checkpoints.defaults import with_model_limits
from omnistage.contract.errors import InvalidRequest
from omnistage.contract.params import RequestParams
from omnistage.families import family_of
from stage_service.engines.diffusers.denoisers import DENOISERS, resolution_shift
from stage_service.engines.diffusers.engines import IMAGE_VAES, TextEncoderEngine, vae_scales
from stage_service.engines.diffusers.layout import PipelineDir
from stage_service.engines.diffusers.text import (
    PROMPT_ENCODERS,
    QWEN_IMAGE_TEXT_TOKENS,
    QWEN_IMAGE_TOKEN_BUCKET,
    QwenImagePromptEncoder,
)

from ..harness import example

MODEL = "qwen-image-tiny"
QWEN = DENOISERS["QwenImageTransformer2DModel"]
# Qwen/Qwen-Image's transformer config, in part, and its scheduler's.
PUBLISHED = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "joint_attention_dim": 3584,
             "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]}
SCHEDULER = {"use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5,
             "max_shift": 0.9}


def test_a_qwen_image_pipeline_is_the_qwen_image_family_and_its_classes_load_without_remote_code(model_dir):
    family = family_of("QwenImagePipeline")
    assert family is not None and family.name == "qwen_image"
    assert family.components == ("text_encoder", "transformer", "vae")
    assert family.pipeline["text_encoder"].weights == ("text_encoder",)
    assert PROMPT_ENCODERS["QwenImagePipeline"] is QwenImagePromptEncoder
    assert "Qwen2_5_VLForConditionalGeneration" in TextEncoderEngine.ARCHITECTURES
    assert "AutoencoderKLQwenImage" in IMAGE_VAES
    pipe = PipelineDir(model_dir / MODEL / "transformer")
    assert pipe.pipeline_class == "QwenImagePipeline"
    for component in ("text_encoder", "tokenizer", "transformer", "vae", "scheduler"):
        assert allowed(*pipe.index[component]), component
    assert vae_scales(pipe) == (8, 1)  # as published: three downsamplings (temperal_downsample), one frame


def test_limits_left_open_take_qwen_image_pipelines_defaults(model_dir):
    pipeline = example(MODEL)
    open_limits = dataclasses.replace(pipeline, limits=dataclasses.replace(
        pipeline.limits, default_image_side=0, default_inference_steps=0, max_image_side=1024))
    filled, notes = with_model_limits(open_limits, model_dir)
    limits = filled.limits
    assert (limits.default_inference_steps, limits.default_guidance_scale) == (50, 4.0)  # true_cfg_scale's
    assert (limits.default_width, limits.default_height) == (1024, 1024)  # its 128 x its VAE's 8
    assert not any("cannot read" in n for n in notes)
    assert accepted_inputs(pipeline) == {"text"}


def test_latents_are_packed_2x2_and_image_shapes_given_as_qwen_image_pipeline_does():
    from diffusers import QwenImagePipeline

    x = torch.randn(2, 16, 6, 4)
    packed = QWEN.pack(x, PUBLISHED)
    assert torch.equal(packed, QwenImagePipeline._pack_latents(x, 2, 16, 6, 4)) and packed.shape == (2, 6, 64)
    assert torch.equal(QWEN.unpack(packed, x.shape, PUBLISHED), x)
    unpacked = QwenImagePipeline._unpack_latents(packed, 6 * 8, 4 * 8, 8)  # [b, c, 1 frame, h, w]
    assert torch.equal(unpacked[:, :, 0], x)
    assert QWEN.latent_channels(PUBLISHED) == 16 and QWEN.condition_channels(PUBLISHED) == 0
    assert QWEN.patch(PUBLISHED) == 2 and QWEN.guidance_rows and QWEN.timestep_divisor == 1000.0
    extra = QWEN.extra(torch.zeros(2, 16, 6, 4), {}, torch.tensor([4.0, 4.0]), PUBLISHED)
    assert extra == {"img_shapes": [[(1, 3, 2)]] * 2}  # the pipeline's, per row


def test_true_cfg_is_qwen_image_pipelines_combination_rescaled_to_the_conditional_norm():
    """The loop's combination of unpacked predictions is the pipeline's over its packed ones."""
    from diffusers import QwenImagePipeline

    g = torch.Generator().manual_seed(0)
    uncond, cond = torch.randn(1, 16, 6, 4, generator=g), torch.randn(1, 16, 6, 4, generator=g)
    neg, pos = (QwenImagePipeline._pack_latents(t, 1, 16, 6, 4) for t in (uncond, cond))
    comb = neg + 4.0 * (pos - neg)
    want = comb * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    got = QWEN.combine(uncond, cond, 4.0, PUBLISHED)
    torch.testing.assert_close(QWEN.pack(got, PUBLISHED), want, atol=0, rtol=0)
    assert not torch.allclose(got, uncond + 4.0 * (cond - uncond))  # the rescale is there


def test_the_schedule_is_the_pipelines_sigmas_shifted_by_the_image_size():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    kw = QWEN.schedule(50, 4096, SCHEDULER)
    np.testing.assert_array_equal(kw["sigmas"], np.linspace(1.0, 1 / 50, 50))
    assert kw["mu"] == pytest.approx(calculate_shift(4096, 256, 8192, 0.5, 0.9))
    assert resolution_shift(256, SCHEDULER) == pytest.approx(0.5)
    assert QWEN.pins_first_step == frozenset({"QwenImagePipeline"})


def params(guidance_scale: float, negative_prompt: str, true_cfg_scale: float = 1.0) -> RequestParams:
    return RequestParams(prompt="a cat", prompt_token_ids=(), seed=0, max_tokens=0, temperature=None, top_p=None,
                         top_k=None, ignore_eos=False, max_codec_frames=0, speaker="", width=64, height=64,
                         num_inference_steps=2, guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                         true_cfg_scale=true_cfg_scale)


def prompt_encoder() -> QwenImagePromptEncoder:
    encoder = QwenImagePromptEncoder.__new__(QwenImagePromptEncoder)  # prompts() reads no model
    encoder.pipe = types.SimpleNamespace(pipeline_class="QwenImagePipeline")
    return encoder


@pytest.mark.parametrize("guidance, negative, rows", [
    (4.0, "blurry", ["blurry", "a cat"]),  # true CFG: [negative prompt, prompt]
    (4.0, "", ["a cat"]),                  # no negative prompt: the pipeline runs no CFG
    (1.0, "", ["a cat"]),                  # true_cfg_scale <= 1: no CFG either
])
def test_a_requests_rows_are_those_qwen_image_pipeline_encodes(guidance, negative, rows):
    assert prompt_encoder().prompts(params(guidance_scale=guidance, negative_prompt=negative)) == rows


@pytest.mark.parametrize("asked, field", [
    (dict(guidance_scale=1.0, negative_prompt="blurry"), "params.image.negative_prompt"),  # it would go unread
    (dict(guidance_scale=4.0, negative_prompt="blurry", true_cfg_scale=3.0), "params.image.true_cfg_scale"),
])
def test_what_qwen_image_pipeline_would_not_read_is_refused_by_name(asked, field):
    with pytest.raises(InvalidRequest) as refused:
        prompt_encoder().prompts(params(**asked))
    assert refused.value.field == field


@pytest.mark.parametrize("tokens, kept", [([5], 64), ([5, 64], 64), ([65, 3], 128), ([512, 9], 512)])
def test_a_requests_rows_are_padded_to_its_longest_prompts_bucket(tokens, kept):
    encoder = QwenImagePromptEncoder.__new__(QwenImagePromptEncoder)
    mask = torch.zeros(len(tokens), QWEN_IMAGE_TEXT_TOKENS, dtype=torch.bool)
    for row, n in enumerate(tokens):
        mask[row, :n] = True
    embeddings = torch.randn(len(tokens), QWEN_IMAGE_TEXT_TOKENS, 8) * mask[..., None]
    rows = encoder.request_rows({"embeddings": embeddings, "embeddings_mask": mask})
    assert kept % QWEN_IMAGE_TOKEN_BUCKET == 0
    assert rows["embeddings"].shape == (len(tokens), kept, 8) and rows["embeddings_mask"].shape == (len(tokens), kept)
    assert torch.equal(rows["embeddings"], embeddings[:, :kept]) and int(rows["embeddings_mask"].sum()) == sum(tokens)


@pytest.mark.parametrize("cfg, why", [
    (PUBLISHED, ""),
    ({**PUBLISHED, "guidance_embeds": True}, "with guidance_embeds (guidance-distilled) is not served"),
    ({**PUBLISHED, "zero_cond_t": True}, "with zero_cond_t (Qwen-Image-Edit-2511) is not served"),
    ({**PUBLISHED, "use_additional_t_cond": True}, "(Qwen-Image-Layered) is not served"),
    ({**PUBLISHED, "use_layer3d_rope": True}, "(Qwen-Image-Layered) is not served"),
    ({**PUBLISHED, "in_channels": 128}, "with in_channels 128, out_channels 16 and patch_size 2 is not served"),
    ({**PUBLISHED, "patch_size": 1}, "with in_channels 64, out_channels 16 and patch_size 1 is not served"),
])
def test_a_transformer_the_loop_would_run_wrongly_is_refused_by_name(cfg, why):
    got = QWEN.unserved({"_class_name": "QwenImagePipeline"}, cfg)
    assert why in got and "is not served" in got if why else got == ""
