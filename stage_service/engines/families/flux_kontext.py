"""FLUX.1 Kontext image editing (FluxKontextPipeline, diffusers layout: black-forest-labs/FLUX.1-Kontext-dev): the
CLIP and T5 text encoders and the image to edit through the VAE's encoder (a stage of its own: its latents, once per
request) -> the FLUX transformer's denoise loop, the image's latent tokens after the noise's at every step (FLUX.1-
dev's distilled guidance an input of the model) -> VAE decode."""

from __future__ import annotations

from omnistage.families import Family, PipelinePart, register
from omnistage.families.adapters import DIT_DENOISER, TEXT_ENCODER, VAE_DECODER, VAE_ENCODER


def engines():
    from stage_service.engines.diffusers import engines as e
    from stage_service.engines.diffusers.reference_latents import ReferenceLatentsEngine

    return {("diffusers", TEXT_ENCODER): e.TextEncoderEngine, ("diffusers", VAE_ENCODER): ReferenceLatentsEngine,
            ("diffusers", DIT_DENOISER): e.DenoiseEngine, ("diffusers", VAE_DECODER): e.VaeDecodeEngine}


FAMILY = register(Family("flux_kontext", ("FluxKontextPipeline",),
                         (TEXT_ENCODER, VAE_ENCODER, DIT_DENOISER, VAE_DECODER), engines,
                         pipeline={"text_encoder": PipelinePart(("text_encoder", "text_encoder_2"),
                                                                ("tokenizer", "tokenizer_2")),
                                   "transformer": PipelinePart(("transformer",), ("scheduler", "vae")),
                                   # the encoder stage reads the VAE's encoder, the decode stage its decoder
                                   "vae": PipelinePart(("vae",))},
                         # the pipeline class's own defaults: steps, guidance, its 1024 x 1024 (as FluxPipeline's)
                         default_inference_steps=28, default_guidance_scale=3.5, default_size=(1024, 1024)))
