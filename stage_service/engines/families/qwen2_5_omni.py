"""Qwen2.5-Omni (Qwen2_5OmniForConditionalGeneration; the published 7B config.json says Qwen2_5OmniModel):
one combined checkpoint served as stages: the Thinker's encoders (optional stage), the Thinker
(transformers, or vLLM), the Talker and Token2Wav, which read the speakers file at the root."""

from __future__ import annotations

from omnistage.checkpoints.names import PROCESSOR_CONFIG, QWEN2_5_OMNI_SPEAKERS, THINKER_TOWERS
from omnistage.families import Family, Part, register
from omnistage.families.adapters import OMNI_THINKER_VLLM, omni
from stage_service.engines.families.causal_lm import CHAT_FILES
from stage_service.engines.families.qwen3_omni import ENCODER_KEYS, TEXT_KEYS

THINKER, TALKER, TOKEN2WAV, ENCODER = omni("qwen2.5-omni", "token2wav")


def engines():
    from stage_service.engines.qwen2_5_omni import engines as e
    from stage_service.engines.vllm.thinker import VllmThinkerEngine

    return {("transformers", ENCODER): e.EncoderEngine, ("transformers", THINKER): e.ThinkerEngine,
            ("transformers", TALKER): e.TalkerEngine, ("transformers", TOKEN2WAV): e.Token2WavEngine,
            ("vllm", OMNI_THINKER_VLLM): VllmThinkerEngine}


FAMILY = register(Family("qwen2_5_omni", ("Qwen2_5OmniForConditionalGeneration", "Qwen2_5OmniModel"),
                         (THINKER, TALKER, TOKEN2WAV, ENCODER, OMNI_THINKER_VLLM), engines, parts={
    "encoder": Part(THINKER_TOWERS, "thinker_config", ENCODER_KEYS, tokenizer=True, files=(PROCESSOR_CONFIG,),
                    optional_files=CHAT_FILES),
    "thinker": Part("thinker.", "thinker_config", tuple(f"thinker_config.{k}" for k in TEXT_KEYS) +
                    ("thinker_config.text_config.max_position_embeddings",), tokenizer=True,
                    optional_files=CHAT_FILES + (PROCESSOR_CONFIG,)),
    "talker": Part("talker.", "talker_config",
                   tuple(f"talker_config.{k}" for k in (
                       "tts_codec_start_token_id", "tts_codec_end_token_id", "tts_codec_pad_token_id",
                       "tts_codec_mask_token_id", "tts_text_end_token_id", "tts_text_pad_token_id",
                       "embedding_size", "vocab_size")) +
                   tuple(f"thinker_config.{k}" for k in ("audio_token_index", "image_token_index",
                                                         "video_token_index")),
                   borrows=("thinker.model.embed_tokens.weight",), files=(QWEN2_5_OMNI_SPEAKERS,)),
    "token2wav": Part("token2wav.", "token2wav_config",
                      tuple(f"token2wav_config.dit_config.{k}" for k in (
                          "block_size", "repeats", "mel_dim", "num_embeds", "max_position_embeddings")) +
                      tuple(f"token2wav_config.bigvgan_config.{k}" for k in (
                          "upsample_rates", "upsample_kernel_sizes", "resblock_kernel_sizes",
                          "resblock_dilation_sizes")),
                      files=(QWEN2_5_OMNI_SPEAKERS,)),
}))
