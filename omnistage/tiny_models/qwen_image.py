"""A tiny Qwen-Image (QwenImagePipeline): the Qwen2.5-VL text encoder (its last hidden states), a
QwenImageTransformer2DModel over packed 2x2 latent patches, the Qwen-Image VAE (a Wan-style causal 3-D VAE decoding
one frame, its latents normalized by `latents_mean` / `latents_std`), flow matching shifted by image size.

Saved as `QwenImagePipeline.save_pretrained` writes Qwen/Qwen-Image: `model_index.json` and one sub-folder per
component (`scheduler`, `text_encoder`, `tokenizer`, `transformer`, `vae`), the text encoder and the transformer
sharded with an index.
The tokenizer is a Qwen2 tokenizer with Qwen2.5-VL's added tokens at their ids, trained so that the pipeline's
prompt template prefix is its 34 tokens, as with the published vocabulary (QwenImagePipeline drops exactly those:
`prompt_template_encode_start_idx`). Configs as published at toy widths: the text encoder's Qwen2.5-VL ids and
multimodal RoPE, the VAE's latents mean and std, the scheduler's exponential dynamic shifting.
"""

from __future__ import annotations

from pathlib import Path

from omnistage.tiny_models.diffusion import save_sharded
from omnistage.tiny_models.qwen3_omni import QWEN3_ADDED_TOKENS

HIDDEN = 32           # the text encoder's width: the transformer's joint_attention_dim
LATENT_CHANNELS = 16  # the Qwen-Image VAE's z_dim; the transformer takes them packed 2x2: 64 channels a token
VOCAB = 152064        # the text encoder's embedding rows, as published (more than the tokenizer's ids)
REGULAR_IDS = 151643  # byte-level BPE ids; the added tokens follow
# Qwen2.5-VL's added tokens (Qwen3 adds four more after them), by id.
ADDED_TOKENS = {REGULAR_IDS + i: t for i, t in enumerate(QWEN3_ADDED_TOKENS[:22])}
NOT_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                         "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"})
ROLE_WORDS = {872: "user", 77091: "assistant", 8948: "system"}  # plain vocabulary words at their Qwen2 ids
TOKEN_IDS = {t: i for i, t in ADDED_TOKENS.items()}
# QwenImagePipeline's prompt template's system text: the tokenizer learns each of its words as one token.
TEMPLATE_SYSTEM = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
                   "relationships of the objects and background:")
TEMPLATE_PREFIX_TOKENS = 34  # QwenImagePipeline.prompt_template_encode_start_idx
# Qwen/Qwen-Image's scheduler_config.json.
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                 base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
                 invert_sigmas=False, stochastic_sampling=False)


def tokenizer():
    from omnistage.tiny_models.tokenizers_local import qwen_tokenizer

    return qwen_tokenizer(REGULAR_IDS, ROLE_WORDS, ADDED_TOKENS, NOT_SPECIAL, texts=(TEMPLATE_SYSTEM,),
                          eos_token="<|im_end|>", pad_token="<|endoftext|>")


def text_encoder_config():
    from transformers import Qwen2_5_VLConfig

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}  # head_dim 16: 2+3+3 = 16/2
    text = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128000, rope_parameters=rope,
                bos_token_id=TOKEN_IDS["<|endoftext|>"], eos_token_id=TOKEN_IDS["<|im_end|>"])
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=HIDDEN,
                  fullatt_block_indexes=[0])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=TOKEN_IDS["<|image_pad|>"],
                            video_token_id=TOKEN_IDS["<|video_pad|>"],
                            vision_start_token_id=TOKEN_IDS["<|vision_start|>"],
                            vision_end_token_id=TOKEN_IDS["<|vision_end|>"])


def build(out: Path, seed: int = 0) -> None:
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLForConditionalGeneration

    from omnistage.tiny_models.tokenizers_local import save_qwen_tokenizer

    torch.manual_seed(seed)
    tok = tokenizer()
    prefix = tok("<|im_start|>system\n" + TEMPLATE_SYSTEM + "<|im_end|>\n<|im_start|>user\n").input_ids
    if len(prefix) != TEMPLATE_PREFIX_TOKENS:
        raise RuntimeError(f"the prompt template's prefix is {len(prefix)} tokens, not QwenImagePipeline's "
                           f"{TEMPLATE_PREFIX_TOKENS}")
    text_encoder = Qwen2_5_VLForConditionalGeneration(text_encoder_config())
    # Three dual-stream blocks (60 published); a head is 16 wide, its rotary axes (frame, height, width) 4 + 6 + 6.
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * LATENT_CHANNELS,
                                              out_channels=LATENT_CHANNELS, num_layers=3, attention_head_dim=16,
                                              num_attention_heads=2, joint_attention_dim=HIDDEN,
                                              guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    # The published VAE's layout (8x: three downsamplings, the last two in time too) at a toy width, its
    # latents_mean / latents_std the class's defaults, as published.
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 attn_scales=[], temperal_downsample=[False, True, True])
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae,
                             text_encoder=text_encoder, tokenizer=tok, transformer=transformer)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    save_qwen_tokenizer(tok, out / "tokenizer")
    save_sharded(transformer, out / "transformer")
    # The text encoder in shards with their index too, as published.
    (out / "text_encoder" / "model.safetensors").unlink()
    total = sum(t.nbytes for t in text_encoder.state_dict().values())
    text_encoder.save_pretrained(out / "text_encoder", max_shard_size=total // 2 + 1)
