"""Adapters the engine runtimes share across families: a causal LM on vLLM or transformers, the omni
Thinker on vLLM, the diffusers text encoder, denoise loops and VAE, and the shape every omni family's
parts take. A family module lists the ones its stages use."""

from __future__ import annotations

from omnistage.families.types import Adapter

MEDIA_INPUTS = frozenset({"text", "image", "audio", "video"})

CAUSAL_LM = Adapter("causal-lm", ("vllm", "transformers"), "ar", "", frozenset({"text", "tokens"}),
                    reads=frozenset({"tokens", "hidden"}))

# The omni Thinkers on vLLM (stage_service/engines/vllm/thinker.py): the same rows out as the transformers
# Thinker; text prompts in, and audio, images and video from an encoder stage.
OMNI_THINKER_VLLM = Adapter("omni-thinker-vllm", ("vllm",), "ar", "thinker",
                            frozenset({"text", "tokens", "hidden"}), reads=frozenset({"media"}))

# Diffusers: `component` is the pipeline's sub-folder. The text-encoder stage also reads the other text
# encoders and tokenizers its pipeline class uses (SD3: text_encoder_2, and text_encoder_3 when present).
TEXT_ENCODER = Adapter("text-encoder", ("diffusers",), "generation", "text_encoder", frozenset({"embeddings"}))
# Image-to-video's reference image (WanImageToVideoPipeline's `image_encoder`, with the VAE's encoder): the
# request's one image -> its CLIP embeddings and the VAE condition channels, beside the text encoder's into the
# denoise loop.
IMAGE_ENCODER = Adapter("image-encoder", ("diffusers",), "encoder", "image_encoder", frozenset({"embeddings"}),
                        inputs=frozenset({"image"}), needs_one=frozenset({"image"}))
# Image editing's image (FluxKontextPipeline: the VAE's encoder): the request's one image -> its latents, which the
# denoise loop takes beside its own.
VAE_ENCODER = Adapter("vae-encoder", ("diffusers",), "encoder", "vae", frozenset({"embeddings"}),
                      inputs=frozenset({"image"}), needs_one=frozenset({"image"}))
# The stages whose output is a reference image's conditioning, beside the text encoder's into the denoise loop.
REFERENCE_IMAGE = frozenset({IMAGE_ENCODER.name, VAE_ENCODER.name})
DENOISER = Adapter("denoiser", ("diffusers",), "diffusion", "unet", frozenset({"latents"}),
                   reads=frozenset({"embeddings"}), needs=frozenset({"embeddings"}))
DIT_DENOISER = Adapter("dit-denoiser", ("diffusers",), "diffusion", "transformer", frozenset({"latents"}),
                       reads=frozenset({"embeddings"}), needs=frozenset({"embeddings"}))
# The VAE stage emits images or video frames: which one is the pipeline's (validation cannot see the checkpoint;
# each family maps this adapter to its own engine, and a video engine refuses a stage that declares images).
VAE_DECODER = Adapter("vae-decoder", ("diffusers",), "generation", "vae", frozenset({"image", "video"}),
                      reads=frozenset({"latents"}), needs=frozenset({"latents"}))


def omni(family: str, decoder: str) -> tuple[Adapter, Adapter, Adapter, Adapter]:
    """An omni family's Thinker, Talker, audio decoder (the `decoder` component) and the Thinker's encoders
    as a stage of their own (`kind: encoder`, opt-in: without one the Thinker runs them inline). Every
    family's parts share (engine, kind, component) and so read and emit the same: validation cannot see
    the checkpoint, the stage registry picks the family by its architecture."""
    return (Adapter(f"{family}-thinker", ("transformers",), "ar", "thinker", frozenset({"text", "tokens", "hidden"}),
                    reads=frozenset({"media"}), inputs=MEDIA_INPUTS),
            Adapter(f"{family}-talker", ("transformers",), "ar", "talker", frozenset({"codes"}),
                    reads=frozenset({"hidden"}), needs=frozenset({"hidden"}), initial_chunk=True),
            Adapter(f"{family}-{decoder}", ("transformers",), "generation", decoder, frozenset({"audio"}),
                    reads=frozenset({"codes"}), needs=frozenset({"codes"})),
            Adapter(f"{family}-encoder", ("transformers",), "encoder", "encoder", frozenset({"media"}),
                    inputs=MEDIA_INPUTS))
