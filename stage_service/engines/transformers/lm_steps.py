"""Token-by-token decoding of a transformers causal LM, stepped over a batch of sequences.

Each sequence joins with its prompt (prefilled in the step it joins), then feeds
its last token each step; it leaves when it stops or reaches its length. Every
sequence keeps its own KV cache and sampling generator, so its tokens do not
depend on what else shares the step. Blocking torch code, run on the engine's
worker thread.

Under a KV budget (`kv_budget.py`) a text-only state can be preempted: it drops its cache and keeps its
tokens and generator; its next step feeds every token its cache lacks (prompt and generated) and samples
on from the last, as it would have.

With a bound on a step's tokens (`engineArgs.max_num_batched_tokens`) a text prompt longer than the bound is
prefilled in pieces of that many tokens, one per step, sharing each step with the others' decoding: one long
prompt cannot stall a shared step. A piece that leaves tokens unfed samples nothing (its step's token is None).
A prompt with media rows is fed whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.checkpoints.plan import kv_bytes_per_token
from stage_service.runtime.errors import RequestFailed
from stage_service.runtime.invariance import MIN_MATMUL_ROWS, make_batch_invariant
from stage_service.runtime.kv_budget import KvPages
from stage_service.runtime.packed import SequenceKV, packed_forward, positions, use_packed_attention
from stage_service.runtime.per_request import alone
from stage_service.runtime.sampling import SamplingSettings, choose, new_generator
from stage_service.runtime.scheduler import StepState


@dataclass(eq=False)
class TokenState(StepState):
    prompt_ids: list[int]
    sampling: SamplingSettings
    max_tokens: int
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    kv: SequenceKV = field(default_factory=SequenceKV)
    # A prompt with media: its input rows and M-RoPE positions (omni_media.PromptRows), dropped once fed;
    # every later position is offset by its `rope_delta` (as the model's generate does).
    prompt_rows: object | None = None
    rope_delta: int = 0
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    finished: bool = False
    kv_pages: KvPages | None = None  # under a KV budget: how its cache is sized
    recompute: bool = False  # it may be preempted (text only: rows fed from elsewhere cannot be fed again)
    prefill_chunk: int = 0  # the most tokens one step feeds it (0: no bound): a longer prompt takes several

    def held_bytes(self) -> int:
        rows = self.prompt_rows
        return self.kv.nbytes + (0 if rows is None else rows.nbytes)

    def release(self) -> None:
        self.kv.clear()
        self.prompt_rows = None

    @property
    def preemptible(self) -> bool:
        return self.recompute and self.prompt_rows is None and not self.rope_delta

    def kv_bytes(self) -> int:
        return self.kv.nbytes

    def kv_bytes_next(self) -> int:
        return kv_reserve(self.kv_pages, len(self.prompt_ids), len(self.generated), self.max_tokens,
                          self.preemptible)

    def preempt(self) -> None:
        self.kv.clear()

    @property
    def cost(self) -> int:
        """Tokens its next step feeds (against engineArgs.max_num_batched_tokens): its prompt's rows or tokens
        when it joins, every token after a preemption, else one."""
        rows = self.prompt_rows
        return rows.embeds.shape[0] if rows is not None else len(self.unfed())

    def unfed(self) -> list[int]:
        """The tokens its next step feeds: those its cache lacks (the prompt when it joins, then its last
        token; after a preemption all), at most `prefill_chunk` of them."""
        fed = self.kv.length()
        if self.generated and fed == len(self.prompt_ids) + len(self.generated) - 1:
            return self.generated[-1:]
        todo = [*self.prompt_ids, *self.generated][fed:]
        return todo[:self.prefill_chunk] if self.prefill_chunk else todo

    def prefilled_by(self, fed: int) -> bool:
        """Whether feeding `fed` more tokens leaves none of its tokens unfed (it samples its next one)."""
        return self.kv.length() + fed >= len(self.prompt_ids) + len(self.generated)


def kv_reserve(pages: KvPages | None, prompt: int, generated: int, max_tokens: int, preemptible: bool) -> int:
    """KV bytes a sequence holds after its next step (which feeds it up to `prompt + generated` tokens); one that
    cannot be preempted reserves the most it will ever hold (its last token is never fed). 0 without pages."""
    if pages is None:
        return 0
    return pages.bytes_for(prompt + (generated if preemptible else max_tokens - 1))


@dataclass
class TokenStep:
    token: int | None  # None: the step fed a piece of the prompt and sampled nothing (chunked prefill)
    finish_reason: str | None
    rows: tuple[torch.Tensor, ...] | None  # when kept: each layer's hidden rows [n, H] of the positions fed


class DecoderLm:
    """A causal LM in the transformers layout (a decoder plus an output head), stepped in packed batches."""

    def __init__(self, model: torch.nn.Module, rope_axes: int = 0, keep_rows: bool = False,
                 batch_invariant: bool = True, paged: bool = False):
        self.model = model.eval()
        self.device = model.device  # where the model was loaded: every per-request tensor is made there
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.embed = model.get_input_embeddings()
        self.rope_axes = rope_axes
        self.keep_rows = keep_rows
        self.min_rows = MIN_MATMUL_ROWS if batch_invariant else 1
        # paged: under a KV budget, caches grow by pages whose bytes are known in advance (kv_budget.py)
        self.kv_per_token = kv_bytes_per_token(self.decoder.config.to_dict(), model.dtype.itemsize)
        self.kv_pages = KvPages(self.kv_per_token) if paged else None
        use_packed_attention(self.decoder)
        if batch_invariant:
            make_batch_invariant(model)

    def new_state(self, prompt_ids: list[int], sampling: SamplingSettings, max_tokens: int,
                  stop_ids: frozenset[int] = frozenset(), recompute: bool = False,
                  prefill_chunk: int = 0) -> TokenState:
        """A sequence's state; `recompute`: it may be preempted under a KV budget (text-only engines);
        `prefill_chunk`: the most tokens a step feeds it (0: no bound)."""
        pages = self.kv_pages
        return TokenState(prompt_ids=list(prompt_ids), sampling=sampling, max_tokens=max_tokens, stop_ids=stop_ids,
                          generator=None if sampling.greedy else new_generator(sampling.seed, self.device),
                          kv=SequenceKV(None if pages is None else pages.page, len(prompt_ids) + max_tokens),
                          kv_pages=pages,
                          recompute=recompute, prefill_chunk=prefill_chunk)

    @torch.inference_mode()
    def step_batch(self, states: list[TokenState]) -> list[TokenStep | RequestFailed]:
        """One step of every state: the prompt of those that just joined, the last token of the others; a
        state whose sampling fails gets its `RequestFailed` (per_request.py)."""
        inputs, pos, deep, fed = [], [], [], []  # fed: (input index, token ids) of the states fed tokens
        partial = set()  # indices of the states whose step feeds a piece of their prompt and samples nothing
        for st in states:
            mm, st.prompt_rows = st.prompt_rows, None
            if mm is None:
                todo = st.unfed()
                if not st.prefilled_by(len(todo)):
                    partial.add(len(inputs))
                fed.append((len(inputs), todo))
                inputs.append(None)
                pos.append(positions(st.kv.length() + st.rope_delta, 1, self.rope_axes, self.device)
                           if st.rope_delta else None)
                deep.append(None)
            else:
                inputs.append(mm.embeds)
                pos.append(mm.positions)
                deep.append((mm.visual_mask, mm.deepstack) if mm.deepstack else None)
                st.rope_delta = mm.rope_delta
        if fed:  # one lookup for all: an embedding row is a copy, the same in any batch
            ids = torch.tensor([t for _, x in fed for t in x], device=self.device)
            for (i, _), emb in zip(fed, self.embed(ids).split([len(x) for _, x in fed])):
                inputs[i] = emb
        last, rows = packed_forward(self.decoder, inputs, [st.kv for st in states], self.rope_axes,
                                    hidden_states=self.keep_rows, min_rows=self.min_rows, position_ids=pos,
                                    deepstack=deep)
        logits = self.head(last)
        return [TokenStep(None, None, rows[i] if rows else None) if i in partial else
                alone(st, self._sampled, st, logits[i], rows[i] if rows else None) for i, st in enumerate(states)]

    @staticmethod
    def _sampled(st: TokenState, logits: torch.Tensor, rows: tuple[torch.Tensor, ...] | None) -> TokenStep:
        """The state's own part of a step: its next token, chosen with its settings and generator."""
        token = next_token(st, logits, st.generated, st.stop_ids, st.max_tokens)
        return TokenStep(token, st.finish_reason, rows)


def next_token(st, logits: torch.Tensor, tokens: list[int], stop_ids, limit: int) -> int:
    """Choose the next token of `st` (a state with `sampling`, `generator` and `finish_reason`) from
    `logits` and append it to `tokens`; the state finishes on a stop id ("stop") or once `tokens` holds
    `limit` ("length")."""
    token = choose(logits, st.sampling, st.generator)
    tokens.append(token)
    st.finish_reason = "stop" if token in stop_ids else "length" if len(tokens) >= limit else None
    st.finished = st.finish_reason is not None
    return token
