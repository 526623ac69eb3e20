"""FLUX.1 Kontext's declarations and its editing input, read without loading a model: the family and its stages,
the Kontext resolution an image is resized to (FluxKontextPipeline's choice), and the reference image's tokens and
positions after the noise's."""

from __future__ import annotations

import pytest
import torch

from omnistage.api import accepted_inputs, one_of_each_input
from omnistage.checkpoints.components import allowed
from omnistage.families import family_of
from stage_service.engines.diffusers.denoisers import DENOISERS
from stage_service.engines.diffusers.layout import PipelineDir
from stage_service.engines.diffusers.reference_latents import preferred_size
from stage_service.engines.diffusers.text import PROMPT_ENCODERS, FluxPromptEncoder

from ..harness import example

MODEL = "flux-kontext-tiny"
FLUX = DENOISERS["FluxTransformer2DModel"]
DEV = {"in_channels": 64, "out_channels": None, "guidance_embeds": True}


def test_a_kontext_pipeline_is_the_flux_kontext_family_its_image_read_by_the_vaes_encoder(model_dir):
    family = family_of("FluxKontextPipeline")
    assert family is not None and family.name == "flux_kontext"
    assert family.components == ("text_encoder", "transformer", "vae")
    assert PROMPT_ENCODERS["FluxKontextPipeline"] is FluxPromptEncoder
    assert "FluxKontextPipeline" in FLUX.reference_tokens and "FluxKontextPipeline" in FLUX.pins_first_step
    pipe = PipelineDir(model_dir / MODEL / "transformer")
    assert pipe.pipeline_class == "FluxKontextPipeline"
    assert not pipe.has("image_encoder") and not pipe.has("feature_extractor")  # IP-Adapter's: null, as published
    for component in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "transformer", "vae",
                      "scheduler"):
        assert allowed(*pipe.index[component]), component
    pipeline = example(MODEL)
    assert accepted_inputs(pipeline) == {"text", "image"}
    assert one_of_each_input(pipeline) == {"image": "image-encoder"}


@pytest.mark.parametrize("width, height", [(56, 40), (40, 56), (1024, 1024), (1920, 1080), (300, 2000), (17, 16),
                                           (2048, 512), (4000, 3000)])
def test_an_image_is_resized_to_the_kontext_resolution_flux_kontext_pipeline_picks(width, height):
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
    from PIL import Image

    # FluxKontextPipeline.__call__'s own steps, on its own image processor
    processor = VaeImageProcessor(vae_scale_factor=16)
    h, w = processor.get_default_height_width(Image.new("RGB", (width, height)))
    _, want_w, want_h = min((abs(w / h - pw / ph), pw, ph) for pw, ph in PREFERRED_KONTEXT_RESOLUTIONS)
    assert preferred_size(width, height, 16, PREFERRED_KONTEXT_RESOLUTIONS) == (want_w // 16 * 16, want_h // 16 * 16)


def test_an_image_below_one_patch_is_refused_by_name():
    from omnistage.contract.params import InvalidRequest

    with pytest.raises(InvalidRequest, match="params.parts: the image to edit must be at least 16 x 16 pixels"):
        preferred_size(64, 15, 16, [(1024, 1024)])


def test_the_reference_tokens_follow_the_noises_with_their_positions_as_flux_kontext_pipeline_numbers_them():
    from diffusers import FluxKontextPipeline

    x, reference = torch.randn(2, 16, 6, 4), torch.randn(2, 16, 4, 8)
    text = {"encoder_hidden_states": torch.zeros(2, 9, 8)}
    forward = {"hidden_states": FLUX.pack(x, DEV), **FLUX.extra(x, text, torch.tensor([3.5, 3.5]), DEV)}
    assert FLUX.with_reference is not None
    edited = FLUX.with_reference(forward, reference, DEV)
    assert torch.equal(edited["hidden_states"], torch.cat([FluxKontextPipeline._pack_latents(x, 2, 16, 6, 4),
                                                           FluxKontextPipeline._pack_latents(reference, 2, 16, 4, 8)],
                                                          dim=1))
    image_ids = FluxKontextPipeline._prepare_latent_image_ids(2, 2, 4, "cpu", torch.float32)
    image_ids[..., 0] = 1  # as the pipeline marks its image's
    want = torch.cat([FluxKontextPipeline._prepare_latent_image_ids(2, 3, 2, "cpu", torch.float32), image_ids])
    assert torch.equal(edited["img_ids"], want)
    assert torch.equal(forward["img_ids"], want[:6])  # the forward arguments it was given are unchanged
