"""Qwen3-Omni stages on transformers: Thinker (text + hidden states), Talker (codec frames),
Code2Wav (PCM audio). Async adapters over the batched step functions in qwen3_omni_steps,
each on the shared step scheduler."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import torch

from omnistage.params import RequestParams
from omnistage.spec import engines

from .base import InputError, OutputChunk, StageInputs, StageRequest, SteppedEngine, tensor
from .hf_causal import CausalLmEngine, text_sampling
from .qwen3_omni_steps import END_OF_TEXT, Code2Wav, Talker, TalkerState, Thinker, ThinkerStep, to_pcm16


class ThinkerEngine(CausalLmEngine):
    """Emits per chunk: `token_ids` (new tokens), `embeds` and `hidden` (rows of every position fed),
    `prompt_token_ids` on the first chunk, and the text delta."""

    ADAPTER = engines.QWEN3_OMNI_THINKER

    def load(self) -> None:
        self.thinker = Thinker(self.model_dir, self.dtype, batch_invariant=self.options.batch_invariant)
        self.vocab = self.thinker.vocab
        self.max_len = self.options.max_model_len
        self.stop_ids = frozenset({self.thinker.im_end, 151643})

    def step(self, states) -> list[ThinkerStep]:
        return self.thinker.step_thinker(states)

    def prompt_ids(self, p: RequestParams) -> list[int]:
        return list(p.prompt_token_ids) or self.thinker.chat_prompt(p.prompt)

    def new_state(self, ids, p: RequestParams):
        return self.thinker.new_thinker_state(ids, text_sampling(p), p.max_tokens, p.ignore_eos)

    def decode(self, tokens: list[int]) -> str:
        return self.thinker.tokenizer.decode([t for t in tokens if t not in self.stop_ids])

    def step_tensors(self, step: ThinkerStep) -> dict[str, torch.Tensor]:
        return {"embeds": step.embeds, "hidden": step.hidden}


class TalkerEngine(SteppedEngine):
    ADAPTER = engines.QWEN3_OMNI_TALKER
    """Consumes the Thinker's rows as they arrive; emits `codes` [groups, frames] per chunk.

    A request joins the batch once the Thinker's prompt rows and first token are in; after that a
    feeder task hands each later Thinker chunk to its state, and the state takes a step only when
    the text row that step speaks has arrived.
    """

    REPETITION_PENALTY = 1.05  # as Qwen3-Omni's generate()
    unit = "frames"

    def load(self) -> None:
        self.talker = Talker(self.model_dir, self.dtype, batch_invariant=self.options.batch_invariant)

    def step(self, states: list[TalkerState]) -> list:
        return self.talker.step_batch(states)

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        p = req.params
        self.talker.check_speaker(p.speaker)
        feed = _ThinkerFeed()
        # The talker prompt needs every prompt row plus the first generated token's row.
        while not feed.ended and (feed.prompt_ids is None or feed.n_rows <= len(feed.prompt_ids)):
            feed.absorb(await inputs.next())
        if feed.prompt_ids is None:
            raise InputError("the Thinker's stream ended before it sent its prompt rows")
        n = len(feed.prompt_ids)
        embeds, hidden = torch.cat(feed.embeds), torch.cat(feed.hidden)
        if len(embeds) < n:
            raise InputError(f"the Thinker sent {len(embeds)} rows for a prompt of {n} tokens")
        first_row = embeds[n] if len(embeds) > n else torch.zeros_like(embeds[0])  # one token: nothing fed back
        st = self.talker.new_state(feed.prompt_ids, embeds[:n], hidden[:n], first_row,
                                   text_sampling(p, self.REPETITION_PENALTY), p.max_codec_frames, p.speaker)
        st.inbox.append(embeds[n + 1:])
        if feed.ended:
            st.inbox.append(END_OF_TEXT)
        del feed, embeds, hidden
        every = self.stage.chunk_size
        frames: list[list[int]] = []
        first, compute_before = True, 0.0
        async with self.scheduler.submit(req.request_id, st) as stream:
            feeder = None if st.text_ended() else asyncio.create_task(self._feed(inputs, st, stream))
            try:
                async for step in stream:
                    if step.frame is not None:
                        frames.append(step.frame)
                    done = step.finish_reason is not None
                    if frames and (done or (every and len(frames) >= every)) or (done and first):
                        codes = torch.tensor(frames, dtype=torch.int64).T if frames else torch.empty(
                            (self.talker.groups, 0), dtype=torch.int64)
                        yield OutputChunk(tensors={"codes": codes.contiguous()}, last=done,
                                          finish_reason=step.finish_reason or "",
                                          queue_ms=stream.queue_ms if first else 0.0,
                                          compute_ms=stream.compute_ms - compute_before)
                        first, frames, compute_before = False, [], stream.compute_ms
            finally:
                if feeder is not None:
                    feeder.cancel()
                    with contextlib.suppress(BaseException):
                        await feeder

    async def _feed(self, inputs: StageInputs, st: TalkerState, stream) -> None:
        """Hand the Thinker's later rows to the state as they arrive; a bad chunk fails the request."""
        try:
            while (chunk := await inputs.next()) is not None:
                st.inbox.append(_ThinkerFeed.rows_of(chunk)[0])
                self.scheduler.notify()
                if chunk.end_of_stream:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the request's reader
            stream.fail(e)
            return
        st.inbox.append(END_OF_TEXT)
        self.scheduler.notify()


class _ThinkerFeed:
    """What has arrived from the Thinker for one request before its talker prompt can be built."""

    def __init__(self):
        self.prompt_ids: list[int] | None = None
        self.embeds: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.n_rows = 0
        self.ended = False

    @staticmethod
    def rows_of(chunk) -> tuple[torch.Tensor, torch.Tensor]:
        emb = tensor(chunk, "embeds")
        hid = tensor(chunk, "hidden")
        if emb.dim() != 2 or hid.shape != emb.shape:
            raise InputError(f"Thinker chunk {chunk.chunk_id}: embeds {list(emb.shape)} and hidden "
                             f"{list(hid.shape)} must both be [positions, hidden_size]")
        return emb, hid

    def absorb(self, chunk) -> None:
        if chunk is None:
            self.ended = True
            return
        if chunk.chunk_id == 0:
            self.prompt_ids = tensor(chunk, "prompt_token_ids").tolist()
        emb, hid = self.rows_of(chunk)
        self.embeds.append(emb)
        self.hidden.append(hid)
        self.n_rows += len(emb)
        if chunk.end_of_stream:
            self.ended = True


class Code2WavEngine(SteppedEngine):
    ADAPTER = engines.QWEN3_OMNI_CODE2WAV
    """Decodes each incoming chunk of codec frames (with left context) into int16 PCM as it arrives;
    chunks of equal length from many requests share one forward, up to `max_batched_frames`.

    On a CPU the decoder is bound by memory traffic (each frame becomes 1920 samples through wide
    upsampling convolutions): beyond about 100 frames a forward gets slower per frame, so that is the
    CPU default; on a GPU the default is no bound.
    """

    unit = "chunks"
    CPU_MAX_BATCHED_FRAMES = 100

    def max_step_cost(self) -> int | None:
        if self.options.max_batched_frames is not None:
            return self.options.max_batched_frames
        return None if torch.cuda.is_available() else self.CPU_MAX_BATCHED_FRAMES

    def load(self) -> None:
        self.c2w = Code2Wav(self.model_dir, self.dtype, batch_invariant=self.options.batch_invariant)
        self.codebook = self.c2w.model.config.codebook_size

    def step(self, states) -> list[torch.Tensor]:
        return [to_pcm16(w) for w in self.c2w.decode_batch(states)]

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        history = torch.empty((self.c2w.groups, 0), dtype=torch.int64)
        admitted = False
        async for chunk in inputs.chunks():
            codes = tensor(chunk, "codes")
            if codes.dim() != 2 or codes.shape[0] != self.c2w.groups:
                raise InputError(f"codes must be [{self.c2w.groups}, frames], got {list(codes.shape)}")
            if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook):
                raise InputError(f"codes must lie in [0, {self.codebook})")
            pcm = torch.empty(0, dtype=torch.int16)
            queue_ms = compute_ms = 0.0
            if codes.shape[1]:
                # Later chunks of an admitted request skip the queue limit: refusing them would break a stream.
                async with self.scheduler.submit(req.request_id, self.c2w.chunk_state(history, codes),
                                                 admitted=admitted) as stream:
                    pcm = await stream.next()
                admitted = True
                queue_ms, compute_ms = stream.queue_ms, stream.compute_ms
                history = torch.cat([history, codes], dim=1)[:, -self.c2w.LEFT_CONTEXT:]
            yield OutputChunk(tensors={"audio": pcm}, sample_rate=self.c2w.sample_rate, last=chunk.end_of_stream,
                              queue_ms=queue_ms, compute_ms=compute_ms, transfer_ms=chunk.transfer_ms)
            if chunk.end_of_stream:
                return
        yield OutputChunk(tensors={"audio": torch.empty(0, dtype=torch.int16)},
                          sample_rate=self.c2w.sample_rate, last=True)
