"""Tiny Qwen3-Omni (Thinker -> Talker -> Code2Wav) with the real transformers classes.

The combined `Qwen3OmniMoeForConditionalGeneration` is saved at the root of the
model directory and each stage's sub-model in its own folder, all from the same
weights, so the staged pipeline and the monolithic model compute the same thing.
"""

from __future__ import annotations

from pathlib import Path

SAMPLE_RATE = 24000
HIDDEN = 64
VOCAB = 151936
# Ids the Qwen3-Omni config uses for its chat roles and special tokens.
SPECIAL_TOKENS = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151646: "<|AUDIO|>",
    151647: "<|audio_start|>", 151648: "<|audio_end|>", 151652: "<|vision_start|>", 151653: "<|vision_end|>",
    151655: "<|IMAGE|>", 151656: "<|VIDEO|>", 151669: "<|audio_bos|>", 151671: "<|tts_pad|>",
    151672: "<|tts_bos|>", 151673: "<|tts_eos|>",
}
ROLE_TOKENS = {872: "user", 77091: "assistant", 8948: "system"}
# Codec ids must lie inside the talker's vocabulary and above its 2048 codebook entries.
CODEC_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_nothink_id=2155,
                 codec_think_bos_id=2156, codec_think_eos_id=2157)
SPEAKERS = {"ethan": 2200, "chelsie": 2201}


def config():
    from transformers import Qwen3OmniMoeConfig

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True,
            "interleaved": True}
    moe = dict(intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, rope_parameters=rope)
    thinker = dict(
        text_config=dict(vocab_size=VOCAB, hidden_size=HIDDEN, **moe),
        vision_start_token_id=151652, vision_end_token_id=151653, audio_end_token_id=151648,
        audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, output_dim=HIDDEN, downsample_hidden_size=16, n_window=50),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN,
                           deepstack_visual_indexes=[0], num_position_embeddings=64))
    talker = dict(
        thinker_hidden_size=HIDDEN, spatial_merge_size=2, accept_hidden_layer=1, num_code_groups=4,
        speaker_id=SPEAKERS, **CODEC_IDS,
        text_config=dict(vocab_size=3072, hidden_size=HIDDEN, shared_expert_intermediate_size=64, **moe),
        code_predictor_config=dict(vocab_size=2048, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_code_groups=4))
    # Real Qwen3-Omni upsampling (1920 samples per codec frame = 80 ms at 24 kHz) on tiny channels.
    code2wav = dict(codebook_size=2048, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                    num_hidden_layers=1, intermediate_size=64, num_quantizers=4, upsample_rates=[8, 5, 4, 3],
                    upsampling_ratios=[2, 2], decoder_dim=64, sliding_window=8)
    return Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
                              enable_audio_output=True)


def build(out: Path, seed: int = 0) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3OmniMoeForConditionalGeneration

    from .tokenizers_local import pad_vocab, train_bpe

    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config()).eval()
    tok = pad_vocab(train_bpe(800, ["<unk>"]), VOCAB, ROLE_TOKENS, SPECIAL_TOKENS)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    hf_tok.save_pretrained(out)
    for name in ("thinker", "talker", "code2wav"):
        getattr(model, name).save_pretrained(out / name)
    hf_tok.save_pretrained(out / "thinker")
    (out / "code2wav" / "sample_rate").write_text(f"{SAMPLE_RATE}\n")
    # The Talker's conditioning for "speech starts / ends / pause" is the Thinker's embedding of
    # tts_bos / tts_eos / tts_pad: ship those three rows with the Talker so it needs no Thinker weights.
    from safetensors.torch import save_file

    cfg = model.config
    ids = torch.tensor([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id])
    with torch.no_grad():
        rows = model.thinker.get_input_embeddings()(ids).contiguous()
    save_file({"embeds": rows}, str(out / "talker" / "tts_special_embeds.safetensors"))
