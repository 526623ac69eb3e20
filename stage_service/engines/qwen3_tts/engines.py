"""Qwen3-TTS stages on transformers (the qwen-tts package's classes): the talker (the request's text, spoken
by a named speaker after an optional instruction, into codec frames, stepped with every other request's) and
the codec decoder (frames into 24 kHz PCM as they arrive). Both are the omni stages' engines with this
family's model parts (steps.py): the talker's chunking, KV budget and scheduling are `FedTalkerEngine`'s,
the decoder's `Code2WavEngine`'s."""

from __future__ import annotations

from typing import AsyncIterator

import torch

from omnistage.checkpoints.qwen_tts import classes
from omnistage.contract.params import InvalidRequest, RequestParams
from stage_service.engines.omni.talker import FedTalkerEngine
from stage_service.engines.qwen3_omni.engines import Code2WavEngine
from stage_service.engines.qwen3_tts.steps import ASSISTANT_TEXT, INSTRUCTION_TEXT, CodecDecoder, TtsTalker
from stage_service.engines.transformers.causal_lm import text_sampling
from stage_service.runtime.base import OutputChunk, StageInputs, StageRequest

# What a request to the talker may carry besides its text (and the fields that name them).
_NOT_READ = ("prompt_token_ids", "raw_prompt", "turns", "tools", "answer_prefix", "system_prompt")


class TalkerEngine(FedTalkerEngine):
    """Reads the request's text (its prompt and text parts), `params.audio.speaker` (one of the checkpoint's
    speakers), `params.audio.instructions` (how to speak) and `params.audio.language` ("" or "auto":
    detected); emits `codes` [groups, frames] per chunk (the first at `initialChunkSize` when set)."""

    ENGINE_PROCESS = False  # the engine process's protocol carries a Thinker's rows, not this talker's prompt

    def load(self) -> None:
        super().load()
        processor = classes().processor.from_pretrained(str(self.model_dir), fix_mistral_regex=True)
        self.tokenizer = processor.tokenizer
        self.REPETITION_PENALTY = float(self.talker.defaults["repetition_penalty"])

    @staticmethod
    def build_talker(model_dir, dtype: torch.dtype, batch_invariant: bool, device) -> TtsTalker:
        return TtsTalker(model_dir, dtype, batch_invariant=batch_invariant, device=device)

    def spoken_rows(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        raise InvalidRequest("inputs", "the Qwen3-TTS talker reads the request's text, not a Thinker's rows")

    def texts(self, p: RequestParams) -> tuple[list[int], list[int]]:
        """The assistant text's and the instruction's token ids; InvalidRequest names what cannot be spoken."""
        for field in _NOT_READ:
            if getattr(p, field):
                raise InvalidRequest(f"params.{field}", "is not read by a text-to-speech model: it speaks the "
                                                        "prompt's text (params.audio.instructions say how)")
        other = [x.WhichOneof("part") for x in p.parts if x.WhichOneof("part") != "text"]
        if other:
            raise InvalidRequest("params.parts", f"a text-to-speech model reads text parts only, got {other[0]}")
        if not p.text.strip():
            raise InvalidRequest(p.prompt_field, "is empty: there is no text to speak")
        if p.instructions and not self.talker.takes_instructions:
            raise InvalidRequest("params.audio.instructions", "this checkpoint (a 0.6B CustomVoice model) takes no "
                                                              "instruction: qwen-tts speaks its voices without one")
        ids = self.tokenizer(ASSISTANT_TEXT.format(p.text))["input_ids"]
        instruction = self.tokenizer(INSTRUCTION_TEXT.format(p.instructions))["input_ids"] if p.instructions else []
        return list(ids), list(instruction)

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        p = req.params
        ids, instruction = self.texts(p)
        prompt_rows = self.talker.prompt_rows(instruction)
        self.refuse_kv(f"a prompt of {prompt_rows} rows", prompt_rows, p.max_codec_frames)
        st = self.talker.new_state(ids, instruction, text_sampling(p, self.REPETITION_PENALTY), p.max_codec_frames,
                                   p.speaker, p.language)
        self.seat(st, prompt_rows)
        async for chunk in self.speak(req, st, inputs):
            yield chunk


class CodecDecoderEngine(Code2WavEngine):
    """The speech tokenizer's decoder: each chunk of codec frames (with left context) into int16 PCM."""

    DECODER = CodecDecoder
