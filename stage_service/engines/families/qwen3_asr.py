"""Qwen3-ASR (Qwen3ASRForConditionalGeneration, the transformers layout Qwen/Qwen3-ASR-0.6B-hf and -1.7B-hf are
published in): speech recognition as one `ar` stage on transformers. The stage reads the whole checkpoint: the
audio tower and its projector turn the request's audio into prompt rows (inline, on the stage's media threads)
and the Qwen3 decoder is stepped in batches across requests; text out, streamed as it is decoded."""

from __future__ import annotations

from omnistage.families import Adapter, Family, Part, register
from stage_service.engines.families.causal_lm import CHAT_FILES

# The whole model as a stage of its own component ("asr"): the plain causal LM's stage ("" on transformers) reads
# text only, this one the request's audio, so validation must tell them apart.
ASR = Adapter("qwen3-asr", ("transformers",), "ar", "asr", frozenset({"text", "tokens"}),
              inputs=frozenset({"audio"}), language=True)
# The processor's settings (feature extractor, processor class), as transformers saves a Qwen3ASRProcessor.
PROCESSOR_FILE = "processor_config.json"


def engines():
    from stage_service.engines.qwen3_asr.engine import Qwen3AsrEngine

    return {("transformers", ASR): Qwen3AsrEngine}


FAMILY = register(Family("qwen3_asr", ("Qwen3ASRForConditionalGeneration",), (ASR,), engines, parts={
    "asr": Part(("model.audio_tower.", "model.multi_modal_projector.", "model.language_model.", "lm_head."), "",
                ("audio_token_id", "audio_config.num_mel_bins", "audio_config.n_window", "text_config.vocab_size",
                 "text_config.hidden_size", "text_config.num_hidden_layers"),
                tokenizer=True, files=(PROCESSOR_FILE,), optional_files=CHAT_FILES),
}))
