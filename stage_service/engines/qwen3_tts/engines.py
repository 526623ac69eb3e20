"""Qwen3-TTS stages on transformers (the qwen-tts package's classes): the talker (the request's text, spoken
by a named speaker after an optional instruction, or in the voice of a reference clip, into codec frames,
stepped with every other request's) and the codec decoder (frames into 24 kHz PCM as they arrive). Both are the
omni stages' engines with this family's model parts (steps.py): the talker's chunking, KV budget and scheduling
are `FedTalkerEngine`'s, the decoder's `Code2WavEngine`'s.

A Base checkpoint's request carries its reference clip as its one audio part, checked and decoded by the media
checks, and run through the speaker encoder (and, with `params.audio.ref_text`, the speech tokenizer's encoder)
on the stage's media threads (clone.py). In ICL mode the talker's first chunk carries the clip's codes as
`context_codes` [groups, frames]: the decoder decodes them before the first frames as their left context and
emits only the frames after them, as generate_voice_clone cuts the reference's share of the waveform."""

from __future__ import annotations

from typing import AsyncIterator

import torch

from omnistage import media
from omnistage.api import accepted_inputs
from omnistage.checkpoints.qwen_tts import classes
from omnistage.contract.params import DEFAULT_SPEAKER, InvalidRequest, RequestParams
from stage_service.engines.omni.talker import FedTalkerEngine
from stage_service.engines.qwen3_omni.engines import Code2WavEngine
from stage_service.engines.qwen3_tts.clone import VoicePrompt
from stage_service.engines.qwen3_tts.steps import (
    ASSISTANT_TEXT,
    INSTRUCTION_TEXT,
    REF_TEXT,
    CodecDecoder,
    TtsTalker,
)
from stage_service.engines.transformers.causal_lm import text_sampling
from stage_service.runtime.base import InputChunk, OutputChunk, StageInputs, StageRequest, tensor
from stage_service.runtime.media_work import MediaStage

# The shortest reference clip cloned: the speaker encoder's mel frames and its dilated convolutions (reflect
# padded) need some 50 ms, the speech tokenizer's encoder a frame (80 ms); shorter is refused by name.
MIN_CLIP_SECONDS = 0.25
# What a request to the talker may carry besides its text (and the fields that name them).
_NOT_READ = ("prompt_token_ids", "raw_prompt", "turns", "tools", "answer_prefix", "system_prompt")


class TalkerEngine(MediaStage, FedTalkerEngine):
    """Reads the request's text (its prompt and text parts), `params.audio.speaker` (one of the checkpoint's
    speakers), `params.audio.instructions` (how to speak) and `params.audio.language` ("" or "auto":
    detected); emits `codes` [groups, frames] per chunk (the first at `initialChunkSize` when set). On a Base
    checkpoint: its one audio part (the voice to clone) and `params.audio.ref_text` (the clip's transcript:
    ICL mode; none: x-vector mode) instead of a speaker and instructions; the first chunk carries the clip's
    codes as `context_codes` in ICL mode."""

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
        other = [x.WhichOneof("part") for x in p.parts if x.WhichOneof("part") not in ("text", "audio")]
        if other:
            raise InvalidRequest("params.parts", f"a text-to-speech model reads text parts (and a Base checkpoint "
                                                 f"one audio part, the voice to clone) only, got {other[0]}")
        self.check_voice(p)
        if not p.text.strip():
            raise InvalidRequest(p.prompt_field, "is empty: there is no text to speak")
        if p.instructions and not self.talker.takes_instructions:
            raise InvalidRequest("params.audio.instructions", "this checkpoint (a 0.6B CustomVoice model) takes no "
                                                              "instruction: qwen-tts speaks its voices without one")
        ids = self.tokenizer(ASSISTANT_TEXT.format(p.text))["input_ids"]
        instruction = self.tokenizer(INSTRUCTION_TEXT.format(p.instructions))["input_ids"] if p.instructions else []
        return list(ids), list(instruction)

    def check_voice(self, p: RequestParams) -> None:
        """InvalidRequest naming the field where the request's voice does not fit the checkpoint: a Base one
        needs exactly one reference clip and reads no speaker or instruction; a CustomVoice one takes no clip."""
        clips = [i for i, x in enumerate(p.parts) if x.WhichOneof("part") == "audio"]
        if not self.talker.clones:
            if clips:
                raise InvalidRequest(f"params.parts[{clips[0]}].audio", "this checkpoint (a CustomVoice model) speaks "
                                                                        "its named voices: it clones no reference "
                                                                        "clip (a Base checkpoint does)")
            if p.ref_text:
                raise InvalidRequest("params.audio.ref_text", "is a reference clip's transcript, and this checkpoint "
                                                              "(a CustomVoice model) clones no clip")
            return
        if p.speaker.lower() not in ("", DEFAULT_SPEAKER):
            raise InvalidRequest("params.audio.speaker", f'unknown speaker "{p.speaker}": this checkpoint (a Base '
                                                         "model) has no named voices; it speaks in the voice of the "
                                                         "reference clip (send the voice \"default\", or none)")
        if p.instructions:
            raise InvalidRequest("params.audio.instructions", "this checkpoint (a Base model) takes no instruction: "
                                                              "it speaks in the voice of the reference clip")
        if not clips:
            raise InvalidRequest("params.parts", "voice cloning needs a reference clip: one audio part (this "
                                                 "checkpoint is a Base model, with no named voices)" +
                                 ("; params.audio.ref_text is its transcript" if p.ref_text else ""))
        if len(clips) > 1:
            raise InvalidRequest(f"params.parts[{clips[1]}].audio", f"voice cloning takes one reference clip, got "
                                                                    f"{len(clips)} audio parts")
        if p.ref_text and not p.ref_text.strip():
            raise InvalidRequest("params.audio.ref_text", "is blank: give the clip's transcript, or none (the "
                                                          "voice is then taken from the clip's sound alone)")

    def voice(self, p: RequestParams) -> VoicePrompt:
        """The request's reference clip through the media checks and the encoders (on a media thread)."""
        (clip,) = [x for x in media.decode_parts(p.parts, self.pipeline.limits, accepted_inputs(self.pipeline))
                   if isinstance(x, media.Audio)]
        seconds = len(clip.samples) / clip.sample_rate
        if seconds < MIN_CLIP_SECONDS:
            where = next(i for i, x in enumerate(p.parts) if x.WhichOneof("part") == "audio")
            raise InvalidRequest(f"params.parts[{where}].audio", f"the reference clip is {seconds * 1000:.0f} ms long: "
                                                                 f"voice cloning needs at least {MIN_CLIP_SECONDS} s "
                                                                 "(a few seconds of speech clone best)")
        ref_ids = list(self.tokenizer(REF_TEXT.format(p.ref_text))["input_ids"]) if p.ref_text else None
        assert self.talker.clone_encoder is not None
        return self.talker.clone_encoder.voice(clip.samples, clip.sample_rate, ref_ids)

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        p = req.params
        ids, instruction = self.texts(p)
        voice = await self.media.run(self.voice, p) if self.talker.clones else None
        ref_frames = voice.frames if voice is not None else 0
        prompt_rows = self.talker.prompt_rows(instruction, ref_frames)
        self.refuse_kv(f"a prompt of {prompt_rows} rows", prompt_rows, p.max_codec_frames)
        st = self.talker.new_state(ids, instruction, text_sampling(p, self.REPETITION_PENALTY), p.max_codec_frames,
                                   p.speaker, p.language, voice)
        self.seat(st, prompt_rows)
        context = voice.codes.T.contiguous().cpu() if voice is not None and voice.codes is not None else None
        async for chunk in self.speak(req, st, inputs, context):
            yield chunk


class CodecDecoderEngine(Code2WavEngine):
    """The speech tokenizer's decoder: each chunk of codec frames (with left context) into int16 PCM; a first
    chunk's `context_codes` (a cloned voice's reference codes) are the left context of its frames, not emitted."""

    DECODER = CodecDecoder

    def first_history(self, chunk: InputChunk) -> torch.Tensor:
        history = super().first_history(chunk)
        if "context_codes" not in chunk.tensors:
            return history
        context = self.checked_codes(self.on_device(tensor(chunk, "context_codes")), "context_codes")
        return context[:, -self.c2w.LEFT_CONTEXT:]
