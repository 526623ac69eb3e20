"""The FLUX.1 family's declarations and its denoiser entry, read without loading a model: the family table, the
classes its checkpoint names, the limits taken from FluxPipeline's own defaults, FluxPipeline's packing, positions,
guidance and schedule, and the transformers it refuses."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from omnistage.api import accepted_inputs
from omnistage.checkpoints.components import allowed
from omnistage.checkpoints.defaults import with_model_limits
from omnistage.families import family_of
from stage_service.engines.diffusers.denoisers import DENOISERS, flux_schedule, resolution_shift
from stage_service.engines.diffusers.engines import vae_scales
from stage_service.engines.diffusers.layout import PipelineDir
from stage_service.engines.diffusers.text import PROMPT_ENCODERS, FluxPromptEncoder

from ..harness import example

MODEL = "flux-tiny"
FLUX = DENOISERS["FluxTransformer2DModel"]
DEV = {"in_channels": 64, "out_channels": None, "guidance_embeds": True, "joint_attention_dim": 4096,
       "pooled_projection_dim": 768, "patch_size": 1}  # FLUX.1-dev's transformer config, in part


def test_a_flux_pipeline_is_the_flux_family_and_its_classes_load_without_remote_code(model_dir):
    family = family_of("FluxPipeline")
    assert family is not None and family.name == "flux"
    assert family.components == ("text_encoder", "transformer", "vae")
    assert family.pipeline["text_encoder"].weights == ("text_encoder", "text_encoder_2")
    assert PROMPT_ENCODERS["FluxPipeline"] is FluxPromptEncoder
    pipe = PipelineDir(model_dir / MODEL / "transformer")
    assert pipe.pipeline_class == "FluxPipeline"
    for component in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "transformer", "vae",
                      "scheduler"):
        assert allowed(*pipe.index[component]), component
    assert vae_scales(pipe) == (8, 1)  # as published: four VAE blocks


def test_limits_left_open_take_flux_pipelines_defaults(model_dir):
    pipeline = example(MODEL)
    open_limits = dataclasses.replace(pipeline, limits=dataclasses.replace(
        pipeline.limits, default_image_side=0, default_inference_steps=0, max_image_side=1024))
    filled, notes = with_model_limits(open_limits, model_dir)
    limits = filled.limits
    assert (limits.default_inference_steps, limits.default_guidance_scale) == (28, 3.5)
    assert (limits.default_width, limits.default_height) == (1024, 1024)  # FluxPipeline's 128 x its VAE's 8
    assert not any("cannot read" in n for n in notes)
    assert accepted_inputs(pipeline) == {"text"}


def test_latents_are_packed_2x2_as_flux_pipeline_packs_them():
    from diffusers import FluxPipeline

    x = torch.randn(2, 16, 6, 4)
    packed = FLUX.pack(x, DEV)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 16, 6, 4)) and packed.shape == (2, 6, 64)
    assert torch.equal(FLUX.unpack(packed, x.shape, DEV), x)
    assert FLUX.latent_channels(DEV) == 16 and FLUX.patch(DEV) == 2 and not FLUX.guidance_rows


@pytest.mark.parametrize("guidance_embeds", [True, False], ids=["dev", "schnell"])
def test_positions_are_flux_pipelines_and_only_a_guidance_embedding_takes_the_guidance(guidance_embeds):
    from diffusers import FluxPipeline

    text = {"encoder_hidden_states": torch.zeros(2, 9, 8)}
    extra = FLUX.extra(torch.zeros(2, 16, 6, 4), text, torch.tensor([3.5, 1.0]),
                       {**DEV, "guidance_embeds": guidance_embeds})
    assert torch.equal(extra["img_ids"], FluxPipeline._prepare_latent_image_ids(2, 3, 2, "cpu", torch.float32))
    assert torch.equal(extra["txt_ids"], torch.zeros(9, 3))
    if guidance_embeds:
        assert torch.equal(extra["guidance"], torch.tensor([3.5, 1.0]))
    else:
        assert "guidance" not in extra


def test_the_schedule_is_flux_pipelines_sigmas_shifted_by_the_image_size():
    cfg = {"use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5,
           "max_shift": 1.15}
    kw = flux_schedule(4, 4096, cfg)
    np.testing.assert_array_equal(kw["sigmas"], np.linspace(1.0, 0.25, 4))
    assert kw["mu"] == pytest.approx(1.15) and resolution_shift(256, cfg) == pytest.approx(0.5)
    assert flux_schedule(4, 256, {**cfg, "use_flow_sigmas": True})["sigmas"] is None  # the scheduler's own


@pytest.mark.parametrize("cfg, why", [
    (DEV, ""),
    ({**DEV, "guidance_embeds": False}, ""),  # FLUX.1-schnell
    ({**DEV, "in_channels": 384, "out_channels": 64}, "in_channels 384 and out_channels 64 (FLUX.1 Fill"),
    ({**DEV, "in_channels": 128, "out_channels": 64}, "in_channels 128 and out_channels 64"),  # Depth, Canny
])
def test_a_transformer_taking_more_than_its_latents_is_refused_by_name(cfg, why):
    got = FLUX.unserved({"_class_name": "FluxPipeline"}, cfg)
    assert (why in got and "is not served" in got) if why else got == ""


@pytest.mark.parametrize("encoder, ask, rows, refused", [
    (FluxPromptEncoder, dict(), ["a cat"], ""),
    (FluxPromptEncoder, dict(negative_prompt="dark", true_cfg_scale=4.0), ["dark", "a cat"], ""),
    (FluxPromptEncoder, dict(negative_prompt="dark", true_cfg_scale=1.0), None, "params.image.negative_prompt"),
    (FluxPromptEncoder, dict(negative_prompt="dark"), None, "params.image.negative_prompt"),
    (FluxPromptEncoder, dict(true_cfg_scale=4.0), None, "params.image.true_cfg_scale"),
    (PROMPT_ENCODERS["StableDiffusion3Pipeline"], dict(negative_prompt="dark", guidance_scale=5.0), ["dark", "a cat"],
     ""),
    (PROMPT_ENCODERS["StableDiffusion3Pipeline"], dict(negative_prompt="dark", true_cfg_scale=4.0), None,
     "params.image.true_cfg_scale"),
], ids=["plain", "true-cfg", "scale-1", "negative-alone", "scale-alone", "sd3", "sd3-true-cfg"])
def test_true_cfg_rows_are_flux_pipelines_and_other_classes_refuse_the_scale(encoder, ask, rows, refused):
    """FluxPipeline's true classifier-free guidance: [negative, prompt] rows only with a negative prompt and
    true_cfg_scale above 1; a class whose guidance scale is classifier-free guidance already refuses the scale."""
    from omnistage.contract.params import InvalidRequest, resolve
    from omnistage.contract.request import build_request

    limits = example(MODEL).limits
    params = resolve(build_request("a cat", **ask).params, limits)
    prompts = encoder.__new__(encoder)  # its rows need no model loaded
    prompts.pipe = type("Index", (), {"pipeline_class": encoder.__name__})()
    if refused:
        with pytest.raises(InvalidRequest) as e:
            prompts.prompts(params)
        assert e.value.field == refused
    else:
        assert prompts.prompts(params) == rows
