"""Step-by-step Qwen2.5-Omni Thinker and Talker on transformers' classes, over batches.

They compute what `Qwen2_5OmniForConditionalGeneration.generate` computes for a text prompt, one
decode step at a time, for a batch of requests at once, across process boundaries:

- the Thinker emits, for every position it feeds, its input embedding (`embeds`) and its last
  layer's normed hidden state (`hidden`): generate() feeds the Talker their sum;
- the Talker's prompt is those sums over the Thinker prompt, then the Thinker embedding of the
  speaker's `bos_token` plus the codec pad embedding, then the first generated token's sum plus the
  codec start embedding; decode step k feeds the last codec token's embedding plus the sum of
  generated token k, then the Thinker embedding of the text end token once, then of the text pad
  token. Codec ids repeat-penalised over everything fed so far (as generate's input ids), the codec
  start id suppressed; the codec end and pad ids end the speech.

Each stage loads only its part of the combined checkpoint; the Talker reads the few Thinker
embedding rows it needs (`ckpt.rows`). Blocking torch code; the async adapters run it on their
worker thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.checkpoints.names import QWEN2_5_OMNI_SPEAKERS
from omnistage.checkpoints.shards import CheckpointError, ShardedCheckpoint
from omnistage.contract.params import InvalidRequest
from stage_service.engines.omni.media import TOWERS
from stage_service.engines.omni.talker import FedTalkerState
from stage_service.engines.transformers.lm_steps import DecoderLm, TokenState, next_token
from stage_service.runtime.chat import load_chat_template
from stage_service.runtime.components import Piece
from stage_service.runtime.errors import RequestFailed
from stage_service.runtime.invariance import MIN_MATMUL_ROWS, make_batch_invariant
from stage_service.runtime.packed import SequenceKV, packed_forward, use_packed_attention
from stage_service.runtime.per_request import alone, unless_failed
from stage_service.runtime.sampling import SamplingSettings, apply_repetition_penalty, new_generator

ROPE_AXES = 3  # multimodal RoPE: text positions are equal on every axis
THINKER_EMBEDDINGS = "thinker.model.embed_tokens.weight"
GENERATION_CONFIG = "generation_config.json"
# The system prompt the model card requires for speech output (without it the Talker's speech degrades).
SPEECH_SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
                        "perceiving auditory and visual inputs, as well as generating text and speech.")


def pieces(config, component: str, encoders: bool = True) -> tuple[Piece, ...]:
    """What the stage serving `component` loads (the mapping check builds the same); the encoder stage's towers
    are the omni encoder's (`omni.encoder.tower_pieces`)."""
    from transformers import (
        Qwen2_5OmniTalkerForConditionalGeneration,
        Qwen2_5OmniThinkerForConditionalGeneration,
        Qwen2_5OmniToken2WavModel,
    )

    if component == "thinker":
        return (Piece("thinker.", Qwen2_5OmniThinkerForConditionalGeneration, config.thinker_config, config.model_type,
                      without=() if encoders else TOWERS),)
    if component == "talker":
        return (Piece("talker.", Qwen2_5OmniTalkerForConditionalGeneration, config.talker_config, config.model_type),)
    if component == "token2wav":
        # float32 whatever the stage's dtype: upstream runs Token2Wav in float32 only (generate() casts it).
        return (Piece("token2wav.", Qwen2_5OmniToken2WavModel, config.token2wav_config, config.model_type,
                      dtype=torch.float32),)
    raise KeyError(component)


def load_speakers(root: Path) -> dict[str, dict]:
    """`spk_dict.pt`: per speaker `cond`, `ref_mel` and `bos_token`, keyed by the lower-cased name."""
    path = Path(root) / QWEN2_5_OMNI_SPEAKERS
    if not path.exists():
        raise CheckpointError(f"{path}: missing (Qwen2.5-Omni keeps its speakers there)")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets one line naming it
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    out = {}
    for name, entry in (raw.items() if isinstance(raw, dict) else ()):
        missing = [k for k in ("cond", "ref_mel", "bos_token") if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise CheckpointError(f"{path}: speaker {name!r} lacks {', '.join(missing)}")
        out[str(name).lower()] = {**entry, "name": str(name)}
    if not out:
        raise CheckpointError(f"{path}: no speakers")
    return out


def check_speaker(speakers: dict, speaker: str) -> dict:
    found = speakers.get(speaker.lower())
    if found is None:
        known = ", ".join(sorted(s["name"] for s in speakers.values()))
        raise InvalidRequest("params.audio.speaker", f'unknown speaker "{speaker}" (known: {known})')
    return found


# ------------------------------------------------------------------ Thinker

@dataclass
class ThinkerStep:
    token: int
    finish_reason: str | None
    embeds: torch.Tensor     # [n, H] input-embedding rows of the positions fed this step
    hidden: torch.Tensor     # [n, H] last layer's normed hidden rows of the same positions


class Thinker(DecoderLm):
    """The Thinker's text model stepped in packed batches, with the checkpoint's chat template."""

    def __init__(self, ckpt: ShardedCheckpoint, config, dtype: torch.dtype = torch.float32,
                 batch_invariant: bool = True, encoders: bool = True, device: torch.device | str = "cpu",
                 paged: bool = False):
        """`encoders=False`: the vision and audio towers are neither read nor kept (an encoder stage runs
        them); `paged`: under a KV budget (kv_budget.py)."""
        from transformers import AutoTokenizer

        (thinker,) = pieces(config, "thinker", encoders)
        model = thinker.load(ckpt, dtype, device)
        super().__init__(model, rope_axes=ROPE_AXES, keep_rows=True, batch_invariant=batch_invariant, paged=paged)
        root = ckpt.root
        self.tokenizer = AutoTokenizer.from_pretrained(root)
        self.chat_template = load_chat_template(root, self.tokenizer)
        self.stop_ids = _stop_ids(root, self.tokenizer)
        self.vocab = config.thinker_config.text_config.vocab_size

    def new_thinker_state(self, prompt_ids: list[int], sampling: SamplingSettings, max_tokens: int,
                          ignore_eos: bool = False, prefill_chunk: int = 0) -> TokenState:
        return self.new_state(prompt_ids, sampling, max_tokens, frozenset() if ignore_eos else self.stop_ids,
                              prefill_chunk=prefill_chunk)

    def step_thinker(self, states: list[TokenState]) -> list[ThinkerStep | RequestFailed]:
        return unless_failed(self.step_batch(states),
                             lambda s: ThinkerStep(s.token, s.finish_reason, s.rows[0], s.rows[-1]))


def _stop_ids(root: Path, tokenizer) -> frozenset[int]:
    """`eos_token_id` of generation_config.json, else the tokenizer's end token."""
    path = Path(root) / GENERATION_CONFIG
    eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    if eos is None:
        eos = tokenizer.eos_token_id
    return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


# ------------------------------------------------------------------- Talker

@dataclass(eq=False, kw_only=True)
class TalkerState(FedTalkerState):
    """`prompt`: the [P + 2, E] prompt rows. The inbox and `trailing` hold the sums the Talker speaks."""

    penalised: list[int]  # codec ids fed as the prompt (repetition-penalised as generate does)

    def held_bytes(self) -> int:
        return super().held_bytes() + (self.prompt.nbytes if self.prompt is not None else 0)


@dataclass
class TalkerStep:
    frame: list[int] | None  # the codec token of this step, [1], unless it ended the speech
    finish_reason: str | None


class Talker:
    """Codec-token generation conditioned on the Thinker's rows, as generate() does it, over a batch."""

    groups = 1  # one codec token per frame
    prompt_rows_beyond_ids = 2  # the speech start and the first token's row (`new_state`)

    def __init__(self, ckpt: ShardedCheckpoint, config, dtype: torch.dtype = torch.float32,
                 batch_invariant: bool = True, device: torch.device | str = "cpu"):
        self.checkpoint = ckpt
        (talker,) = pieces(config, "talker")
        self.model = talker.load(ckpt, dtype, device)
        self.device = self.model.device
        use_packed_attention(self.model.model)
        if batch_invariant:
            make_batch_invariant(self.model)
        self.min_rows = MIN_MATMUL_ROWS if batch_invariant else 1
        c = config.talker_config
        self.codec_bos, self.codec_pad, self.codec_mask = (c.tts_codec_start_token_id, c.tts_codec_pad_token_id,
                                                           c.tts_codec_mask_token_id)
        self.stop_ids = frozenset({c.tts_codec_end_token_id, c.tts_codec_pad_token_id})  # as generate()'s default
        self.speakers = load_speakers(ckpt.root)
        names = sorted(self.speakers)
        # The Thinker embedding rows the Talker feeds: text end, text pad, each speaker's speech start.
        ids = [c.tts_text_end_token_id, c.tts_text_pad_token_id] + [int(self.speakers[n]["bos_token"]) for n in names]
        rows = ckpt.rows(THINKER_EMBEDDINGS, ids).to(self.device, dtype)
        self.text_eos, self.text_pad = rows[0], rows[1]
        self.speech_bos = dict(zip(names, rows[2:]))
        t = config.thinker_config
        self.multimodal_ids = torch.tensor([t.audio_token_index, t.image_token_index, t.video_token_index],
                                           device=self.device)

    def check_speaker(self, speaker: str) -> None:
        check_speaker(self.speakers, speaker)

    def codec_embedding(self, ids: list[int]) -> torch.Tensor:
        return self.model.get_input_embeddings()(torch.tensor(ids, device=self.device))

    @torch.inference_mode()
    def new_state(self, prompt_ids: list[int], embeds: torch.Tensor, hidden: torch.Tensor,
                  sampling: SamplingSettings, max_frames: int, speaker: str = "ethan") -> TalkerState:
        """The state whose first step prefills the prompt built from the Thinker's prompt rows and its first
        generated token's row (`embeds`/`hidden` [P or P + 1, H]; P alone when it generated one token)."""
        check_speaker(self.speakers, speaker)
        n = len(prompt_ids)
        emb = embeds[:n].clone()
        # Placeholder positions carry encoder features in the Thinker; generate() gives the Talker zeros there.
        emb[torch.isin(torch.tensor(prompt_ids, device=self.device), self.multimodal_ids)] = 0
        one_token = len(embeds) == n  # the Thinker stopped after one token: its text ends at once
        first = self.text_eos if one_token else hidden[n] + embeds[n]
        codec = self.codec_embedding([self.codec_pad, self.codec_bos])
        prompt = torch.cat([hidden[:n] + emb, (self.speech_bos[speaker.lower()] + codec[0])[None],
                            (first + codec[1])[None]])
        return TalkerState(sampling=sampling, max_frames=max_frames, speaker=speaker.lower(), prompt=prompt,
                           penalised=([self.codec_mask] if n else []) + [self.codec_pad, self.codec_bos],
                           generator=None if sampling.greedy else new_generator(sampling.seed, self.device),
                           end_spoken=one_token, kv=SequenceKV(limit=n + self.prompt_rows_beyond_ids + max_frames))

    @torch.inference_mode()
    def step_batch(self, states: list[TalkerState]) -> list[TalkerStep | RequestFailed]:
        """One talker step of every state: its prompt for one that just joined, else its last codec token
        plus the text row this step speaks; a state whose sampling fails gets its `RequestFailed`."""
        inputs = []
        for st in states:
            st.take_inbox()
            if st.prompt is not None:
                inputs.append(st.unfed(st.prompt))
                st.prompt = None
            else:
                codec = self.codec_embedding([st.tokens[-1]])[0]
                inputs.append(st.unfed((codec + st.text_row(self.text_eos, self.text_pad))[None]))
        rows = self.model.thinker_to_talker_proj(torch.cat(inputs)).split([len(x) for x in inputs])
        last, _ = packed_forward(self.model.model, rows, [st.kv for st in states], rope_axes=ROPE_AXES,
                                 min_rows=self.min_rows)
        logits_all = self.model.codec_head(last).float()
        return [alone(st, self._sampled, st, logits_all[i]) for i, st in enumerate(states)]

    def _sampled(self, st: TalkerState, logits: torch.Tensor) -> TalkerStep:
        """The state's own part of a step: its next codec token, chosen with its settings and generator."""
        st.steps += 1
        logits = apply_repetition_penalty(logits, st.penalised + st.tokens, st.sampling.repetition_penalty)
        logits[self.codec_bos] = float("-inf")
        token = next_token(st, logits, st.tokens, self.stop_ids, st.max_frames)
        return TalkerStep(None if token in self.stop_ids else [token], st.finish_reason)
