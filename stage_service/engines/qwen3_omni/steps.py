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

Each part loads from the combined checkpoint as published (one `config.json`, one set of shards): it
reads only the tensors under its own prefix (`THINKER`, `TALKER`, `CODE2WAV`), plus, for the Talker,
three rows of the Thinker's embedding matrix; the config keys each part reads are its family's
(stage_service/engines/families/qwen3_omni.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from omnistage.checkpoints.configs import generation_config
from omnistage.checkpoints.shards import CheckpointError, ShardedCheckpoint
from omnistage.contract.params import InvalidRequest
from omnistage.families import family_named
from stage_service.engines.omni.media import TOWERS
from stage_service.engines.omni.talker import FedTalkerState
from stage_service.engines.transformers.lm_steps import DecoderLm, TokenState, next_token
from stage_service.runtime.chat import load_chat_template
from stage_service.runtime.components import Piece, read_config
from stage_service.runtime.errors import InputError, RequestFailed
from stage_service.runtime.invariance import MIN_MATMUL_ROWS, MOE_EXPERTS, make_batch_invariant
from stage_service.runtime.packed import SequenceKV, packed_forward, use_packed_attention
from stage_service.runtime.per_request import alone, unless_failed
from stage_service.runtime.sampling import SamplingSettings, apply_repetition_penalty, choose, new_generator
from stage_service.runtime.scheduler import StepState

THINKER, TALKER, CODE2WAV = "thinker.", "talker.", "code2wav."
# The Talker's "speech starts / ends / pause" conditioning is the Thinker's embedding of tts_bos / tts_eos /
# tts_pad: three rows of this matrix, read on their own.
THINKER_EMBED = "thinker.model.embed_tokens.weight"
# Qwen3-Omni's Code2Wav outputs 24 kHz audio (1920 samples per 12.5 Hz codec frame); no config key says so.
SAMPLE_RATE = 24000
# What a failed request's row of the code predictor batch carries on with: any valid code (its row is its own).
PLACEHOLDER_CODE = 0


def _moe_kwargs(batch_invariant: bool) -> dict:
    return {"experts_implementation": MOE_EXPERTS} if batch_invariant else {}


def _config(root: Path, part: str):
    from transformers import Qwen3OmniMoeConfig

    return read_config(root, Qwen3OmniMoeConfig, family_named("qwen3_omni").parts[part].config_keys)


def pieces(cfg, component: str, encoders: bool = True, batch_invariant: bool = True) -> tuple[Piece, ...]:
    """What the stage serving `component` loads (the mapping check builds the same); the encoder stage's towers
    are the omni encoder's (`omni.encoder.tower_pieces`)."""
    from transformers import (
        Qwen3OmniMoeCode2Wav,
        Qwen3OmniMoeTalkerForConditionalGeneration,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    moe = tuple(_moe_kwargs(batch_invariant).items())
    if component == "thinker":
        return (Piece(THINKER, Qwen3OmniMoeThinkerForConditionalGeneration, cfg.thinker_config, cfg.model_type,
                      without=() if encoders else TOWERS, kwargs=moe),)
    if component == "talker":
        return (Piece(TALKER, Qwen3OmniMoeTalkerForConditionalGeneration, cfg.talker_config, cfg.model_type,
                      kwargs=moe),)
    if component == "code2wav":
        return (Piece(CODE2WAV, Qwen3OmniMoeCode2Wav, cfg.code2wav_config),)
    raise KeyError(component)


def _generation_eos(root: Path) -> list[int]:
    """The end-of-sequence ids of the checkpoint's generation_config.json (none without one)."""
    eos = generation_config(root).get("eos_token_id")
    return [] if eos is None else list(eos) if isinstance(eos, list) else [eos]


# ------------------------------------------------------------------ Thinker

@dataclass
class ThinkerStep:
    token: int
    finish_reason: str | None
    embeds: torch.Tensor     # [n, H] input-embedding rows of the positions fed this step
    hidden: torch.Tensor     # [n, H] rows of the layer the Talker accepts


class Thinker(DecoderLm):
    ROPE_AXES = 3  # multimodal RoPE: text positions are equal on every axis

    def __init__(self, root: Path, dtype: torch.dtype = torch.float32, batch_invariant: bool = True,
                 encoders: bool = True, device: torch.device | str = "cpu", paged: bool = False):
        """`encoders=False`: the vision and audio towers are neither read nor kept (an encoder stage runs
        them); `paged`: under a KV budget (kv_budget.py)."""
        from transformers import AutoTokenizer

        cfg = _config(root, "thinker")
        # The hidden-states index (0 = embeddings, i = after decoder layer i) generate() hands the Talker.
        self.accept_layer = cfg.talker_config.accept_hidden_layer
        layers = cfg.thinker_config.text_config.num_hidden_layers
        if not 0 <= self.accept_layer <= layers:
            raise CheckpointError(f"{Path(root) / 'config.json'}: talker_config.accept_hidden_layer is "
                                  f"{self.accept_layer}, but the Thinker has {layers} layers")
        self.checkpoint = ShardedCheckpoint(root)
        (thinker,) = pieces(cfg, "thinker", encoders, batch_invariant)
        model = thinker.load(self.checkpoint, dtype, device)
        super().__init__(model, rope_axes=self.ROPE_AXES, keep_rows=True, batch_invariant=batch_invariant,
                         paged=paged)
        self.tokenizer = AutoTokenizer.from_pretrained(root)
        self.chat_template = load_chat_template(root, self.tokenizer)
        self.im_end = cfg.im_end_token_id
        self.stop_ids = frozenset({self.im_end, *_generation_eos(root)})
        self.vocab = cfg.thinker_config.text_config.vocab_size
        self.max_positions = cfg.thinker_config.text_config.max_position_embeddings

    def new_thinker_state(self, prompt_ids: list[int], sampling: SamplingSettings, max_tokens: int,
                          ignore_eos: bool = False, prefill_chunk: int = 0) -> TokenState:
        return self.new_state(prompt_ids, sampling, max_tokens, frozenset() if ignore_eos else self.stop_ids,
                              prefill_chunk=prefill_chunk)

    def step_thinker(self, states: list[TokenState]) -> list[ThinkerStep | RequestFailed]:
        return unless_failed(self.step_batch(states),
                             lambda s: ThinkerStep(s.token, s.finish_reason, s.rows[0], s.rows[self.accept_layer]))

    def text_of(self, st: TokenState) -> str:
        ids = [t for t in st.generated if t not in st.stop_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


# ------------------------------------------------------------------- Talker

@dataclass(eq=False, kw_only=True)
class TalkerState(FedTalkerState):
    """`prompt`: (prompt ids, prompt embeds, prompt hidden, first generated token's embed row), from which
    the first step builds the prefill. The inbox holds the Thinker's embedding rows; `trailing`, their
    text projection."""

    past_hidden: torch.Tensor | None = None  # the last step's hidden row: the code predictor starts from it

    def release(self) -> None:
        super().release()
        self.past_hidden = None


@dataclass
class TalkerStep:
    frame: list[int] | None  # the codes of one frame [groups], once one is complete
    finish_reason: str | None


class Talker:
    """Codec-token generation conditioned on the Thinker's rows (first code group by the talker,
    the residual groups by its code predictor), as transformers' generate does it, over a batch."""

    # Prompt rows beyond the prompt's ids, at most (`_prefill`: the user turns' rows, then 9 of its own).
    prompt_rows_beyond_ids = 9
    # Each request's keys are read up to a multiple of this many rows (packed.py, `pad_to`): requests that
    # joined at different frames then attend in one call per 32-row band of lengths instead of one each,
    # for at most 31 masked rows of attention each (small against the Talker's MoE layers).
    PAD_KEYS_TO = 32
    # Codec tokens chosen before the end of speech may be (generate's min_new_tokens; Qwen3-Omni's: none).
    MIN_TOKENS = 0

    def __init__(self, root: Path, dtype: torch.dtype = torch.float32, batch_invariant: bool = True,
                 device: torch.device | str = "cpu"):
        combined = _config(root, "talker")
        self.checkpoint = ShardedCheckpoint(root)
        (talker,) = pieces(combined, "talker", batch_invariant=batch_invariant)
        self.model = talker.load(self.checkpoint, dtype, device)
        self.device = self.model.device
        use_packed_attention(self.model.model)
        if batch_invariant:
            make_batch_invariant(self.model)
        self.min_rows = MIN_MATMUL_ROWS if batch_invariant else 1
        cfg = self.model.config
        self.cfg = cfg
        self.groups = cfg.num_code_groups
        self.eos = cfg.codec_eos_token_id
        vocab = cfg.text_config.vocab_size
        self.suppress = torch.tensor([i for i in range(vocab - 1024, vocab) if i != self.eos], dtype=torch.long,
                                     device=self.device)
        special = self.checkpoint.rows(THINKER_EMBED, [combined.tts_bos_token_id, combined.tts_eos_token_id,
                                                       combined.tts_pad_token_id]).to(self.device, dtype)
        with torch.inference_mode():
            self.tts_bos, self.tts_eos, self.tts_pad = self.model.text_projection(special[None])[0].unbind(0)
        self.speakers = dict(cfg.speaker_id or {})
        self.im_start, self.user_id, self.assistant_id = (combined.im_start_token_id, combined.user_token_id,
                                                          combined.assistant_token_id)
        t = combined.thinker_config  # generate() marks multimodal positions by the Thinker's ids
        self.multimodal_ids = torch.tensor([t.audio_token_id, t.image_token_id, t.video_token_id], device=self.device)

    def check_speaker(self, speaker: str) -> None:
        if speaker.lower() not in self.speakers:
            raise InvalidRequest("params.audio.speaker",
                                 f'unknown speaker "{speaker}" (known: {", ".join(sorted(self.speakers))})')

    def new_state(self, prompt_ids: list[int], embeds: torch.Tensor, hidden: torch.Tensor,
                  sampling: SamplingSettings, max_frames: int, speaker: str = "ethan") -> TalkerState:
        """A state whose first step builds the talker prompt from the Thinker's prompt rows and its first
        generated token's row (`embeds`/`hidden` [P or P + 1, H]; P alone when it generated one token)."""
        self.check_speaker(speaker)
        self.assistant_start(prompt_ids)
        n = len(prompt_ids)
        first = embeds[n] if len(embeds) > n else torch.zeros_like(embeds[0])  # one token: nothing fed back
        return TalkerState(sampling=sampling, max_frames=max_frames, speaker=speaker.lower(),
                           generator=None if sampling.greedy else new_generator(sampling.seed, self.device),
                           prompt=(list(prompt_ids), embeds[:n], hidden[:n], first),
                           kv=SequenceKV(limit=n + self.prompt_rows_beyond_ids + max_frames))

    def assistant_start(self, prompt_ids: list[int]) -> int:
        """Where the prompt's last assistant turn starts: the Talker speaks from there, as generate() does."""
        starts = [i for i in range(len(prompt_ids) - 1)
                  if prompt_ids[i] == self.im_start and prompt_ids[i + 1] == self.assistant_id]
        if not starts:
            raise InputError("the Thinker's prompt has no assistant turn to speak (the Talker needs the chat "
                             "template's assistant prompt; a raw prompt must end with one)")
        return starts[-1]

    def _prefill(self, prompt_ids: list[int], prompt_embeds: torch.Tensor, prompt_hidden: torch.Tensor,
                 first_token_embed: torch.Tensor, speaker: str) -> torch.Tensor:
        """The talker prompt rows [P, H], as generate() builds them."""
        ids = torch.tensor(prompt_ids, device=self.device)
        starts = [i for i, t in enumerate(prompt_ids) if t == self.im_start]
        user = torch.zeros(len(prompt_ids), dtype=torch.bool, device=self.device)
        for s in starts:  # mark every position of each user turn, as generate() does
            if s + 1 < len(prompt_ids) and prompt_ids[s + 1] == self.user_id:
                end = next((e for e in starts if e > s), len(prompt_ids))
                user[s:end] = True
        multimodal = torch.isin(ids, self.multimodal_ids)
        proj = self.model.text_projection
        user_rows = torch.where(multimodal[:, None], self.model.hidden_projection(prompt_hidden), proj(prompt_embeds))
        user_part = user_rows[user]
        a = self.assistant_start(prompt_ids)
        assistant = proj(torch.cat([prompt_embeds[a:a + 3], first_token_embed[None]]))
        pad, bos = self.tts_pad, self.tts_bos
        text_rows = torch.cat([assistant[:3], pad.expand(4, -1), bos[None], assistant[3:4]])
        c = self.cfg
        codec_ids = torch.tensor([c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id,
                                  self.speakers[speaker], c.codec_pad_id, c.codec_bos_id], device=self.device)
        codec_rows = torch.cat([torch.zeros(3, text_rows.shape[1], dtype=text_rows.dtype, device=self.device),
                                self.model.get_input_embeddings()(codec_ids)])
        return torch.cat([user_part, text_rows + codec_rows])

    @torch.inference_mode()
    def step_batch(self, states: list[TalkerState]) -> list[TalkerStep | RequestFailed]:
        """One talker step of every state. A state's first step prefills its prompt; each later one
        completes the previous frame's residual codes and feeds that frame plus one text row. A state
        whose sampling fails gets its `RequestFailed` and takes no further part in the step."""
        for st in states:
            st.take_inbox(self.model.text_projection)
        decoding = [st for st in states if st.prompt is None]
        residual = dict(zip(map(id, decoding), self._residual_codes(decoding))) if decoding else {}
        live = [st for st in states if not isinstance(residual.get(id(st)), RequestFailed)]
        stepped = dict(zip(map(id, live), self._step_live(live, residual))) if live else {}
        return [stepped[id(st)] if id(st) in stepped else residual[id(st)] for st in states]

    def _step_live(self, states: list[TalkerState], residual: dict[int, list[int]]) -> list[TalkerStep | RequestFailed]:
        frame_rows = self._frame_rows([st for st in states if st.prompt is None], residual)
        inputs, frames = [], []
        for st in states:
            if st.prompt is not None:
                inputs.append(st.unfed(self._prefill(*st.prompt, st.speaker)))
                st.prompt = None
                frames.append(None)
                continue
            frame, row = frame_rows[id(st)]
            frames.append(frame)
            inputs.append(st.unfed(row[None]))
        last_hidden, _ = packed_forward(self.model.model, inputs, [st.kv for st in states], rope_axes=3,
                                        min_rows=self.min_rows, pad_to=self.PAD_KEYS_TO)
        logits_all = self.model.codec_head(last_hidden)
        return [alone(st, self._sampled, st, logits_all[i], last_hidden[i], frames[i]) for i, st in enumerate(states)]

    def _frame_rows(self, states: list[TalkerState], residual: dict[int, list[int]]) -> dict[int, tuple]:
        """Each decoding state's last frame (its codes) and the row that feeds it back: the sum of every code
        group's embedding plus the text row it speaks. One lookup per group for the whole batch (a row is a
        copy, the same in any batch; the sum runs over the groups in order, as for one state)."""
        if not states:
            return {}
        frames = [[st.tokens[-1]] + residual[id(st)] for st in states]
        codes = torch.tensor(frames, device=self.device)  # [n, groups]
        tables = [self.model.get_input_embeddings(), *self.model.code_predictor.get_input_embeddings()]
        summed = torch.stack([tables[g](codes[:, g]) for g in range(codes.shape[1])]).sum(0)
        text = torch.stack([st.text_row(self.tts_eos, self.tts_pad) for st in states])
        return {id(st): (frame, row) for st, frame, row in zip(states, frames, (summed + text).unbind(0))}

    def _sampled(self, st: TalkerState, logits: torch.Tensor, hidden: torch.Tensor,
                 frame: list[int] | None) -> TalkerStep:
        """The state's own part of a step: its next codec token, chosen with its settings and generator."""
        st.steps += 1
        st.past_hidden = hidden.view(1, 1, -1)
        logits = apply_repetition_penalty(logits, st.tokens, st.sampling.repetition_penalty)
        logits[self.suppress] = float("-inf")
        if len(st.tokens) < self.MIN_TOKENS:
            logits[self.eos] = float("-inf")
        # max_frames + 1 tokens: each step completes the previous token's frame, so the last token
        # chosen is never spoken.
        next_token(st, logits, st.tokens, (self.eos,), st.max_frames + 1)
        return TalkerStep(frame, st.finish_reason)

    @staticmethod
    def residual_sampling(sampling: SamplingSettings) -> SamplingSettings:
        """How the code predictor chooses a request's residual codes (Qwen3-Omni's generate: its own top-k / top-p
        at the request's temperature, greedy when the request is)."""
        return sampling if sampling.greedy else SamplingSettings(temperature=sampling.temperature, top_k=50, top_p=0.8)

    def predictor_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The code predictor's input rows from the talker's (Qwen3-Omni: the same width, as they are)."""
        return rows

    def _residual_codes(self, states: list[TalkerState]) -> list[list[int] | RequestFailed]:
        """The code predictor's residual code groups of each state's last frame, as one batch; a state whose
        sampling fails gets its `RequestFailed` (its row goes on with a placeholder code its neighbours never see)."""
        cp = self.model.code_predictor
        cache = DynamicCache(config=cp.config)
        last = self.model.get_input_embeddings()(torch.tensor([[st.tokens[-1]] for st in states], device=self.device))
        emb = torch.cat([torch.cat([st.past_hidden for st in states]), last], dim=1)
        codes: list[list[int]] = [[] for _ in states]
        failed: dict[int, RequestFailed] = {}
        chosen_with = [self.residual_sampling(st.sampling) for st in states]
        for g in range(self.groups - 1):
            out = cp.model(inputs_embeds=self.predictor_rows(emb), past_key_values=cache, use_cache=True)
            logits = cp.lm_head[g](out.last_hidden_state[:, -1])
            for i, st in enumerate(states):
                code = PLACEHOLDER_CODE if i in failed else alone(st, choose, logits[i], chosen_with[i], st.generator)
                if isinstance(code, RequestFailed):
                    failed[i], code = code, PLACEHOLDER_CODE
                codes[i].append(code)
            emb = cp.get_input_embeddings()[g](torch.tensor([[c[-1]] for c in codes], device=self.device))
        return [failed.get(i, c) for i, c in enumerate(codes)]


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

    def __init__(self, root: Path, dtype: torch.dtype = torch.float32, batch_invariant: bool = True,
                 device: torch.device | str = "cpu"):
        combined = _config(root, "code2wav")
        self.checkpoint = ShardedCheckpoint(root)
        (code2wav,) = pieces(combined, "code2wav")
        self.model = code2wav.load(self.checkpoint, dtype, device)
        self.device = self.model.device
        if batch_invariant:
            make_batch_invariant(self.model)
        self.upsample = int(self.model.total_upsample)
        self.sample_rate = SAMPLE_RATE
        self.groups = self.model.config.num_quantizers

    def chunk_state(self, history: torch.Tensor, new: torch.Tensor) -> AudioChunkState:
        """`new` codes [groups, n] to decode after `history` (the codes before them), on the model's device."""
        context = history[:, -self.LEFT_CONTEXT:] if history.numel() else history
        codes = torch.cat([context.to(self.device), new.to(self.device)], dim=1)
        return AudioChunkState(codes=codes, context=context.shape[1])

    @torch.inference_mode()
    def decode_batch(self, states: list[AudioChunkState]) -> list[torch.Tensor]:
        """Waveforms [samples] of several requests' chunks of equal length, in one forward."""
        wav = self.model(torch.stack([st.codes for st in states]))[:, 0]
        for st in states:
            st.finished = True
        return [w[st.context * self.upsample:] for w, st in zip(wav, states)]
