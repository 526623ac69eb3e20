"""Step-by-step Qwen3-Omni Thinker, Talker and Code2Wav on transformers' classes.

These reproduce what `Qwen3OmniMoeForConditionalGeneration.generate` computes,
but one decode step at a time and across process boundaries: the Thinker emits
the embedding and hidden-state rows of every position it feeds, and the Talker
builds its prompt and per-step text conditioning from those rows as they
arrive, so it can start before the Thinker has finished. Blocking torch code
only; the async engine adapters run it on their worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from omnistage.params import InvalidRequest

from .sampling import SamplingSettings, apply_repetition_penalty, choose, new_generator


# ------------------------------------------------------------------ Thinker

@dataclass
class ThinkerState:
    prompt_ids: list[int]
    sampling: SamplingSettings
    max_tokens: int
    stop_ids: frozenset[int]
    cache: DynamicCache
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    fed: int = 0  # positions fed to the model so far
    finish_reason: str | None = None


@dataclass
class ThinkerStep:
    token: int | None        # the new token (None when the request already finished)
    embeds: torch.Tensor     # [n, H] input-embedding rows of the positions fed this step
    hidden: torch.Tensor     # [n, H] rows of the layer the Talker accepts


class Thinker:
    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32):
        from transformers import PreTrainedTokenizerFast, Qwen3OmniMoeThinkerForConditionalGeneration

        self.model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
        cfg = self.model.config
        self.accept_layer = 1  # overwritten by the Talker's config where known
        self.im_start = 151644
        self.im_end = 151645
        self.user_id = cfg.user_token_id if hasattr(cfg, "user_token_id") else 872
        self.assistant_id = 77091
        self.newline = self.tokenizer.convert_tokens_to_ids("\u010a")

    def chat_prompt(self, text: str) -> list[int]:
        """`<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n` as token ids."""
        body = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ([self.im_start, self.user_id, self.newline] + body +
                [self.im_end, self.newline, self.im_start, self.assistant_id, self.newline])

    def new_state(self, prompt_ids: list[int], sampling: SamplingSettings, max_tokens: int,
                  ignore_eos: bool = False) -> ThinkerState:
        return ThinkerState(
            prompt_ids=list(prompt_ids), sampling=sampling, max_tokens=max_tokens,
            stop_ids=frozenset() if ignore_eos else frozenset({self.im_end, 151643}),
            cache=DynamicCache(config=self.model.config.text_config),
            generator=None if sampling.greedy else new_generator(sampling.seed))

    @torch.inference_mode()
    def step(self, st: ThinkerState) -> ThinkerStep:
        """Prefill on the first call, then one decode step per call."""
        feed = st.prompt_ids if st.fed == 0 else st.generated[-1:]
        n = len(feed)
        pos = torch.arange(st.fed, st.fed + n).view(1, 1, -1).expand(3, 1, -1)
        out = self.model(input_ids=torch.tensor([feed]), past_key_values=st.cache, use_cache=True,
                         output_hidden_states=True, position_ids=pos)
        st.fed += n
        token = choose(out.logits[0, -1], st.sampling, st.generator)
        st.generated.append(token)
        if token in st.stop_ids:
            st.finish_reason = "stop"
        elif len(st.generated) >= st.max_tokens:
            st.finish_reason = "length"
        return ThinkerStep(token=token, embeds=out.hidden_states[0][0], hidden=out.hidden_states[self.accept_layer][0])

    def text_of(self, st: ThinkerState) -> str:
        ids = [t for t in st.generated if t not in st.stop_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


# ------------------------------------------------------------------- Talker

@dataclass
class TalkerState:
    sampling: SamplingSettings
    max_frames: int
    cache: DynamicCache
    generator: torch.Generator | None
    prefill: torch.Tensor | None          # [P, H] talker prompt, consumed by the first step
    trailing: list[torch.Tensor]          # projected text rows still to be spoken, one per step
    text_done: bool = False               # the Thinker's stream has ended
    eos_sent: bool = False                # the tts_eos marker has been consumed
    tokens: list[int] = field(default_factory=list)
    past_hidden: torch.Tensor | None = None
    fed: int = 0
    steps: int = 0
    finish_reason: str | None = None


class Talker:
    """Codec-token generation conditioned on the Thinker's rows (first code group by the talker,
    the residual groups by its code predictor), exactly as transformers' generate does it."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32):
        from safetensors.torch import load_file
        from transformers import Qwen3OmniMoeTalkerForConditionalGeneration

        self.model = Qwen3OmniMoeTalkerForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
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

    @torch.inference_mode()
    def new_state(self, prompt_ids: list[int], prompt_embeds: torch.Tensor, prompt_hidden: torch.Tensor,
                  first_token_embed: torch.Tensor, sampling: SamplingSettings, max_frames: int,
                  speaker: str = "ethan") -> TalkerState:
        """Build the talker prompt from the Thinker's prompt rows and its first generated token's row."""
        if speaker.lower() not in self.speakers:
            raise InvalidRequest("params.audio.speaker", f'unknown speaker "{speaker}" (known: {", ".join(sorted(self.speakers))})')
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
                                  self.speakers[speaker.lower()], c.codec_pad_id, c.codec_bos_id])
        codec_rows = torch.cat([torch.zeros(3, text_rows.shape[1], dtype=text_rows.dtype),
                                self.model.get_input_embeddings()(codec_ids)])
        prefill = torch.cat([user_part, text_rows + codec_rows])
        return TalkerState(sampling=sampling, max_frames=max_frames,
                           cache=DynamicCache(config=self.model.config.text_config),
                           generator=None if sampling.greedy else new_generator(sampling.seed),
                           prefill=prefill, trailing=[])

    @torch.inference_mode()
    def add_text(self, st: TalkerState, embeds: torch.Tensor) -> None:
        """Queue Thinker embedding rows of generated tokens (from the second one on) to be spoken."""
        if len(embeds):
            st.trailing.extend(self.model.text_projection(embeds).unbind(0))

    def needs_text(self, st: TalkerState) -> bool:
        """True when the next step cannot run until more Thinker rows (or its end) arrive."""
        return st.prefill is None and not st.text_done and st.steps - 1 >= len(st.trailing)

    @torch.inference_mode()
    def step(self, st: TalkerState) -> list[int] | None:
        """One talker step. Returns the codes of one frame [groups] once one is complete, else None."""
        frame = None
        if st.prefill is not None:
            emb = st.prefill[None]
            st.prefill = None
        else:
            last = st.tokens[-1]
            last_emb = self.model.get_input_embeddings()(torch.tensor([[last]]))
            residual = self._residual_codes(st.past_hidden, last_emb, st)
            frame = [last] + residual
            embs = [last_emb[0, 0]] + [self.model.code_predictor.get_input_embeddings()[i](torch.tensor(code))
                                       for i, code in enumerate(residual)]
            emb = torch.stack(embs).sum(0)
            k = st.steps - 1
            if k < len(st.trailing):
                emb = emb + st.trailing[k]
            elif st.text_done and not st.eos_sent and k == len(st.trailing):
                emb = emb + self.tts_eos
                st.eos_sent = True
            else:
                emb = emb + self.tts_pad
            emb = emb.view(1, 1, -1)
        n = emb.shape[1]
        pos = torch.arange(st.fed, st.fed + n).view(1, 1, -1).expand(3, 1, -1)
        out = self.model.model(inputs_embeds=emb, past_key_values=st.cache, use_cache=True, position_ids=pos)
        hidden = out.last_hidden_state
        st.fed += n
        st.steps += 1
        st.past_hidden = hidden[:, -1:]
        logits = self.model.codec_head(hidden[0, -1])
        logits = apply_repetition_penalty(logits, st.tokens, st.sampling.repetition_penalty)
        logits[self.suppress] = float("-inf")
        token = choose(logits, st.sampling, st.generator)
        st.tokens.append(token)
        if token == self.eos:
            st.finish_reason = "stop"
        elif len(st.tokens) >= st.max_frames + 1:
            st.finish_reason = "length"
        return frame

    def _residual_codes(self, past_hidden: torch.Tensor, last_emb: torch.Tensor, st: TalkerState) -> list[int]:
        """The code predictor's greedy (or sampled) residual code groups for one frame."""
        cp = self.model.code_predictor
        cache = DynamicCache(config=cp.config)
        emb = torch.cat([past_hidden, last_emb], dim=1)
        codes: list[int] = []
        for g in range(self.groups - 1):
            out = cp.model(inputs_embeds=emb, past_key_values=cache, use_cache=True)
            logits = cp.lm_head[g](out.last_hidden_state[0, -1])
            code = choose(logits, SamplingSettings(temperature=st.sampling.temperature, top_k=50, top_p=0.8)
                          if not st.sampling.greedy else st.sampling, st.generator)
            codes.append(code)
            emb = cp.get_input_embeddings()[g](torch.tensor([[code]]))
        return codes


# ----------------------------------------------------------------- Code2Wav

class Code2Wav:
    """Codec frames -> 24 kHz waveform, decoded chunk by chunk with left context as in chunked_decode."""

    LEFT_CONTEXT = 25

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32):
        from transformers import Qwen3OmniMoeCode2Wav
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

        # Code2Wav's class declares the combined config; load its own sub-config explicitly.
        config = Qwen3OmniMoeCode2WavConfig.from_pretrained(model_dir)
        self.model = Qwen3OmniMoeCode2Wav.from_pretrained(model_dir, config=config, dtype=dtype).eval()
        self.upsample = int(self.model.total_upsample)
        rate_file = Path(model_dir) / "sample_rate"
        self.sample_rate = int(rate_file.read_text()) if rate_file.exists() else 24000
        self.groups = self.model.config.num_quantizers

    @torch.inference_mode()
    def decode(self, history: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Waveform [samples] for `new` codes [groups, n], given the codes before them."""
        context = history[:, -self.LEFT_CONTEXT:] if history.numel() else history
        codes = torch.cat([context, new], dim=1)[None]
        wav = self.model(codes)[0, 0]
        return wav[context.shape[1] * self.upsample:]

    @torch.inference_mode()
    def decode_batch(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Decode several requests' chunks in one forward when they have equal lengths."""
        ctx = [h[:, -self.LEFT_CONTEXT:] if h.numel() else h for h, _ in items]
        full = [torch.cat([c, n], dim=1) for c, (_, n) in zip(ctx, items)]
        if len({f.shape[1] for f in full}) == 1:
            wav = self.model(torch.stack(full))[:, 0]
            return [w[c.shape[1] * self.upsample:] for w, c in zip(wav, ctx)]
        return [self.decode(h, n) for h, n in items]


def to_pcm16(wav: torch.Tensor) -> torch.Tensor:
    return (wav.float().clamp(-1, 1) * 32767).round().to(torch.int16)
