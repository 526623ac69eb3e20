"""Stable Diffusion 3 / 3.5 (StableDiffusion3Pipeline, diffusers layout): CLIP-L, CLIP-G and, where
published, T5 text encoders -> the MMDiT denoise loop -> VAE decode."""

from __future__ import annotations

from omnistage.families import Family, PipelinePart, register
from omnistage.families.adapters import DIT_DENOISER, TEXT_ENCODER, VAE_DECODER


def engines():
    from stage_service.engines.diffusers import engines as e

    return {("diffusers", TEXT_ENCODER): e.TextEncoderEngine, ("diffusers", DIT_DENOISER): e.DenoiseEngine,
            ("diffusers", VAE_DECODER): e.VaeDecodeEngine}


FAMILY = register(Family("sd3", ("StableDiffusion3Pipeline",), (TEXT_ENCODER, DIT_DENOISER, VAE_DECODER), engines,
                         pipeline={"text_encoder": PipelinePart(("text_encoder", "text_encoder_2", "text_encoder_3?"),
                                                                ("tokenizer", "tokenizer_2", "tokenizer_3?",
                                                                 "transformer")),
                                   "transformer": PipelinePart(("transformer",), ("scheduler", "vae")),
                                   "vae": PipelinePart(("vae",))},
                         default_inference_steps=28,  # the pipeline class's own defaults
                         default_guidance_scale=7.0))
