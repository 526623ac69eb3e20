"""FLUX.1 text-to-image (FluxPipeline, diffusers layout: FLUX.1-dev, FLUX.1-schnell): the CLIP and T5 text encoders
-> the FLUX transformer's denoise loop over packed 2x2 latent patches (FLUX.1-dev's distilled guidance an input of
the model, one row per image) -> VAE decode."""

from __future__ import annotations

from omnistage.families import Family, PipelinePart, register
from omnistage.families.adapters import DIT_DENOISER, TEXT_ENCODER, VAE_DECODER


def engines():
    from stage_service.engines.diffusers import engines as e

    return {("diffusers", TEXT_ENCODER): e.TextEncoderEngine, ("diffusers", DIT_DENOISER): e.DenoiseEngine,
            ("diffusers", VAE_DECODER): e.VaeDecodeEngine}


FAMILY = register(Family("flux", ("FluxPipeline",), (TEXT_ENCODER, DIT_DENOISER, VAE_DECODER), engines,
                         pipeline={"text_encoder": PipelinePart(("text_encoder", "text_encoder_2"),
                                                                ("tokenizer", "tokenizer_2")),
                                   "transformer": PipelinePart(("transformer",), ("scheduler", "vae")),
                                   "vae": PipelinePart(("vae",))},
                         # the pipeline class's own defaults: steps, guidance, and its 1024 x 1024 (its
                         # default_sample_size 128 x the VAE's 8; the transformer's config has no sample_size)
                         default_inference_steps=28, default_guidance_scale=3.5, default_size=(1024, 1024)))
