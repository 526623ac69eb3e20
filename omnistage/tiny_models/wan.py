"""Tiny Wan2.1 pipelines: text-to-video (a UMT5 text encoder, a Wan video DiT, Wan's causal 3-D VAE, UniPC) and
image-to-video (the same, plus a CLIP vision encoder and its image processor, the DiT taking the reference image's
condition channels and embeddings).

Saved as `WanPipeline.save_pretrained` writes Wan-AI/Wan2.1-T2V-1.3B-Diffusers (and
`WanImageToVideoPipeline.save_pretrained` Wan-AI/Wan2.1-I2V-14B-480P-Diffusers): `model_index.json` and one
sub-folder per component (`transformer_2` listed as null, as a Wan2.1 pipeline has no second expert). The
tokenizer is a T5 (sentencepiece-style Unigram) tokenizer trained on the local corpus with UMT5's special
tokens (`<pad>` 0, `</s>` 1, `<s>` 2, `<unk>` 3); the scheduler is configured as the published one.
"""

from __future__ import annotations

from pathlib import Path

from omnistage.tiny_models.tokenizers_local import t5_tokenizer

# UMT5's special tokens at UMT5's ids (google/umt5-xxl, the Wan text encoder's tokenizer).
SPECIALS = ["<pad>", "</s>", "<s>", "<unk>"]
TEXT_WIDTH = 32       # the UMT5 encoder's d_model: the DiT's `text_dim`
LATENT_CHANNELS = 16  # Wan2.1's VAE z_dim
# The published 1.3B scheduler: UniPC over flow-matching sigmas, shifted by 3.0 (the 480P setting).
SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0)


def umt5_tokenizer(vocab_size: int = 300):
    """A transformers T5Tokenizer (Unigram, Metaspace pre-tokenizer) with UMT5's special tokens."""
    return t5_tokenizer(SPECIALS, vocab_size)


def _parts(seed: int, **image):
    """tokenizer, UMT5 text encoder, the Wan DiT, the video VAE and the scheduler, built in this order from `seed`;
    `image`: the DiT's image-to-video settings (condition channels in, the image embedding's width)."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = umt5_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0))
    # attention_head_dim 16: Wan's 3-D rotary embedding splits a head into time, height and width parts (8, 4, 4).
    # Widths are multiples of 16 (as the published ones are): a CPU kernel vectorizes such rows whole whatever
    # the batch, where a ragged tail is rounded otherwise and batching would change a video (last bits).
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                        in_channels=image.get("in_channels", LATENT_CHANNELS),
                                        out_channels=LATENT_CHANNELS, text_dim=TEXT_WIDTH, freq_dim=32, ffn_dim=64,
                                        num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                        eps=1e-6, rope_max_seq_len=64, image_dim=image.get("image_dim"),
                                        added_kv_proj_dim=image.get("added_kv_proj_dim"))
    # Wan's VAE shape: 8x spatial (three downsamples), 4x temporal (the last two), causal, 16 latent channels.
    vae = AutoencoderKLWan(base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    return dict(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                scheduler=UniPCMultistepScheduler(**SCHEDULER))


def build(out: Path, seed: int = 0) -> None:
    from diffusers import WanPipeline

    pipe = WanPipeline(**_parts(seed))
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)


# The image-to-video parts. Wan2.1-I2V's DiT takes 36 channels (16 of noise, 4 of the first-frame mask, 16 of the
# reference's latents) and the CLIP ViT-H/14 penultimate hidden states (1280 wide) through its own key/value
# projections (`added_kv_proj_dim`: the attention's inner width). The tiny CLIP sees 32 x 32 pixels in 8 x 8 patches.
IMAGE_WIDTH, IMAGE_SIDE, IMAGE_PATCH = 32, 32, 8
ATTENTION_WIDTH = 2 * 16  # the DiT's heads x head width
MASK_CHANNELS = 4  # the VAE's temporal compression: the first frame's mask repeated over a latent frame's frames
# OpenAI CLIP's pixel statistics, as the published image processor has them.
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def build_i2v(out: Path, seed: int = 0) -> None:
    import torch
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    parts = _parts(seed, in_channels=LATENT_CHANNELS * 2 + MASK_CHANNELS, image_dim=IMAGE_WIDTH,
                   added_kv_proj_dim=ATTENTION_WIDTH)
    torch.manual_seed(seed + 1)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=IMAGE_WIDTH, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        image_size=IMAGE_SIDE, patch_size=IMAGE_PATCH, projection_dim=IMAGE_WIDTH, hidden_act="gelu"))
    # The published processor: resize the short side, centre-crop a square, bicubic, OpenAI's statistics.
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIDE},
                                         crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE},
                                         do_resize=True, do_center_crop=True, resample=3, do_rescale=True,
                                         rescale_factor=1 / 255, do_normalize=True, image_mean=CLIP_MEAN,
                                         image_std=CLIP_STD, do_convert_rgb=True)
    pipe = WanImageToVideoPipeline(image_encoder=image_encoder, image_processor=image_processor, **parts)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
