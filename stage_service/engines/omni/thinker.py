"""What every omni Thinker stage shares: a causal LM stage that also emits, per chunk, the rows the
Talker is conditioned on (`embeds` and `hidden` of every position fed), and takes media in.

A family's `load` hands `use_thinker` a `DecoderLm` with `model` (the family's
`...ThinkerForConditionalGeneration`, encoders included), `tokenizer`, `chat_template`, `stop_ids`,
`vocab`, `new_thinker_state(ids, sampling, max_tokens, ignore_eos, prefill_chunk)` and
`step_thinker(states)` (each result with `token`, `finish_reason`, `embeds`, `hidden`), and sets
`max_len` (the checkpoint's positions, or engineArgs.max_model_len when smaller).

Media (`params.parts`) go through the checkpoint's processor and the Thinker's own encoders
(`omni_media`), on the stage's media threads beside the step loop (`media_work`), so a request with an
image shares decode steps with text-only ones while its encoders run; or, where the topology gives the
Thinker an encoder stage,
the encoder's chunk carries the prompt ids and encoder rows, and only the merge happens here.
"""

from __future__ import annotations

import time

import torch

from omnistage import media
from omnistage.api import accepted_inputs
from omnistage.contract.params import InvalidRequest, RequestParams, has_media
from stage_service.engines.omni.media import (
    PROCESSOR_CONFIG,
    QWEN3_OMNI,
    EncodedPrompt,
    Family,
    OmniProcessor,
    encode,
    prompt_rows,
)
from stage_service.engines.omni.spoken import SpokenRows, tool_tag_ids
from stage_service.engines.transformers.causal_lm import CausalLmEngine, text_sampling
from stage_service.runtime import device
from stage_service.runtime.base import InputError, StageInputs, StageRequest
from stage_service.runtime.media_work import MediaStage
from stage_service.runtime.quantize import quantize_weights


class OmniThinkerEngine(MediaStage, CausalLmEngine):
    """Emits per chunk: `token_ids` (new tokens), `embeds` and `hidden` (rows of every position fed),
    `prompt_token_ids` on the first chunk, and the text delta. A text prompt goes through the checkpoint's
    chat template unless the request gives token ids or asks for the raw prompt (`chat.prompt_ids`); a
    request with media parts becomes one user turn of them (the prompt, if any, as a last text part)."""

    MEDIA_FAMILY: Family = QWEN3_OMNI
    ENGINE_PROCESS = False  # its media prompts and hidden-state rows stay in the stage process for now
    # Under a KV budget its sequences are admitted by their whole reservation (prompt + max_tokens) and never
    # preempted: recomputing one would need its media rows again and must not send the Talker rows twice.
    KV_BUDGET = True

    def use_thinker(self, thinker) -> None:
        # Only the language model is quantized: the encoders run in the dtype, inline as in an encoder stage.
        quantize_weights(thinker.model, self.settings.quantization, self.stage.name, (thinker.decoder, thinker.head))
        self.thinker = thinker
        self.bound_kv(thinker.kv_per_token, device.weights_bytes(thinker.model), device.gpu_bytes(self.device))
        self.tokenizer, self.chat_template = thinker.tokenizer, thinker.chat_template
        self.tool_tags = tool_tag_ids(self.tokenizer)
        self.vocab, self.stop_ids = thinker.vocab, thinker.stop_ids
        # Fed by an encoder stage, or without the processor's settings (text only), it needs no processor.
        self.processor = None
        if not self.stage.inputs and (self.model_dir / PROCESSOR_CONFIG).exists():
            self.processor = OmniProcessor(self.model_dir, self.MEDIA_FAMILY, self.tokenizer, self.chat_template)

    async def prompt(self, req: StageRequest, inputs: StageInputs):
        p = req.params
        if inputs.sources:  # an encoder stage made the prompt
            chunk = await inputs.next()
            if chunk is None:
                raise InputError("the encoder stage sent nothing")
            started = time.perf_counter()
            enc = EncodedPrompt.from_tensors(chunk.tensors)
            rows = await self.media.run(prompt_rows, self.thinker.model, enc) if enc.has_media else None
            return enc.ids.cpu().tolist(), rows, (time.perf_counter() - started) * 1e3
        if not has_media(p.parts):  # text only: the one prompt policy (chat.prompt_ids)
            return self.prompt_ids(p), None, 0.0
        if self.processor is None:
            raise InvalidRequest("params.parts", f"this model has no {PROCESSOR_CONFIG}: it takes text prompts only")
        return await self.media.run(self.encode_inline, p)

    def encode_inline(self, p: RequestParams) -> tuple[list[int], object | None, float]:
        """Decode, process and encode a request's parts (on a media thread: not the event loop, not the
        step loop); the prompt ids, the decoder's rows (None without media) and the milliseconds taken."""
        started = time.perf_counter()
        inputs = prepare_turn(self.processor, p, self.pipeline, self.DEFAULT_SYSTEM_PROMPT)
        rows = None
        if inputs.has_media:
            rows = prompt_rows(self.thinker.model, encode(self.thinker.model, inputs))
        return inputs.ids, rows, (time.perf_counter() - started) * 1e3

    def step(self, states) -> list:
        return self.thinker.step_thinker(states)

    def new_state(self, ids, p: RequestParams):
        return self.thinker.new_thinker_state(ids, text_sampling(p), p.max_tokens, p.ignore_eos, self.prefill_chunk)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.stop_ids])

    def step_tensors(self, step) -> dict[str, torch.Tensor]:
        return {"embeds": step.embeds, "hidden": step.hidden}

    def chunk_marks(self, ids: list[int], p: RequestParams) -> SpokenRows | None:
        """With tools in play, which rows the Talker speaks (not a tool call's: `spoken`)."""
        if not (p.tools or p.answer_prefix) or self.tool_tags is None:
            return None
        return SpokenRows(self.tool_tags, ids)


def prepare_turn(processor: OmniProcessor, p: RequestParams, pipeline, default_system: str = ""):
    """A request's user turn (its parts, then the prompt as a last text part) decoded, checked against the
    pipeline's limits and inputs as the orchestrator checked them, and run through the processor."""
    parts = media.decode_parts(p.content, pipeline.limits, accepted_inputs(pipeline))
    if p.turns:
        return processor.prepare_conversation(parts, p, default_system)
    return processor.prepare(parts, p.system_prompt or default_system, prompt_at=len(p.parts) if p.prompt else None)
