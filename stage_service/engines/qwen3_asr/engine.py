"""The Qwen3-ASR stage on transformers: the request's audio through the checkpoint's own processor
(`Qwen3ASRProcessor.apply_transcription_request`: its feature extractor, its chat template, the language forced
as the processor forces it) and the model's audio tower into prompt rows, on the stage's media threads; then the
Qwen3 decoder stepped with every other request's on the shared step loop (`DecoderLm`, as the causal LM and the
omni Thinker are), the transcript streamed as it is decoded.

The model answers `language <Name><asr_text><transcript>`; a request that names its language gets the header in
its prompt, as the processor writes it, and the model writes the transcript alone. The text sent is the raw
decode (special tokens skipped) of the tokens after the marker `<asr_text>`, leading whitespace dropped; before
the marker nothing is sent, and an answer that never writes it is sent whole (stripped) with its last chunk. It
is not the processor's `parse_output`: no repetition is collapsed (that needs the whole answer, and a stream
cannot take back text it sent), and the detected language is not reported.
"""

from __future__ import annotations

import time

import torch

from omnistage import media
from omnistage.api import accepted_inputs
from omnistage.checkpoints.configs import CheckpointError
from omnistage.contract.params import InvalidRequest, RequestParams
from stage_service.engines.omni.media import PROCESSING_ERRORS, PromptRows, place_rows
from stage_service.engines.transformers.causal_lm import CausalLmEngine, TextDeltas, text_sampling
from stage_service.engines.transformers.lm_steps import DecoderLm
from stage_service.runtime import device
from stage_service.runtime.base import StageInputs, StageRequest
from stage_service.runtime.chat_tokens import ClientText, refuse_special_tokens
from stage_service.runtime.media_work import MediaStage
from stage_service.runtime.quantize import quantize_weights

MARKER = "<asr_text>"  # the model's answer: a language header, this marker, then the transcript


def transcript(tokens: list[int], decode, marker: int, forced: bool, final: bool = True) -> str:
    """The transcript in an answer's `tokens` so far (`decode`: ids to text, `marker`: the id of MARKER;
    `forced`: the header and the marker are in the prompt, everything decoded is transcript): after the
    marker, leading whitespace dropped; before it, nothing, or the whole answer stripped once `final`."""
    if forced:
        return decode(tokens).lstrip()
    if marker in tokens:
        return decode(tokens[tokens.index(marker) + 1:]).lstrip()
    return decode(tokens).strip() if final else ""


class Transcript(TextDeltas):
    """The transcript of a streamed answer (`transcript`): the header before the marker never sent."""

    def __init__(self, decode, marker: int, forced: bool):
        super().__init__(decode)
        self.marker, self.forced = marker, forced

    def shown(self, tokens: list[int], final: bool) -> str:
        return transcript(tokens, self._decode, self.marker, self.forced, final)


class Qwen3AsrEngine(MediaStage, CausalLmEngine):
    """Emits per chunk `token_ids` (new tokens), `prompt_token_ids` on the first, and the transcript's delta.
    A request is one audio part, with `params.system_prompt` as context (names, spelling) and
    `params.audio.language` forcing the transcript's language."""

    ENGINE_PROCESS = False  # the audio tower and the prompt rows stay in the stage process
    KV_BUDGET = True        # admitted by the whole reservation: audio rows cannot be fed again after a preemption

    def load(self) -> None:
        from transformers import Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor

        model = Qwen3ASRForConditionalGeneration.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device)
        self.lm = DecoderLm(model, batch_invariant=self.batch_invariant, paged=self.kv_paged)
        # Only the decoder is quantized: the audio tower runs in the dtype.
        quantize_weights(model, self.settings.quantization, self.stage.name, (self.lm.decoder, self.lm.head))
        self.model = model
        self.processor = Qwen3ASRProcessor.from_pretrained(self.model_dir)
        if self.processor.chat_template is None:
            raise CheckpointError(f"{self.model_dir}: no chat template (chat_template.jinja): the processor "
                                  "builds the model's prompt with it")
        self.tokenizer, self.chat_template = self.processor.tokenizer, self.processor.chat_template
        self.marker = self.tokenizer.convert_tokens_to_ids(MARKER)
        self.text_bounds(model.config.text_config, model.generation_config.eos_token_id or model.config.eos_token_id)
        self.bound_kv(self.lm.kv_per_token, device.weights_bytes(model), device.gpu_bytes(self.device))

    async def prompt(self, req: StageRequest, inputs: StageInputs):
        return await self.media.run(self.encode, req.params)

    def encode(self, p: RequestParams) -> tuple[list[int], PromptRows, float]:
        """Decode the request's audio, run the processor and the audio tower (on a media thread): the prompt
        ids, the decoder's rows and the milliseconds taken."""
        started = time.perf_counter()
        if not p.parts and not p.prompt_token_ids:
            raise InvalidRequest("params.parts", "needs one audio part: the speech to transcribe")
        if p.prompt_token_ids or p.raw_prompt or p.turns or p.tools or p.answer_prefix:
            field = next(f for f in ("prompt_token_ids", "raw_prompt", "turns", "tools", "answer_prefix")
                         if getattr(p, f))
            raise InvalidRequest(f"params.{field}", "a speech recognition model takes one audio part (and a "
                                                    "system_prompt as context), nothing else")
        parts = media.decode_parts(p.content, self.pipeline.limits, accepted_inputs(self.pipeline))
        if len(parts) != 1 or not isinstance(parts[0], media.Audio):
            raise InvalidRequest("params.parts", f"needs exactly one audio part, got {len(parts)} parts")
        features = self.processor.feature_extractor
        clip = media.resample(parts[0].samples, parts[0].sample_rate, features.sampling_rate)
        language = self.language(p.language)
        # The processor tokenizes the context inside its chat template, special tokens and all: one written
        # in it would be the model's own (a forged turn, a placeholder for audio that is not there).
        refuse_special_tokens(self.tokenizer, (ClientText(p.system_prompt, "params.system_prompt"),))
        try:
            batch = self.processor.apply_transcription_request(clip, language=language,
                                                               prompt=p.system_prompt or None)
        except PROCESSING_ERRORS as e:
            raise InvalidRequest("params.parts[0].audio",
                                 f"the model's processor refused it: {e or type(e).__name__}") from None
        ids = batch["input_ids"][0].tolist()
        rows = self.prompt_rows(batch["input_ids"][0], batch["input_features"], batch["input_features_mask"])
        return ids, rows, (time.perf_counter() - started) * 1e3

    def language(self, code: str) -> str | None:
        """The language name the processor forces for a code or a name it knows (its own `resolve_language`);
        None: detected."""
        from transformers.audio_utils import resolve_language
        from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME

        try:
            return resolve_language(code or None, LANGUAGE_CODE_TO_NAME, return_code=False)
        except ValueError as e:
            raise InvalidRequest("params.audio.language", f"{e or type(e).__name__}") from None

    @torch.inference_mode()
    def prompt_rows(self, ids: torch.Tensor, features: torch.Tensor, mask: torch.Tensor) -> PromptRows:
        """The prompt's embeddings with the audio tower's projected rows at the audio placeholders, as the
        model's forward places them."""
        model = self.model
        ids = ids.to(self.device)
        embeds = model.get_input_embeddings()(ids).clone()
        audio = model.get_audio_features(features.to(self.device, model.dtype), mask.to(self.device),
                                         return_dict=True).pooler_output
        place_rows(embeds, ids, model.config.audio_token_id, audio, "audio")
        return PromptRows(embeds=embeds, positions=None, rope_delta=0)

    def new_state(self, ids: list[int], p: RequestParams):
        # Never preempted (recompute=False): its audio rows cannot be fed again from its token ids.
        return self.lm.new_state(ids, text_sampling(p), p.max_tokens, frozenset() if p.ignore_eos else self.stop_ids,
                                 prefill_chunk=self.prefill_chunk)

    def text_deltas(self, p: RequestParams) -> TextDeltas:
        return Transcript(self.decode, self.marker, forced=bool(p.language))
