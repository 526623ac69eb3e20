"""A tiny Wan2.1 text-to-video pipeline: a UMT5 text encoder, a Wan video DiT, Wan's causal 3-D VAE, UniPC.

Saved as `WanPipeline.save_pretrained` writes Wan-AI/Wan2.1-T2V-1.3B-Diffusers: `model_index.json` and one
sub-folder per component (`transformer_2` listed as null, as a Wan2.1 pipeline has no second expert). The
tokenizer is a T5 (sentencepiece-style Unigram) tokenizer trained on the local corpus with UMT5's special
tokens (`<pad>` 0, `</s>` 1, `<s>` 2, `<unk>` 3); the scheduler is configured as the published one.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.tiny_models.tokenizers_local import CORPUS

# UMT5's special tokens at UMT5's ids (google/umt5-xxl, the Wan text encoder's tokenizer).
SPECIALS = ["<pad>", "</s>", "<s>", "<unk>"]
TEXT_WIDTH = 32       # the UMT5 encoder's d_model: the DiT's `text_dim`
LATENT_CHANNELS = 16  # Wan2.1's VAE z_dim
SCORE_DIGITS = 6  # the Unigram scores kept: far above the trainer's run-to-run noise, far below their gaps
# The published 1.3B scheduler: UniPC over flow-matching sigmas, shifted by 3.0 (the 480P setting).
SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0)


def umt5_tokenizer(vocab_size: int = 300):
    """A transformers T5Tokenizer (Unigram, Metaspace pre-tokenizer) with UMT5's special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.train_from_iterator(CORPUS * 20, trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, unk_token="<unk>", show_progress=False))
    trained = [tuple(v) for v in json.loads(unigram.to_str())["model"]["vocab"]]
    assert [v[0] for v in trained[:len(SPECIALS)]] == SPECIALS, "special tokens must keep UMT5's ids"
    # The trainer's scores differ between runs in their last bits (~1e-14), which reorders pieces of equal
    # score: rounded, and ties put in the pieces' order, every build is the same tokenizer.
    pieces = sorted(((piece, round(score, SCORE_DIGITS)) for piece, score in trained[len(SPECIALS):]),
                    key=lambda v: (-v[1], v[0]))
    vocab = [*trained[:len(SPECIALS)], *pieces]
    return T5Tokenizer(vocab=vocab, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0)


def build(out: Path, seed: int = 0) -> None:
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
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
                                        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
                                        text_dim=TEXT_WIDTH, freq_dim=32, ffn_dim=64, num_layers=2,
                                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                                        rope_max_seq_len=64)
    # Wan's VAE shape: 8x spatial (three downsamples), 4x temporal (the last two), causal, 16 latent channels.
    vae = AutoencoderKLWan(base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=UniPCMultistepScheduler(**SCHEDULER))
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
