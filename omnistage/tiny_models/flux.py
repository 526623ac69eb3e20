"""A tiny FLUX.1-dev pipeline: a CLIP text encoder (pooled output), a T5 encoder, a FLUX transformer with the
guidance embedding, a 16-channel VAE, flow matching shifted by image size.

Saved as `FluxPipeline.save_pretrained` writes black-forest-labs/FLUX.1-dev: `model_index.json` and one sub-folder
per component (`scheduler`, `text_encoder`, `text_encoder_2`, `tokenizer`, `tokenizer_2`, `transformer`, `vae`), the
transformer sharded with an index. The CLIP tokenizer is the one the SD3 tiny model trains; the T5 tokenizer a
Unigram one with T5's special tokens (`<pad>` 0, `</s>` 1, `<unk>` 2). Configs as published at toy widths: the
VAE's `scaling_factor` and `shift_factor`, no quant convs; the scheduler's dynamic shifting.

FLUX.1 Kontext (black-forest-labs/FLUX.1-Kontext-dev) publishes the same components under `FluxKontextPipeline`,
the image to edit taken as latent tokens beside the noise's: `build_kontext` saves these toy weights in its layout.
"""

from __future__ import annotations

from pathlib import Path

from omnistage.tiny_models.diffusion import save_sharded
from omnistage.tiny_models.sd3 import MAX_TOKENS, clip_tokenizer
from omnistage.tiny_models.tokenizers_local import t5_tokenizer

T5_SPECIALS = ["<pad>", "</s>", "<unk>"]  # google/t5-v1_1-xxl's ids, FLUX.1's tokenizer_2
CLIP_WIDTH = 32       # the CLIP's hidden size: the transformer's pooled_projection_dim
T5_WIDTH = 32         # the T5's d_model: the transformer's joint_attention_dim
LATENT_CHANNELS = 16  # FLUX.1's VAE; the transformer takes them packed 2x2: 64 channels a token
# FLUX.1-dev's scheduler_config.json.
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096)


def build(out: Path, seed: int = 0) -> None:
    from diffusers import FluxPipeline

    _save(FluxPipeline(**_components(seed)), out)


def build_kontext(out: Path, seed: int = 0) -> None:
    """black-forest-labs/FLUX.1-Kontext-dev's layout: FLUX.1-dev's components (the same toy weights), the pipeline
    class FluxKontextPipeline; its IP-Adapter parts (`image_encoder`, `feature_extractor`) null, as published."""
    from diffusers import FluxKontextPipeline

    _save(FluxKontextPipeline(**_components(seed), image_encoder=None, feature_extractor=None), out)


def _save(pipe, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    save_sharded(pipe.transformer, out / "transformer")


def _components(seed: int) -> dict:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer(T5_SPECIALS)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=CLIP_WIDTH, intermediate_size=2 * CLIP_WIDTH, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=MAX_TOKENS, projection_dim=CLIP_WIDTH, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    # FLUX.1's T5 v1.1: a gated GELU feed-forward.
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=T5_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1))
    # Two dual-stream and two single-stream blocks (19 and 38 published); a head is 16 wide, its rotary axes
    # (time, height, width) 4 + 6 + 6 of it. Widths multiples of 16, as the published ones are (see wan.py).
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=2,
                                         num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                                         joint_attention_dim=T5_WIDTH, pooled_projection_dim=CLIP_WIDTH,
                                         guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    # FLUX.1's VAE: 8x (four blocks), 16 latent channels, no quant convs, its own scale and shift of the latents.
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32, 32, 32),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        latent_channels=LATENT_CHANNELS, norm_num_groups=8, sample_size=64, scaling_factor=0.3611,
                        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=text_encoder,
                tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
