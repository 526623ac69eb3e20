"""Stable Diffusion (StableDiffusionPipeline, diffusers layout): CLIP text encoder -> UNet denoise loop ->
VAE decode, each a stage reading its own sub-folder."""

from __future__ import annotations

from omnistage.families import Family, PipelinePart, register
from omnistage.families.adapters import DENOISER, TEXT_ENCODER, VAE_DECODER


def engines():
    from stage_service.engines.diffusers import engines as e

    return {("diffusers", TEXT_ENCODER): e.TextEncoderEngine, ("diffusers", DENOISER): e.DenoiseEngine,
            ("diffusers", VAE_DECODER): e.VaeDecodeEngine}


FAMILY = register(Family("sd", ("StableDiffusionPipeline",), (TEXT_ENCODER, DENOISER, VAE_DECODER), engines,
                         pipeline={"text_encoder": PipelinePart(("text_encoder",), ("tokenizer",)),
                                   "unet": PipelinePart(("unet",), ("scheduler", "vae")),
                                   "vae": PipelinePart(("vae",))},
                         default_inference_steps=50,  # the pipeline class's own defaults
                         default_guidance_scale=7.5))
