"""What every omni Talker stage shares: taking the Thinker's rows as they stream in.

A Talker's prompt needs the Thinker's rows of every prompt position and of its first generated token;
after that, its decode step k speaks the Thinker row of generated token k+1, then (once the Thinker
has ended) an end-of-text row once, then pad rows. So a request joins the batch once its prompt rows
are in, a feeder task appends each later Thinker chunk to the state's inbox, and the state takes a
step only when the row that step speaks has arrived (`FedTalkerState.ready`). The families differ in
what a row is (Qwen3-Omni: the projected embedding; Qwen2.5-Omni: hidden state plus embedding) and in
how a step turns it into codec codes; both plug into `FedTalkerEngine`, their states into `FedTalkerState`.

Under a KV budget (`kv_budget.py`) a state keeps every row it fed (its prompt rows, then one row per step:
much smaller than the keys and values they make), so a preempted state's next step feeds them again
before its new row and goes on as it would have (its codec tokens, last hidden row and generator kept).
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import torch

from stage_service.engines.omni.inbox import END_OF_TEXT, inbox_ended, speaks_next, step_rows
from stage_service.engines.omni.talker_core import RemoteTalker, TalkerCore, talker_kv_per_token
from stage_service.engines.transformers.causal_lm import text_sampling
from stage_service.runtime import device
from stage_service.runtime.base import (
    Chunking,
    InputChunk,
    InputError,
    OutputChunk,
    StageInputs,
    StageRequest,
    SteppedEngine,
    tensor,
)
from stage_service.runtime.kv_budget import KvPages
from stage_service.runtime.packed import SequenceKV
from stage_service.runtime.quantize import quantize_weights
from stage_service.runtime.sampling import SamplingSettings
from stage_service.runtime.scheduler import StepState


@dataclass(eq=False, kw_only=True)
class FedTalkerState(StepState):
    """A Talker request fed by the Thinker. `steps` counts steps taken; step 0 prefills the prompt and
    step s >= 1 speaks text row s - 1 of the rows that followed the first generated token."""

    sampling: SamplingSettings
    max_frames: int
    generator: torch.Generator | None
    speaker: str
    prompt: Any  # what the first step prefills, in the family's form; None once it has
    # Thinker rows [n, H] appended by the engine as they arrive (END_OF_TEXT last); a deque, because the
    # engine appends while a step on the worker thread may be draining it.
    inbox: deque = field(default_factory=deque)
    trailing: list[torch.Tensor] = field(default_factory=list)  # text rows taken from the inbox, in order
    text_done: bool = False
    end_spoken: bool = False  # the end-of-text row has been fed (once, after the last Thinker row)
    steps: int = 0
    kv: SequenceKV = field(default_factory=SequenceKV)
    tokens: list[int] = field(default_factory=list)  # codec tokens chosen so far
    finish_reason: str | None = None
    finished: bool = False
    # Under a KV budget: how its cache is sized, at most how many rows its first step feeds, and every row
    # fed so far (to recompute the cache after a preemption).
    kv_pages: KvPages | None = None
    kv_rows: int = 0
    fed: list[torch.Tensor] = field(default_factory=list)

    @property
    def cost(self) -> int:
        """Rows its next step feeds (against engineArgs.max_num_batched_tokens)."""
        return step_rows(self.steps, self.kv_rows, self.kv_pages is not None and self.kv.length() == 0)

    def bound_kv(self, pages: KvPages, prompt_rows: int) -> None:
        """Size its cache by `pages` and keep what it feeds, so that it can be preempted."""
        self.kv_pages, self.kv_rows, self.kv = pages, prompt_rows, SequenceKV(pages.page)

    @property
    def preemptible(self) -> bool:
        return self.kv_pages is not None

    def kv_bytes(self) -> int:
        return self.kv.nbytes

    def kv_bytes_next(self) -> int:
        # after step s + 1 its cache holds the prompt rows and one row per step after the first
        return 0 if self.kv_pages is None else self.kv_pages.bytes_for(self.kv_rows + self.steps)

    def preempt(self) -> None:
        self.kv.clear()

    def unfed(self, rows: torch.Tensor) -> torch.Tensor:
        """What this step feeds the model: `rows`, after every row fed before if its cache was dropped."""
        if self.kv_pages is None:
            return rows
        out = torch.cat([*self.fed, rows]) if self.fed and self.kv.length() == 0 else rows
        self.fed.append(rows)
        return out

    def ready(self) -> bool:
        """The next step can run: it is the first, or the text row it speaks (or the end of text) is in."""
        return speaks_next(self.steps, len(self.trailing), self.inbox, self.text_done)

    def text_ended(self) -> bool:
        return inbox_ended(self.inbox)

    def take_inbox(self, project: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Move the rows that arrived since the last step to `trailing` (through `project` if given)."""
        rows = []
        while self.inbox:
            x = self.inbox.popleft()
            if x is END_OF_TEXT:
                self.text_done = True
            elif len(x):
                rows.append(x)
        if rows:
            joined = torch.cat(rows)
            self.trailing.extend((project(joined) if project else joined).unbind(0))

    def text_row(self, end_of_text: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """The text row the coming decode step speaks: the next Thinker row, then end-of-text once, then pad."""
        k = self.steps - 1
        if k < len(self.trailing):
            return self.trailing[k]
        if self.text_done and not self.end_spoken:  # a step past the rows runs only once the text ended
            self.end_spoken = True
            return end_of_text
        return pad

    def held_bytes(self) -> int:
        rows = [*self.trailing, *(x for x in list(self.inbox) if x is not END_OF_TEXT), *self.fed]
        return self.kv.nbytes + sum(t.nbytes for t in rows)

    def release(self) -> None:
        self.kv.clear()
        self.trailing.clear()
        self.inbox.clear()
        self.fed.clear()
        self.prompt = None


class ThinkerFeed:
    """What has arrived from the Thinker for one request before its Talker prompt can be built; its rows
    go through `move` (to the Talker's device) as they arrive."""

    def __init__(self, move: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        self.move = move
        self.prompt_ids: list[int] | None = None
        self.embeds: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.spoken: list[torch.Tensor] = []  # which rows are spoken (all, unless the Thinker marks them)
        self.n_rows = 0
        self.ended = False

    @staticmethod
    def rows_of(chunk: InputChunk) -> tuple[torch.Tensor, torch.Tensor]:
        emb = tensor(chunk, "embeds")
        hid = tensor(chunk, "hidden")
        if emb.dim() != 2 or hid.shape != emb.shape:
            raise InputError(f"Thinker chunk {chunk.chunk_id}: embeds {list(emb.shape)} and hidden "
                             f"{list(hid.shape)} must both be [positions, hidden_size]")
        return emb, hid

    @staticmethod
    def spoken_of(chunk: InputChunk, rows: int) -> torch.Tensor:
        """The chunk's `spoken` mask (the Thinker marks a tool call's rows unspoken): all rows without one."""
        mask = chunk.tensors.get("spoken")
        if mask is None:
            return torch.ones(rows, dtype=torch.bool)
        if mask.shape != (rows,):
            raise InputError(f"Thinker chunk {chunk.chunk_id}: spoken {list(mask.shape)} for {rows} rows")
        return mask.to("cpu", torch.bool)

    @classmethod
    def spoken_rows_of(cls, chunk: InputChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """A later chunk's rows the Talker speaks."""
        emb, hid = cls.rows_of(chunk)
        keep = cls.spoken_of(chunk, len(emb))
        return (emb, hid) if bool(keep.all()) else (emb[keep.to(emb.device)], hid[keep.to(hid.device)])

    def absorb(self, chunk: InputChunk | None) -> None:
        if chunk is None:
            self.ended = True
            return
        if chunk.chunk_id == 0:
            self.prompt_ids = tensor(chunk, "prompt_token_ids").cpu().tolist()
        emb, hid = self.rows_of(chunk)
        self.spoken.append(self.spoken_of(chunk, len(emb)))
        self.embeds.append(self.move(emb))
        self.hidden.append(self.move(hid))
        self.n_rows += len(emb)
        if chunk.end_of_stream:
            self.ended = True

    def _spoken_after_prompt(self) -> int:
        """Spoken rows beyond the prompt so far (a leading tool call's rows are not spoken: read past them)."""
        n = len(self.prompt_ids or ())
        return int(torch.cat(self.spoken)[n:].sum()) if self.n_rows > n else 0

    async def read_prompt(self, inputs: StageInputs) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Read until every prompt row and the first spoken generated token's row are in (or the stream ended);
        returns the prompt ids and every row so far that is spoken (embeds, hidden), the prompt's first: at
        least one per prompt position."""
        while not self.ended and (self.prompt_ids is None or self._spoken_after_prompt() == 0):
            self.absorb(await inputs.next())
        if self.prompt_ids is None:
            raise InputError("the Thinker's stream ended before it sent its prompt rows")
        embeds, hidden, spoken = torch.cat(self.embeds), torch.cat(self.hidden), torch.cat(self.spoken)
        if len(embeds) < len(self.prompt_ids):
            raise InputError(f"the Thinker sent {len(embeds)} rows for a prompt of {len(self.prompt_ids)} tokens")
        if not bool(spoken.all()):  # prompt rows are always spoken: the answer's rows of a tool call go
            keep = spoken.to(embeds.device)
            embeds, hidden = embeds[keep], hidden[keep]
        self.embeds, self.hidden, self.spoken = [], [], []
        return self.prompt_ids, embeds, hidden


class FedTalkerEngine(SteppedEngine):
    """A Talker stage on the step scheduler that consumes the Thinker's rows as they arrive and emits
    `codes` [groups, frames] every `chunkSize` frames (the first chunk at `initialChunkSize` when set).

    A family's `load` sets `self.talker`, with `model` (the module `quantization` quantizes), `groups` (codes
    per frame), `check_speaker(speaker)`,
    `new_state(prompt_ids, embeds, hidden, sampling, max_frames, speaker)` (the state whose first step
    prefills the prompt: `embeds`/`hidden` hold the rows of every prompt position, then, when the Thinker
    generated more than one token, the first generated token's row) and `step_batch(states)` (each result
    has `frame`, a list of `groups` codes or None, and `finish_reason`); the family names its
    `REPETITION_PENALTY` and what a later Thinker chunk adds to a state's inbox (`spoken_rows`)."""

    unit = "frames"
    REPETITION_PENALTY: float
    ENGINE_PROCESS = True
    KV_BUDGET = True
    TOKEN_BUDGET = True  # engineArgs.max_num_batched_tokens

    def load(self) -> None:
        if self.options.engine_process:  # the family's Talker in a process of its own (talker_core.py)

            info = self.start_core(TalkerCore, (type(self), str(self.model_dir), self.placement, self.batch_invariant,
                                                self.settings.quantization, self.stage.name, self.kv_paged))
            self.talker = RemoteTalker(self.core, info)
            self.bound_kv(info["kv_per_token"], info["weights_bytes"], info["gpu_bytes"])
            return
        self.talker = self.build_talker(self.model_dir, self.dtype, self.batch_invariant, self.device)
        quantize_weights(self.talker.model, self.settings.quantization, self.stage.name)
        self.checkpoint = self.talker.checkpoint
        # the weights on the device: the talker's, and the encoders a voice-cloning talker keeps beside them
        resident = [self.talker.model, *getattr(self.talker, "encoders", ())]
        self.bound_kv(talker_kv_per_token(self.talker, self.dtype), sum(map(device.weights_bytes, resident)),
                      device.gpu_bytes(self.device))

    @staticmethod
    @abstractmethod
    def build_talker(model_dir, dtype: torch.dtype, batch_invariant: bool, device):
        """The family's Talker (blocking; in the stage process, or in its engine process)."""

    def step(self, states: list[FedTalkerState]) -> list:
        return self.talker.step_batch(states)

    @abstractmethod
    def spoken_rows(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """What a later Thinker chunk's rows add to a state's inbox."""

    def refuse_kv(self, prompt: str, prompt_rows: int, frames: int) -> None:
        """InvalidRequest (naming max_codec_frames) where a prompt of `prompt_rows` rows and `frames` frames could
        never fit the stage's KV budget."""
        refused = self.kv_refusal("params.audio.max_codec_frames", f"{prompt} plus max_codec_frames ({frames})",
                                  prompt_rows + frames)
        if refused is not None:
            raise refused

    def seat(self, st: FedTalkerState, prompt_rows: int) -> None:
        """A new state's KV accounting: what its first step feeds, at most (a step's cost), bound to the budget."""
        st.kv_rows = prompt_rows
        if self.kv_pages is not None:
            st.bound_kv(self.kv_pages, prompt_rows)

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        p = req.params
        self.talker.check_speaker(p.speaker)  # before reading any input
        feed = ThinkerFeed(self.on_device)
        prompt_ids, embeds, hidden = await feed.read_prompt(inputs)
        n = len(prompt_ids)
        prompt_rows = n + self.talker.prompt_rows_beyond_ids  # at most what its first step feeds
        self.refuse_kv(f"a prompt of {n} Thinker rows", prompt_rows, p.max_codec_frames)
        st = self.talker.new_state(prompt_ids, embeds[:n + 1], hidden[:n + 1],
                                   text_sampling(p, self.REPETITION_PENALTY), p.max_codec_frames, p.speaker)
        self.seat(st, prompt_rows)
        st.inbox.append(self.spoken_rows(embeds[n + 1:], hidden[n + 1:]))
        if feed.ended:
            st.inbox.append(END_OF_TEXT)
        del embeds, hidden
        async for chunk in self.speak(req, st, inputs):
            yield chunk

    async def speak(self, req: StageRequest, st: FedTalkerState, inputs: StageInputs,
                    context: torch.Tensor | None = None) -> AsyncIterator[OutputChunk]:
        """Step `st` on the scheduler and emit its `codes` chunk by chunk; the text still to come (unless its
        inbox already holds the end of text) is read from `inputs` as it arrives. `context`: codes [groups, n]
        the first chunk carries as `context_codes` (frames the decoder decodes before it, emitting none)."""
        frames: list[list[int]] = []
        chunks, compute_before = Chunking(self.stage), 0.0  # the first chunk may be the smaller one
        async with self.scheduler.submit(req.request_id, st) as stream:
            feeder = None if st.text_ended() else asyncio.create_task(self._feed(inputs, st, stream))
            try:
                async for step in stream:
                    if step.frame is not None:
                        frames.append(step.frame)
                    done = step.finish_reason is not None
                    if chunks.due(int(step.frame is not None), done):
                        codes = torch.tensor(frames, dtype=torch.int64).T if frames else torch.empty(
                            (self.talker.groups, 0), dtype=torch.int64)
                        sent = {"codes": codes.contiguous()}
                        if context is not None:
                            sent["context_codes"], context = context, None
                        yield chunks.hand_on(OutputChunk(tensors=sent, last=done,
                                                         finish_reason=step.finish_reason or "",
                                                         compute_ms=stream.compute_ms - compute_before),
                                             queue_ms=stream.queue_ms)
                        frames, compute_before = [], stream.compute_ms
            finally:
                if feeder is not None:
                    feeder.cancel()
                    with contextlib.suppress(BaseException):
                        await feeder

    async def _feed(self, inputs: StageInputs, st: FedTalkerState, stream) -> None:
        """Hand the Thinker's later rows to the state as they arrive; a bad chunk fails the request."""
        try:
            while (chunk := await inputs.next()) is not None:
                st.inbox.append(self.spoken_rows(*map(self.on_device, ThinkerFeed.spoken_rows_of(chunk))))
                self.scheduler.notify(st)
                if chunk.end_of_stream:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the request's reader
            stream.fail(e)
            return
        st.inbox.append(END_OF_TEXT)
        self.scheduler.notify(st)
