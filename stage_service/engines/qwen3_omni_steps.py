"""Step-by-step Qwen3-Omni Thinker, Talker and Code2Wav on transformers' classes, over batches.

These compute what `Qwen3OmniMoeForConditionalGeneration.generate` computes,
but one decode step at a time, for a batch of requests at once, and across
process boundaries: the Thinker emits the embedding and hidden-state rows of
every position it feeds, and the Talker builds its prompt and per-step text
conditioning from those rows as they arrive, so it can start before the
Thinker has finished. Each request keeps its own KV cache and sampling
generator; with batch invariance on (`invariance.py`) a request's numbers do
not depend on what shares its step. Blocking torch code only; the async engine
adapters run it on their worker thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from omnistage.params import InvalidRequest

from ..scheduler import StepState
from .invariance import MIN_MATMUL_ROWS, MOE_EXPERTS, make_batch_invariant
from .lm_steps import DecoderLm, TokenState
from .packed import SequenceKV, packed_forward, use_packed_attention
from .sampling import SamplingSettings, apply_repetition_penalty, choose, new_generator


def _moe_kwargs(batch_invariant: bool) -> dict:
    return {"experts_implementation": MOE_EXPERTS} if batch_invariant else {}


# ------------------------------------------------------------------ Thinker

@dataclass
class ThinkerStep:
    token: int
    finish_reason: str | None
    embeds: torch.Tensor     # [n, H] input-embedding rows of the positions fed this step
    hidden: torch.Tensor     # [n, H] rows of the layer the Talker accepts


class Thinker(DecoderLm):
    ROPE_AXES = 3  # multimodal RoPE: text positions are equal on every axis

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, batch_invariant: bool = True):
        from transformers import PreTrainedTokenizerFast, Qwen3OmniMoeThinkerForConditionalGeneration

        model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
            model_dir, dtype=dtype, **_moe_kwargs(batch_invariant))
        super().__init__(model, rope_axes=self.ROPE_AXES, keep_rows=True, batch_invariant=batch_invariant)
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
        cfg = model.config
        self.accept_layer = 1  # overwritten by the Talker's config where known
        self.im_start = 151644
        self.im_end = 151645
        self.user_id = cfg.user_token_id if hasattr(cfg, "user_token_id") else 872
        self.assistant_id = 77091
        self.newline = self.tokenizer.convert_tokens_to_ids("\u010a")
        self.vocab = cfg.text_config.vocab_size

    def chat_prompt(self, text: str) -> list[int]:
        """`<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n` as token ids."""
        body = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ([self.im_start, self.user_id, self.newline] + body +
                [self.im_end, self.newline, self.im_start, self.assistant_id, self.newline])

    def new_thinker_state(self, prompt_ids: list[int], sampling: SamplingSettings, max_tokens: int,
                          ignore_eos: bool = False) -> TokenState:
        stop = frozenset() if ignore_eos else frozenset({self.im_end, 151643})
        return self.new_state(prompt_ids, sampling, max_tokens, stop)

    def step_thinker(self, states: list[TokenState]) -> list[ThinkerStep]:
        return [ThinkerStep(s.token, s.finish_reason, s.rows[0], s.rows[self.accept_layer])
                for s in self.step_batch(states)]

    def text_of(self, st: TokenState) -> str:
        ids = [t for t in st.generated if t not in st.stop_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


# ------------------------------------------------------------------- Talker

END_OF_TEXT = None  # in a TalkerState inbox: the Thinker's stream has ended


@dataclass(eq=False)
class TalkerState(StepState):
    sampling: SamplingSettings
    max_frames: int
    generator: torch.Generator | None
    speaker: str
    # (prompt ids, prompt embeds, prompt hidden, first generated token's embed row): the first step builds the prefill
    prompt: tuple | None
    # Thinker embedding rows [n, H] of later tokens, appended by the engine as they arrive (END_OF_TEXT last);
    # a deque, because the engine appends while a step on the worker thread may be draining it
    inbox: deque = field(default_factory=deque)
    kv: SequenceKV = field(default_factory=SequenceKV)
    trailing: list[torch.Tensor] = field(default_factory=list)  # projected text rows still to be spoken
    text_done: bool = False
    eos_sent: bool = False
    tokens: list[int] = field(default_factory=list)
    past_hidden: torch.Tensor | None = None
    steps: int = 0
    finish_reason: str | None = None
    finished: bool = False

    def ready(self) -> bool:
        """The next step can run: it is the first, or the text row it speaks (or the end of text) is in."""
        if self.steps == 0 or self.text_done or self.text_ended():
            return True
        arrived = sum(len(x) for x in list(self.inbox) if x is not END_OF_TEXT)
        return self.steps - 1 < len(self.trailing) + arrived

    def text_ended(self) -> bool:
        """The end of the Thinker's stream is in the inbox (compared by identity: the rest are tensors)."""
        return any(x is END_OF_TEXT for x in list(self.inbox))

    def held_bytes(self) -> int:
        rows = [*self.trailing, *(x for x in list(self.inbox) if x is not END_OF_TEXT)]
        return self.kv.nbytes + sum(t.nbytes for t in rows)

    def release(self) -> None:
        self.kv.clear()
        self.trailing.clear()
        self.inbox.clear()
        self.prompt = self.past_hidden = None


@dataclass
class TalkerStep:
    frame: list[int] | None  # the codes of one frame [groups], once one is complete
    finish_reason: str | None


class Talker:
    """Codec-token generation conditioned on the Thinker's rows (first code group by the talker,
    the residual groups by its code predictor), as transformers' generate does it, over a batch."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, batch_invariant: bool = True):
        from safetensors.torch import load_file
        from transformers import Qwen3OmniMoeTalkerForConditionalGeneration

        self.model = Qwen3OmniMoeTalkerForConditionalGeneration.from_pretrained(
            model_dir, dtype=dtype, **_moe_kwargs(batch_invariant)).eval()
        use_packed_attention(self.model.model)
        if batch_invariant:
            make_batch_invariant(self.model)
        self.min_rows = MIN_MATMUL_ROWS if batch_invariant else 1
        cfg = self.model.config
        self.cfg = cfg
        self.groups = cfg.num_code_groups
        self.eos = cfg.codec_eos_token_id
        vocab = cfg.text_config.vocab_size
        self.suppress = torch.tensor([i for i in range(vocab - 1024, vocab) if i != self.eos], dtype=torch.long)
        # The Thinker's embeddings of tts_bos / tts_eos / tts_pad, saved beside the talker at build time.
        special = load_file(str(Path(model_dir) / "tts_special_embeds.safetensors"))["embeds"].to(dtype)
        with torch.inference_mode():
            self.tts_bos, self.tts_eos, self.tts_pad = self.model.text_projection(special[None])[0].unbind(0)
        self.speakers = dict(cfg.speaker_id or {})

    def check_speaker(self, speaker: str) -> None:
        if speaker.lower() not in self.speakers:
            raise InvalidRequest("params.audio.speaker",
                                 f'unknown speaker "{speaker}" (known: {", ".join(sorted(self.speakers))})')

    def new_state(self, prompt_ids: list[int], prompt_embeds: torch.Tensor, prompt_hidden: torch.Tensor,
                  first_token_embed: torch.Tensor, sampling: SamplingSettings, max_frames: int,
                  speaker: str = "ethan") -> TalkerState:
        """A state whose first step builds the talker prompt from the Thinker's prompt rows and its first
        generated token's row."""
        self.check_speaker(speaker)
        return TalkerState(sampling=sampling, max_frames=max_frames, speaker=speaker.lower(),
                           generator=None if sampling.greedy else new_generator(sampling.seed),
                           prompt=(list(prompt_ids), prompt_embeds, prompt_hidden, first_token_embed))

    def _prefill(self, prompt_ids: list[int], prompt_embeds: torch.Tensor, prompt_hidden: torch.Tensor,
                 first_token_embed: torch.Tensor, speaker: str) -> torch.Tensor:
        """The talker prompt rows [P, H], as generate() builds them."""
        ids = torch.tensor(prompt_ids)
        starts = [i for i, t in enumerate(prompt_ids) if t == 151644]
        user = torch.zeros(len(prompt_ids), dtype=torch.bool)
        for s in starts:  # mark every position of each user turn, as generate() does
            if s + 1 < len(prompt_ids) and prompt_ids[s + 1] == 872:
                end = next((e for e in starts if e > s), len(prompt_ids))
                user[s:end] = True
        multimodal = (ids == 151646) | (ids == 151655) | (ids == 151656)
        proj = self.model.text_projection
        user_rows = torch.where(multimodal[:, None], self.model.hidden_projection(prompt_hidden), proj(prompt_embeds))
        user_part = user_rows[user]
        a = max(i for i in range(len(prompt_ids) - 1) if prompt_ids[i] == 151644 and prompt_ids[i + 1] == 77091)
        assistant = proj(torch.cat([prompt_embeds[a:a + 3], first_token_embed[None]]))
        pad, bos = self.tts_pad, self.tts_bos
        text_rows = torch.cat([assistant[:3], pad.expand(4, -1), bos[None], assistant[3:4]])
        c = self.cfg
        codec_ids = torch.tensor([c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id,
                                  self.speakers[speaker], c.codec_pad_id, c.codec_bos_id])
        codec_rows = torch.cat([torch.zeros(3, text_rows.shape[1], dtype=text_rows.dtype),
                                self.model.get_input_embeddings()(codec_ids)])
        return torch.cat([user_part, text_rows + codec_rows])

    def _take_inbox(self, st: TalkerState) -> None:
        """Project the Thinker rows that arrived since the last step into rows to be spoken."""
        rows = []
        while st.inbox:
            x = st.inbox.popleft()
            if x is END_OF_TEXT:
                st.text_done = True
            elif len(x):
                rows.append(x)
        if rows:
            st.trailing.extend(self.model.text_projection(torch.cat(rows)).unbind(0))

    @torch.inference_mode()
    def step_batch(self, states: list[TalkerState]) -> list[TalkerStep]:
        """One talker step of every state. A state's first step prefills its prompt; each later one
        completes the previous frame's residual codes and feeds that frame plus one text row."""
        for st in states:
            self._take_inbox(st)
        decoding = [st for st in states if st.prompt is None]
        residual = dict(zip(map(id, decoding), self._residual_codes(decoding))) if decoding else {}
        inputs, frames = [], []
        for st in states:
            if st.prompt is not None:
                inputs.append(self._prefill(*st.prompt, st.speaker))
                st.prompt = None
                frames.append(None)
                continue
            last = st.tokens[-1]
            codes = residual[id(st)]
            frames.append([last] + codes)
            embs = [self.model.get_input_embeddings()(torch.tensor(last))] + [
                self.model.code_predictor.get_input_embeddings()[i](torch.tensor(code)) for i, code in enumerate(codes)]
            emb = torch.stack(embs).sum(0)
            k = st.steps - 1
            if k < len(st.trailing):
                emb = emb + st.trailing[k]
            elif st.text_done and not st.eos_sent and k == len(st.trailing):
                emb = emb + self.tts_eos
                st.eos_sent = True
            else:
                emb = emb + self.tts_pad
            inputs.append(emb[None])
        last_hidden, _ = packed_forward(self.model.model, inputs, [st.kv for st in states], rope_axes=3,
                                        min_rows=self.min_rows)
        logits_all = self.model.codec_head(last_hidden)
        out = []
        for i, st in enumerate(states):
            st.steps += 1
            st.past_hidden = last_hidden[i].view(1, 1, -1)
            logits = apply_repetition_penalty(logits_all[i], st.tokens, st.sampling.repetition_penalty)
            logits[self.suppress] = float("-inf")
            token = choose(logits, st.sampling, st.generator)
            st.tokens.append(token)
            if token == self.eos:
                st.finish_reason = "stop"
            elif len(st.tokens) >= st.max_frames + 1:
                st.finish_reason = "length"
            st.finished = st.finish_reason is not None
            out.append(TalkerStep(frames[i], st.finish_reason))
        return out

    def _residual_codes(self, states: list[TalkerState]) -> list[list[int]]:
        """The code predictor's residual code groups of each state's last frame, as one batch."""
        cp = self.model.code_predictor
        cache = DynamicCache(config=cp.config)
        last = self.model.get_input_embeddings()(torch.tensor([[st.tokens[-1]] for st in states]))
        emb = torch.cat([torch.cat([st.past_hidden for st in states]), last], dim=1)
        codes: list[list[int]] = [[] for _ in states]
        for g in range(self.groups - 1):
            out = cp.model(inputs_embeds=emb, past_key_values=cache, use_cache=True)
            logits = cp.lm_head[g](out.last_hidden_state[:, -1])
            for i, st in enumerate(states):
                s = st.sampling if st.sampling.greedy else SamplingSettings(
                    temperature=st.sampling.temperature, top_k=50, top_p=0.8)
                codes[i].append(choose(logits[i], s, st.generator))
            emb = cp.get_input_embeddings()[g](torch.tensor([[c[-1]] for c in codes]))
        return codes


# ----------------------------------------------------------------- Code2Wav

@dataclass(eq=False)
class AudioChunkState(StepState):
    """One chunk of one request's codec frames, with its left context: decoded in one step."""

    codes: torch.Tensor  # [groups, context + new]
    context: int         # frames of left context at the front
    finished: bool = False

    @property
    def key(self) -> int:  # chunks of equal length share a forward
        return self.codes.shape[-1]

    @property
    def cost(self) -> int:  # frames through the model, against the engine's max_batched_frames
        return self.codes.shape[-1]

    def held_bytes(self) -> int:
        return self.codes.nbytes

    def release(self) -> None:
        self.codes = torch.empty(0, dtype=torch.int64)  # a [:, :0] view would keep the storage alive


class Code2Wav:
    """Codec frames -> 24 kHz waveform, decoded chunk by chunk with left context as in chunked_decode."""

    LEFT_CONTEXT = 25

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, batch_invariant: bool = True):
        from transformers import Qwen3OmniMoeCode2Wav
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

        # Code2Wav's class declares the combined config; load its own sub-config explicitly.
        config = Qwen3OmniMoeCode2WavConfig.from_pretrained(model_dir)
        self.model = Qwen3OmniMoeCode2Wav.from_pretrained(model_dir, config=config, dtype=dtype).eval()
        if batch_invariant:
            make_batch_invariant(self.model)
        self.upsample = int(self.model.total_upsample)
        rate_file = Path(model_dir) / "sample_rate"
        self.sample_rate = int(rate_file.read_text()) if rate_file.exists() else 24000
        self.groups = self.model.config.num_quantizers

    def chunk_state(self, history: torch.Tensor, new: torch.Tensor) -> AudioChunkState:
        """`new` codes [groups, n] to decode after `history` (the codes before them)."""
        context = history[:, -self.LEFT_CONTEXT:] if history.numel() else history
        return AudioChunkState(codes=torch.cat([context, new], dim=1), context=context.shape[1])

    @torch.inference_mode()
    def decode_batch(self, states: list[AudioChunkState]) -> list[torch.Tensor]:
        """Waveforms [samples] of several requests' chunks of equal length, in one forward."""
        wav = self.model(torch.stack([st.codes for st in states]))[:, 0]
        for st in states:
            st.finished = True
        return [w[st.context * self.upsample:] for w, st in zip(wav, states)]


def to_pcm16(wav: torch.Tensor) -> torch.Tensor:
    return (wav.float().clamp(-1, 1) * 32767).round().to(torch.int16)
