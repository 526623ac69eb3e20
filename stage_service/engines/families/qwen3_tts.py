"""Qwen3-TTS (Qwen3TTSForConditionalGeneration, the layout Qwen publishes Qwen/Qwen3-TTS-12Hz-*-CustomVoice and
-Base in, served with the qwen-tts package's classes): text to speech as two stages. The talker reads the request's
text, speaker, instruction and language (a Base checkpoint: a reference clip, one audio part, and its transcript
instead of a speaker) and steps its decoder and code predictor with every other request's, emitting codec frames
in chunks; the codec decoder (the 12 Hz speech tokenizer in `speech_tokenizer/`) turns each chunk into 24 kHz PCM
as it arrives. A Base checkpoint's talker stage also runs its speaker encoder (`speaker_encoder.`) and the speech
tokenizer's encoder (`encoder.` in `speech_tokenizer/`) on the clip."""

from __future__ import annotations

from omnistage.checkpoints.configs import GENERATION_CONFIG
from omnistage.checkpoints.qwen_tts import SPEECH_TOKENIZER_DIR
from omnistage.families import Adapter, Family, Part, register

# The talker reads the request's text itself (no Thinker upstream): a component of its own, since the omni
# families' `talker` reads a Thinker's rows. The decoder shares the omni decoders' contract (codes in, audio out).
TALKER = Adapter("qwen3-tts-talker", ("transformers",), "ar", "tts_talker", frozenset({"codes"}),
                 inputs=frozenset({"text", "audio"}), initial_chunk=True, language=True, instructions=True,
                 clones=True)
CODE2WAV = Adapter("qwen3-tts-code2wav", ("transformers",), "generation", "code2wav", frozenset({"audio"}),
                   reads=frozenset({"codes"}), needs=frozenset({"codes"}))


def engines():
    from stage_service.engines.qwen3_tts.engines import CodecDecoderEngine, TalkerEngine

    return {("transformers", TALKER): TalkerEngine, ("transformers", CODE2WAV): CodecDecoderEngine}


FAMILY = register(Family("qwen3_tts", ("Qwen3TTSForConditionalGeneration",), (TALKER, CODE2WAV), engines, parts={
    "tts_talker": Part(("talker.", "speaker_encoder."), "talker_config",
                       ("talker_config.num_code_groups", "talker_config.codec_eos_token_id",
                        "talker_config.codec_bos_id", "talker_config.codec_pad_id", "talker_config.spk_id",
                        "talker_config.codec_language_id", "tts_bos_token_id", "tts_eos_token_id",
                        "tts_pad_token_id"),
                       tokenizer=True, optional_files=(GENERATION_CONFIG,)),
    "code2wav": Part("decoder.", "decoder_config", ("decoder_config.num_quantizers", "decoder_config.codebook_size",
                                                    "decoder_config.upsample_rates", "decoder_config.upsampling_ratios",
                                                    "output_sample_rate"), folder=SPEECH_TOKENIZER_DIR),
}))
