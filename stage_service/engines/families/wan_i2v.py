"""Wan 2.1 image-to-video (WanImageToVideoPipeline, diffusers layout): the UMT5 text encoder and the reference image's
stage (CLIP vision encoder + the VAE's encoder: image embeddings and condition channels) -> the Wan video DiT's
denoise loop over 5-D latents with the condition beside them -> the causal video VAE, decoded latent frame by
latent frame into video frames."""

from __future__ import annotations

from omnistage.families import Family, PipelinePart, register
from omnistage.families.adapters import DIT_DENOISER, IMAGE_ENCODER, TEXT_ENCODER, VAE_DECODER


def engines():
    from stage_service.engines.diffusers import engines as e
    from stage_service.engines.diffusers.image_condition import ImageConditionEngine
    from stage_service.engines.diffusers.video_vae import VideoVaeDecodeEngine

    return {("diffusers", TEXT_ENCODER): e.TextEncoderEngine, ("diffusers", IMAGE_ENCODER): ImageConditionEngine,
            ("diffusers", DIT_DENOISER): e.DenoiseEngine, ("diffusers", VAE_DECODER): VideoVaeDecodeEngine}


FAMILY = register(Family("wan_i2v", ("WanImageToVideoPipeline",),
                         (TEXT_ENCODER, IMAGE_ENCODER, DIT_DENOISER, VAE_DECODER), engines,
                         pipeline={"text_encoder": PipelinePart(("text_encoder",), ("tokenizer",)),
                                   "image_encoder": PipelinePart(("image_encoder", "vae"),
                                                                 ("image_processor", "transformer")),
                                   "transformer": PipelinePart(("transformer",), ("scheduler", "vae")),
                                   "vae": PipelinePart(("vae",))},
                         # the pipeline class's own defaults: steps, guidance, (width, height)
                         default_inference_steps=50, default_guidance_scale=5.0, default_size=(832, 480)))
