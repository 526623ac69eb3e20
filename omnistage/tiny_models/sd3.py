"""A tiny Stable-Diffusion-3-style pipeline: two CLIP text encoders, an SD3 DiT, a 16-channel VAE, flow matching.

Saved as `StableDiffusion3Pipeline.save_pretrained` writes stabilityai/stable-diffusion-3-medium-diffusers:
`model_index.json` and one sub-folder per component, the transformer sharded with an index. The T5
encoder (`text_encoder_3`, `tokenizer_3`) is left out, as diffusers allows: `model_index.json` lists it
as null and the text stage pads with zeros in its place, as StableDiffusion3Pipeline does.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.tiny_models.diffusion import save_sharded
from omnistage.tiny_models.tokenizers_local import CORPUS

# CLIP's own pre-tokenizer split (transformers' CLIPTokenizer uses the same): special tokens, contractions,
# letter runs, single digits, other symbol runs.
_CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
MAX_TOKENS = 77

# Widths: the two CLIP hidden sizes side by side (32 + 48) are padded up to the DiT's joint attention
# width, as SD3's 768 + 1280 are padded to T5's 4096; their projections side by side are the pooled width.
CLIP_L, CLIP_G = 32, 48
JOINT_ATTENTION_DIM = 96
LATENT_CHANNELS = 16


def clip_tokenizer(pad_token: str = EOS, vocab_size: int = 700):
    """A CLIPTokenizer (byte-level BPE with `</w>` word ends, lower-cased) trained on the local corpus.

    Every byte's word-end form (`a</w>`) is placed before training, as CLIP's vocabulary has them all:
    the trainer would otherwise number them in hash order, and ties between merges (broken by id)
    would make each build a different tokenizer."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, *(c + "</w>" for c in alphabet)],
                                  end_of_word_suffix="</w>", initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    model = json.loads(tok.to_str())["model"]
    return CLIPTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], pad_token=pad_token,
                         model_max_length=MAX_TOKENS)


def build(out: Path, seed: int = 0) -> None:
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    # As upstream: CLIP-L pads with its end token, CLIP-G (tokenizer_2) with "!".
    tokenizer, tokenizer_2 = clip_tokenizer(), clip_tokenizer(pad_token="!")

    def clip(hidden: int, tok) -> CLIPTextModelWithProjection:
        cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=MAX_TOKENS,
                             projection_dim=hidden, hidden_act="gelu", bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        return CLIPTextModelWithProjection(cfg)

    transformer = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=LATENT_CHANNELS, num_layers=2,
                                        attention_head_dim=8, num_attention_heads=4,
                                        joint_attention_dim=JOINT_ATTENTION_DIM, caption_projection_dim=32,
                                        pooled_projection_dim=CLIP_L + CLIP_G, out_channels=LATENT_CHANNELS,
                                        pos_embed_max_size=64)
    # SD3's VAE: 16 latent channels, no quant convs, its own shift and scale of the latents.
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        latent_channels=LATENT_CHANNELS, norm_num_groups=8, sample_size=64, shift_factor=0.0609,
                        scaling_factor=1.5305, use_quant_conv=False, use_post_quant_conv=False)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae, text_encoder=clip(CLIP_L, tokenizer), tokenizer=tokenizer,
        text_encoder_2=clip(CLIP_G, tokenizer_2), tokenizer_2=tokenizer_2, text_encoder_3=None, tokenizer_3=None)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    save_sharded(transformer, out / "transformer")
