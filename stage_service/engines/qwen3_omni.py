"""Qwen3-Omni stages on transformers: Thinker (text + hidden states), Talker (codec frames),
Code2Wav (PCM audio). Async adapters over the step functions in qwen3_omni_steps."""

from __future__ import annotations

from typing import AsyncIterator

import torch

from omnistage.params import InvalidRequest, RequestParams

from .base import InputError, OutputChunk, SerialEngine, StageInputs, StageRequest, tensor
from .qwen3_omni_steps import Code2Wav, Talker, Thinker, to_pcm16
from .sampling import SamplingSettings


def text_sampling(p: RequestParams, repetition_penalty: float = 1.0) -> SamplingSettings:
    return SamplingSettings(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                            repetition_penalty=repetition_penalty)


class TextDeltas:
    """Incremental detokenization: emit only text that will not change when more tokens arrive."""

    def __init__(self, decode):
        self._decode = decode
        self._sent = ""

    def delta(self, tokens: list[int], final: bool) -> str:
        text = self._decode(tokens)
        if not final and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its bytes
            return ""
        out, self._sent = text[len(self._sent):], text
        return out


class ThinkerEngine(SerialEngine):
    """Emits per chunk: `token_ids` (new tokens), `embeds` and `hidden` (rows of every position fed),
    `prompt_token_ids` on the first chunk, and the text delta."""

    def load(self) -> None:
        self.thinker = Thinker(self.model_dir, self.dtype)
        self.vocab = self.thinker.model.config.text_config.vocab_size

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        p = req.params
        ids = list(p.prompt_token_ids) or self.thinker.chat_prompt(p.prompt)
        if any(t >= self.vocab for t in ids):
            raise InvalidRequest("params.prompt_token_ids", f"token ids must be < {self.vocab}")
        async with self.slot() as queue_ms:
            st = self.thinker.new_state(ids, text_sampling(p), p.max_tokens, p.ignore_eos)
            deltas = TextDeltas(lambda toks: self.thinker.tokenizer.decode(
                [t for t in toks if t not in st.stop_ids]))
            chunk = self.stage.chunk_size
            tokens: list[int] = []
            embeds: list[torch.Tensor] = []
            hidden: list[torch.Tensor] = []
            compute = 0.0
            first = True
            while st.finish_reason is None:
                step, ms = await self.run(self.thinker.step, st)
                compute += ms
                tokens.append(step.token)
                embeds.append(step.embeds)
                hidden.append(step.hidden)
                done = st.finish_reason is not None
                if done or (chunk and len(tokens) >= chunk):
                    out = {"token_ids": torch.tensor(tokens, dtype=torch.int64),
                           "embeds": torch.cat(embeds), "hidden": torch.cat(hidden)}
                    if first:
                        out["prompt_token_ids"] = torch.tensor(ids, dtype=torch.int64)
                    yield OutputChunk(tensors=out, text=deltas.delta(st.generated, done), last=done,
                                      finish_reason=st.finish_reason or "", queue_ms=queue_ms if first else 0.0,
                                      compute_ms=compute)
                    first = False
                    tokens, embeds, hidden, compute = [], [], [], 0.0


class TalkerEngine(SerialEngine):
    """Consumes the Thinker's rows as they arrive; emits `codes` [groups, frames] per chunk."""

    REPETITION_PENALTY = 1.05  # as Qwen3-Omni's generate()

    def load(self) -> None:
        self.talker = Talker(self.model_dir, self.dtype)

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        p = req.params
        async with self.slot() as queue_ms:
            feed = _ThinkerFeed()
            # The talker prompt needs every prompt row plus the first generated token's row.
            while not feed.ended and (feed.prompt_ids is None or len(feed.rows) <= len(feed.prompt_ids)):
                feed.absorb(await inputs.next())
            if feed.prompt_ids is None:
                raise InputError("the Thinker's stream ended before it sent its prompt rows")
            n_prompt = len(feed.prompt_ids)
            embeds = torch.cat(feed.rows) if feed.rows else torch.empty(0)
            first_row = embeds[n_prompt] if len(embeds) > n_prompt else None
            sampling = text_sampling(p, self.REPETITION_PENALTY)
            st, ms = await self.run(self._new_state, feed, embeds, first_row, sampling, p)
            consumed = n_prompt + 1
            chunk = self.stage.chunk_size
            frames: list[list[int]] = []
            compute = ms
            first = True
            while st.finish_reason is None:
                while self.talker.needs_text(st):
                    feed.absorb(await inputs.next())
                    new = feed.rows_from(consumed)
                    consumed += len(new)
                    if len(new):
                        self.talker.add_text(st, new)
                    st.text_done = feed.ended
                frame, ms = await self.run(self.talker.step, st)
                compute += ms
                if frame is not None:
                    frames.append(frame)
                done = st.finish_reason is not None
                if frames and (done or (chunk and len(frames) >= chunk)) or (done and first):
                    codes = torch.tensor(frames, dtype=torch.int64).T if frames else torch.empty(
                        (self.talker.groups, 0), dtype=torch.int64)
                    yield OutputChunk(tensors={"codes": codes.contiguous()}, last=done,
                                      finish_reason=st.finish_reason or "", queue_ms=queue_ms if first else 0.0,
                                      compute_ms=compute)
                    first = False
                    frames, compute = [], 0.0

    def _new_state(self, feed, embeds, first_row, sampling, p: RequestParams):
        hidden = torch.cat(feed.hidden)[: len(feed.prompt_ids)]
        if first_row is None:  # the Thinker produced a single token: nothing of it was fed back
            first_row = torch.zeros_like(embeds[0])
        st = self.talker.new_state(feed.prompt_ids, embeds[: len(feed.prompt_ids)], hidden, first_row, sampling,
                                   p.max_codec_frames, p.speaker)
        rest = embeds[len(feed.prompt_ids) + 1:]
        if len(rest):
            self.talker.add_text(st, rest)
        st.text_done = feed.ended
        return st


class _ThinkerFeed:
    """What has arrived from the Thinker so far for one request."""

    def __init__(self):
        self.prompt_ids: list[int] | None = None
        self.rows: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.n_rows = 0
        self.ended = False

    def absorb(self, chunk) -> None:
        if chunk is None:
            self.ended = True
            return
        if chunk.chunk_id == 0:
            self.prompt_ids = tensor(chunk, "prompt_token_ids").tolist()
        emb = tensor(chunk, "embeds")
        hid = tensor(chunk, "hidden")
        if emb.dim() != 2 or hid.shape != emb.shape:
            raise InputError(f"Thinker chunk {chunk.chunk_id}: embeds {list(emb.shape)} and hidden "
                             f"{list(hid.shape)} must both be [positions, hidden_size]")
        self.rows.append(emb)
        self.hidden.append(hid)
        self.n_rows += len(emb)
        if chunk.end_of_stream:
            self.ended = True

    def rows_from(self, start: int) -> torch.Tensor:
        if start >= self.n_rows:
            return torch.empty(0)
        return torch.cat(self.rows)[start:]


class Code2WavEngine(SerialEngine):
    """Decodes each incoming chunk of codec frames (with left context) into int16 PCM as it arrives."""

    def load(self) -> None:
        self.c2w = Code2Wav(self.model_dir, self.dtype)
        self.codebook = self.c2w.model.config.codebook_size

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        async with self.slot() as queue_ms:
            history = torch.empty((self.c2w.groups, 0), dtype=torch.int64)
            first = True
            async for chunk in inputs.chunks():
                codes = tensor(chunk, "codes")
                if codes.dim() != 2 or codes.shape[0] != self.c2w.groups:
                    raise InputError(f"codes must be [{self.c2w.groups}, frames], got {list(codes.shape)}")
                if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook):
                    raise InputError(f"codes must lie in [0, {self.codebook})")
                pcm = torch.empty(0, dtype=torch.int16)
                ms = 0.0
                if codes.shape[1]:
                    wav, ms = await self.run(self.c2w.decode, history, codes)
                    pcm = to_pcm16(wav)
                    history = torch.cat([history, codes], dim=1)[:, -self.c2w.LEFT_CONTEXT:]
                yield OutputChunk(tensors={"audio": pcm}, sample_rate=self.c2w.sample_rate,
                                  last=chunk.end_of_stream, queue_ms=queue_ms if first else 0.0, compute_ms=ms,
                                  transfer_ms=chunk.transfer_ms)
                first = False
                if chunk.end_of_stream:
                    return
            yield OutputChunk(tensors={"audio": torch.empty(0, dtype=torch.int16)},
                              sample_rate=self.c2w.sample_rate, last=True)
