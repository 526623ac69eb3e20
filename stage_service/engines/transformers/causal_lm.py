"""AR stages on transformers: a causal LM decoded with step-level batching (for LMs vLLM does not
serve, or to compare against vLLM). The Thinker engine is this one with hidden-state rows added."""

from __future__ import annotations

from typing import AsyncIterator

import torch

from omnistage.contract.params import InvalidRequest, RequestParams
from stage_service.engines.transformers.lm_core import LmCore, RemoteTokenState
from stage_service.engines.transformers.lm_steps import DecoderLm, TokenState
from stage_service.runtime import device
from stage_service.runtime.base import Chunking, OutputChunk, StageInputs, StageRequest, SteppedEngine
from stage_service.runtime.chat import check_context, load_chat_template, prompt_ids
from stage_service.runtime.engine_process import remote_step
from stage_service.runtime.quantize import quantize_weights
from stage_service.runtime.sampling import SamplingSettings


def text_sampling(p: RequestParams, repetition_penalty: float = 1.0) -> SamplingSettings:
    return SamplingSettings(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                            repetition_penalty=repetition_penalty)


class TextDeltas:
    """Incremental detokenization: emit only text that will not change when more tokens arrive."""

    def __init__(self, decode):
        self._decode = decode
        self._sent = ""

    def delta(self, tokens: list[int], final: bool) -> str:
        text = self.shown(tokens, final)
        if not final and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its bytes
            return ""
        out, self._sent = text[len(self._sent):], text
        return out

    def shown(self, tokens: list[int], final: bool) -> str:
        """What of the answer so far (its tokens) the client sees as text: all of it decoded; a model whose
        answer opens with a header it does not send overrides this. It may only grow as tokens arrive."""
        return self._decode(tokens)


# A text prompt longer than this is prefilled in pieces of it, each sharing a step with the others' decoding
# (as vLLM's chunked prefill): one prompt at a model's whole context would otherwise hold every sequence of the
# batch for its one long step. 2048 tokens keep a piece's matmuls large enough to run at full rate.
DEFAULT_PREFILL_CHUNK = 2048


class CausalLmEngine(SteppedEngine):
    """Emits per chunk `token_ids` (new tokens), the text delta, and `prompt_token_ids` on the first chunk.
    The prompt becomes token ids by the one prompt policy (`chat.prompt_ids`): `load` sets `tokenizer`
    and `chat_template` (None: the checkpoint has none)."""

    DEFAULT_SYSTEM_PROMPT = ""  # the system turn the model needs when a request has none ("": none)
    ENGINE_PROCESS = True
    KV_BUDGET = True
    TOKEN_BUDGET = True  # engineArgs.max_num_batched_tokens
    unit = "tokens"

    def load(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.options.engine_process:
            try:
                info = self.start_core(LmCore, (str(self.model_dir), self.placement, self.batch_invariant,
                                                self.settings.quantization, self.stage.name, self.kv_paged))
                self._load_text(AutoConfig.from_pretrained(self.model_dir))
                self.bound_kv(info["kv_per_token"], info["weights_bytes"], info["gpu_bytes"])
            except BaseException:
                if self.core is not None:
                    self.core.close()  # the stage does not start: no engine process left behind
                raise
            return
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device)
        quantize_weights(model, self.settings.quantization, self.stage.name)
        self.lm = DecoderLm(model, batch_invariant=self.batch_invariant, paged=self.kv_paged)
        self._load_text(model.config)
        self.bound_kv(self.lm.kv_per_token, device.weights_bytes(model), device.gpu_bytes(self.device))

    def _load_text(self, config) -> None:
        """What the stage process needs beside the model: tokenizer, chat template, vocabulary and bounds."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.chat_template = load_chat_template(self.model_dir, self.tokenizer)
        self.text_bounds(config, config.eos_token_id)

    def text_bounds(self, config, eos: int | list[int] | None) -> None:
        """The vocabulary, the longest sequence (the decoder's positions, or engineArgs.max_model_len when
        smaller) and the ids that end an answer, from the decoder's config and its end-of-sequence id(s)."""
        self.vocab = config.vocab_size
        self.max_len = min(x for x in (getattr(config, "max_position_embeddings", None),
                                       self.options.max_model_len, 1 << 62) if x)
        self.stop_ids = frozenset(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])

    def step(self, states: list[TokenState]) -> list:
        if self.core is not None:
            return remote_step(self.core, states)
        return self.lm.step_batch(states)


    @property
    def prefill_chunk(self) -> int:
        """The most prompt tokens one step feeds a text prompt: engineArgs.max_num_batched_tokens, or
        DEFAULT_PREFILL_CHUNK."""
        return self.options.max_num_batched_tokens or DEFAULT_PREFILL_CHUNK

    def prompt_ids(self, p: RequestParams) -> list[int]:
        return prompt_ids(p, self.tokenizer, self.chat_template, self.DEFAULT_SYSTEM_PROMPT)

    def new_state(self, ids: list[int], p: RequestParams) -> TokenState | RemoteTokenState:
        # recompute: a text prompt's KV can be dropped and recomputed from its tokens (preemption, kv_budget.py)
        spec = (ids, text_sampling(p), p.max_tokens, frozenset() if p.ignore_eos else self.stop_ids, True,
                self.prefill_chunk)
        if self.core is not None:
            return RemoteTokenState(seq=self.core.sequence(spec), core=self.core, prompt_len=len(ids),
                                    max_tokens=p.max_tokens, kv_pages=self.kv_pages, preemptible=True,
                                    prefill_chunk=self.prefill_chunk)
        return self.lm.new_state(*spec)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def step_tensors(self, step) -> dict[str, torch.Tensor]:
        """Tensors a step adds to the chunk beside its token (rows, for the Thinker)."""
        return {}

    def text_deltas(self, p: RequestParams) -> TextDeltas:
        """How a request's tokens become the text sent with each chunk."""
        return TextDeltas(self.decode)

    def chunk_marks(self, ids: list[int], p: RequestParams):
        """What marks each chunk's rows for the stage downstream (the Thinker's `spoken`), or None."""
        return None

    async def prompt(self, req: StageRequest, inputs: StageInputs) -> tuple[list[int], object | None, float]:
        """The request's prompt token ids, its input rows where they are not the ids' embeddings (media), and
        the milliseconds spent making them beyond tokenizing."""
        return self.prompt_ids(req.params), None, 0.0

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        p = req.params
        ids, rows, encode_ms = await self.prompt(req, inputs)
        if not ids:
            raise InvalidRequest("params.prompt", "encodes to no tokens")
        if any(t >= self.vocab for t in ids):
            raise InvalidRequest("params.prompt_token_ids", f"token ids must be < {self.vocab}")
        if self.max_len:
            check_context(p, len(ids), self.max_len)
        # Its last token is never fed, so its cache holds at most prompt + max_tokens - 1 tokens.
        refused = self.kv_refusal("params.text.max_tokens", f"prompt ({len(ids)} tokens) plus max_tokens "
                                  f"({p.max_tokens})", len(ids) + p.max_tokens - 1)
        if refused is not None:
            raise refused
        st = self.new_state(ids, p)
        st.prompt_rows, rows = rows, None  # the state drops them once fed
        marks = self.chunk_marks(ids, p)
        deltas = self.text_deltas(p)
        chunks = Chunking(self.stage)
        generated: list[int] = []
        tokens: list[int] = []
        extra: dict[str, list[torch.Tensor]] = {}
        compute_before = 0.0
        async with self.scheduler.submit(req.request_id, st) as stream:
            async for step in stream:
                for name, t in self.step_tensors(step).items():
                    extra.setdefault(name, []).append(t)
                if step.token is None:  # a piece of a long prompt prefilled: its rows kept, no token yet
                    continue
                generated.append(step.token)
                tokens.append(step.token)
                done = step.finish_reason is not None
                if chunks.due(1, done):
                    out = {"token_ids": torch.tensor(tokens, dtype=torch.int64),
                           **{name: torch.cat(ts) for name, ts in extra.items()}}
                    if chunks.first:
                        out["prompt_token_ids"] = torch.tensor(ids, dtype=torch.int64)
                    if marks is not None and "embeds" in out:
                        out["spoken"] = marks.marks(len(out["embeds"]), generated)
                    yield chunks.hand_on(OutputChunk(tensors=out, text=deltas.delta(generated, done), last=done,
                                                     finish_reason=step.finish_reason or "",
                                                     compute_ms=stream.compute_ms - compute_before),
                                         queue_ms=stream.queue_ms, encode_ms=encode_ms)
                    tokens, extra, compute_before = [], {}, stream.compute_ms
