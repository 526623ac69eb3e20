"""Qwen-Image text-to-image (QwenImagePipeline, diffusers layout: Qwen/Qwen-Image): the Qwen2.5-VL text encoder ->
the Qwen-Image transformer's denoise loop over packed 2x2 latent patches (true CFG over [negative prompt, prompt]
rows, rescaled as the pipeline does) -> its one-frame causal VAE, decoded to a PNG."""

from __future__ import annotations

from omnistage.families import Family, PipelinePart, register
from omnistage.families.adapters import DIT_DENOISER, TEXT_ENCODER, VAE_DECODER


def engines():
    from stage_service.engines.diffusers import engines as e

    return {("diffusers", TEXT_ENCODER): e.TextEncoderEngine, ("diffusers", DIT_DENOISER): e.DenoiseEngine,
            ("diffusers", VAE_DECODER): e.VaeDecodeEngine}


FAMILY = register(Family("qwen_image", ("QwenImagePipeline",), (TEXT_ENCODER, DIT_DENOISER, VAE_DECODER), engines,
                         pipeline={"text_encoder": PipelinePart(("text_encoder",), ("tokenizer",)),
                                   "transformer": PipelinePart(("transformer",), ("scheduler", "vae")),
                                   "vae": PipelinePart(("vae",))},
                         # the pipeline class's own defaults: steps, true_cfg_scale, and its 1024 x 1024 (its
                         # default_sample_size 128 x the VAE's 8)
                         default_inference_steps=50, default_guidance_scale=4.0, default_size=(1024, 1024)))
