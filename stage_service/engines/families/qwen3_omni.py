"""Qwen3-Omni (Qwen3OmniMoeForConditionalGeneration): one combined checkpoint whose parts are served as
stages: the Thinker's encoders (optional stage), the Thinker (transformers, or vLLM), the Talker and
Code2Wav. Every part's tensors sit under one name prefix in one set of shards, its config under one key."""

from __future__ import annotations

from omnistage.checkpoints.names import PROCESSOR_CONFIG, THINKER_TOWERS
from omnistage.families import Family, Part, register
from omnistage.families.adapters import OMNI_THINKER_VLLM, omni
from stage_service.engines.families.causal_lm import CHAT_FILES

THINKER, TALKER, CODE2WAV, ENCODER = omni("qwen3-omni", "code2wav")
TEXT_KEYS = ("text_config.vocab_size", "text_config.hidden_size", "text_config.num_hidden_layers")
# The Thinker's encoders served on their own (`kind: encoder`): the towers, the tokenizer, the chat template
# and the processor's settings.
ENCODER_KEYS = ("thinker_config.vision_config", "thinker_config.audio_config")


def engines():
    from stage_service.engines.qwen3_omni import engines as e
    from stage_service.engines.vllm.thinker import VllmThinkerEngine

    return {("transformers", ENCODER): e.EncoderEngine, ("transformers", THINKER): e.ThinkerEngine,
            ("transformers", TALKER): e.TalkerEngine, ("transformers", CODE2WAV): e.Code2WavEngine,
            ("vllm", OMNI_THINKER_VLLM): VllmThinkerEngine}


FAMILY = register(Family("qwen3_omni", ("Qwen3OmniMoeForConditionalGeneration",),
                         (THINKER, TALKER, CODE2WAV, ENCODER, OMNI_THINKER_VLLM), engines, parts={
    "encoder": Part(THINKER_TOWERS, "thinker_config", ENCODER_KEYS, tokenizer=True, files=(PROCESSOR_CONFIG,),
                    optional_files=CHAT_FILES),
    "thinker": Part("thinker.", "thinker_config", tuple(f"thinker_config.{k}" for k in TEXT_KEYS) +
                    ("talker_config.accept_hidden_layer", "im_end_token_id"), tokenizer=True,
                    optional_files=CHAT_FILES + (PROCESSOR_CONFIG,)),
    "talker": Part("talker.", "talker_config",
                   ("talker_config.accept_hidden_layer", "talker_config.num_code_groups", "talker_config.codec_bos_id",
                    "talker_config.codec_eos_token_id", "talker_config.codec_pad_id", "talker_config.speaker_id",
                    "tts_bos_token_id", "tts_eos_token_id", "tts_pad_token_id", "im_start_token_id",
                    "im_end_token_id", "user_token_id", "assistant_token_id", "thinker_config.audio_token_id",
                    "thinker_config.image_token_id", "thinker_config.video_token_id"),
                   borrows=("thinker.model.embed_tokens.weight",)),
    "code2wav": Part("code2wav.", "code2wav_config", ("code2wav_config.num_quantizers",
                                                      "code2wav_config.upsample_rates")),
}))
