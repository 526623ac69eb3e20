"""Tiny Qwen3-ASR (audio tower -> projector -> Qwen3 decoder), written as transformers publishes Qwen3-ASR
(Qwen/Qwen3-ASR-0.6B-hf, the transformers layout of Qwen/Qwen3-ASR-0.6B): `config.json` with
`Qwen3ASRForConditionalGeneration` / `qwen3_asr` and the upstream token ids, `generation_config.json`, the
weights under transformers' names (`model.audio_tower.`, `model.multi_modal_projector.`,
`model.language_model.`; the output head tied to the embeddings), a fast Qwen2 tokenizer that names the audio
tokens, the chat template and the processor's settings (`Qwen3ASRProcessor` over `Qwen3ASRFeatureExtractor`),
all saved by transformers' own classes.
"""

from __future__ import annotations

from pathlib import Path

from omnistage.tiny_models.qwen3_omni import QWEN3_ADDED_TOKENS

HIDDEN = 64
VOCAB = 151936          # the decoder's embedding rows, as upstream (more than the tokenizer's ids)
REGULAR_IDS = 151643    # byte-level BPE ids; the added tokens follow
# Qwen3's added tokens, then the audio ones at upstream's ids (<|audio_start|> 151669, <|audio_end|> 151670,
# <|audio_pad|> 151676, <asr_text> 151704, <timestamp> 151705). The ids between carry tokens the ASR prompt
# never writes; the tiny tokenizer holds them as reserved tokens, so every named one sits at its upstream id.
_QWEN3 = QWEN3_ADDED_TOKENS
_NAMED = {151669: "<|audio_start|>", 151670: "<|audio_end|>", 151676: "<|audio_pad|>", 151704: "<asr_text>",
          151705: "<timestamp>"}
ADDED_TOKENS = _QWEN3 + [_NAMED.get(i, f"<|reserved_{i}|>") for i in range(REGULAR_IDS + len(_QWEN3), 151706)]
TOKEN_IDS = {t: REGULAR_IDS + i for i, t in enumerate(ADDED_TOKENS)}
# The transcript follows this marker; it and the think tags are plain (not special) tokens upstream.
NOT_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                         "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
                         "<think>", "</think>", "<asr_text>"})
ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091}
TOKENIZER_ROLES = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", audio_token="<|audio_pad|>",
                       audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>")
EOS_IDS = [TOKEN_IDS["<|endoftext|>"], TOKEN_IDS["<|im_end|>"]]

# The chat template: a system turn always (empty without one: the context the client gives), the user turn's
# audio as <|audio_start|><|audio_pad|><|audio_end|> (the processor repeats the pad once per encoder row),
# any assistant text (the forced "language X<asr_text>"), then the generation prompt.
_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' or 'audio' in part -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}{{- '<|im_start|>system\\n<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT + "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# Weights drawn wider than transformers' 0.02: at 0.02 the tiny decoder repeats its last prompt token whatever it
# hears; at this scale its tokens depend on the audio, so a test comparing transcripts can tell clips apart.
INIT_RANGE = 0.3


def config():
    from transformers import Qwen3ASRConfig

    audio = dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=HIDDEN, downsample_hidden_size=16, n_window=50, n_window_infer=800,
                 initializer_range=INIT_RANGE)
    text = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=65536,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
                initializer_range=INIT_RANGE)
    return Qwen3ASRConfig(audio_config=audio, text_config=text, audio_token_id=TOKEN_IDS["<|audio_pad|>"],
                          timestamp_token_id=TOKEN_IDS["<timestamp>"], pad_token_id=TOKEN_IDS["<|im_end|>"],
                          eos_token_id=EOS_IDS, tie_word_embeddings=True,
                          initializer_range=INIT_RANGE)


def tokenizer():
    from omnistage.tiny_models.tokenizers_local import qwen_tokenizer

    return qwen_tokenizer(REGULAR_IDS, {i: role for role, i in ROLE_IDS.items()}, {i: t for t, i in TOKEN_IDS.items()},
                          NOT_SPECIAL, **TOKENIZER_ROLES)


def build(out: Path, seed: int = 0) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        Qwen3ASRFeatureExtractor,
        Qwen3ASRForConditionalGeneration,
        Qwen3ASRProcessor,
    )

    from omnistage.tiny_models.tokenizers_local import save_qwen_tokenizer

    torch.manual_seed(seed)
    model = Qwen3ASRForConditionalGeneration(config()).eval()
    model.generation_config = GenerationConfig(pad_token_id=TOKEN_IDS["<|im_end|>"], eos_token_id=EOS_IDS)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok = tokenizer()
    save_qwen_tokenizer(tok, out)
    # 16 kHz, 128 mel bins, the mel frames padded to whole encoder chunks (2 x n_window); upstream's settings.
    features = Qwen3ASRFeatureExtractor(feature_size=128, sampling_rate=16000, n_window=50)
    Qwen3ASRProcessor(feature_extractor=features, tokenizer=tok, chat_template=CHAT_TEMPLATE).save_pretrained(out)
