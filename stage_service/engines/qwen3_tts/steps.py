"""Step-by-step Qwen3-TTS talker and 12 Hz codec decoder (the qwen-tts package's classes), over batches.

The talker is Qwen3-Omni's talker in another checkpoint: the same multimodal-RoPE decoder choosing each frame's
first code, the same code predictor choosing the rest, the same text row added to each frame it feeds back. So
`TtsTalker` is the omni `Talker` (its batched step, residual codes, sampling and KV handling are one piece of
code) with what differs: where it loads from, how the prompt is built, and the code predictor's input
projection and sampling defaults. It computes what `Qwen3TTSForConditionalGeneration.generate` computes with
`non_streaming_mode=False` (the text read as it is spoken: the prompt holds its first token, each decode step
adds the next, then the end of text, then pad), one step at a time for many requests at once.

The prompt, as generate() builds it: an instruction's rows (`<|im_start|>user\\n{instruction}<|im_end|>\\n`, text
rows only) when there is one; the assistant header's three text rows; then codec rows (think or no-think tags,
the language where one is forced, the speaker, pad) over pad text rows and `tts_bos`; then the first text token
over `codec_bos`. The text is tokenized as `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`.

A Base checkpoint (voice cloning) builds the same prompt with its reference clip's speaker row where the named
speaker's codec row stands (x-vector mode), and, given the clip's transcript (ICL mode), replaces the first text
row over `codec_bos` with generate_icl_prompt's rows: the transcript's and the text's tokens, then the end of text,
over `codec_bos` and the clip's codec frames (each its groups' embeddings summed), padded with pad text rows where
the frames are more; the text rows the frames leave over are read one a step as usual (clone.py: the clip).

The decoder is the speech tokenizer's (`speech_tokenizer/`, tensors under `decoder.`), run chunk by chunk with
25 frames of left context as its own `chunked_decode` does: it is the omni `Code2Wav` on another module.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.checkpoints.configs import CheckpointError, generation_config
from omnistage.checkpoints.qwen_tts import SPEECH_TOKENIZER_DIR, classes, load_config, with_rope_buffers
from omnistage.checkpoints.shards import ShardedCheckpoint
from omnistage.contract.params import InvalidRequest
from stage_service.engines.omni.inbox import END_OF_TEXT
from stage_service.engines.qwen3_omni.steps import Code2Wav, Talker, TalkerState
from stage_service.engines.qwen3_tts.clone import CloneEncoder, VoicePrompt
from stage_service.runtime.components import Piece
from stage_service.runtime.invariance import MIN_MATMUL_ROWS, make_batch_invariant
from stage_service.runtime.packed import SequenceKV, use_packed_attention
from stage_service.runtime.sampling import SamplingSettings, new_generator

TALKER, DECODER = "talker.", "decoder."
AUTO = "auto"  # the language generate() detects (no language tag in the prompt)
ASSISTANT_TEXT = "<|im_start|>assistant\n{}<|im_end|>\n<|im_start|>assistant\n"
INSTRUCTION_TEXT = "<|im_start|>user\n{}<|im_end|>\n"
REF_TEXT = "<|im_start|>assistant\n{}<|im_end|>\n"  # a reference clip's transcript (ICL mode)
HEADER, FOOTER = 3, 5  # the assistant text's tokens before and after the text itself
REF_FOOTER = 2  # the transcript's tokens after the transcript itself
CUSTOM_VOICE, BASE = "custom_voice", "base"  # the checkpoints served: named speakers; cloning a reference clip
# qwen-tts's generate() defaults, where generation_config.json gives none.
# (The talker's first code samples with the request's own settings: greedy unless it sets a temperature.)
GENERATION_DEFAULTS = dict(repetition_penalty=1.05, subtalker_dosample=True, subtalker_top_k=50, subtalker_top_p=1.0,
                           subtalker_temperature=0.9)


def generation_defaults(root: Path) -> dict:
    """The checkpoint's sampling defaults (generation_config.json over qwen-tts's own)."""
    found = generation_config(root)
    return {k: found.get(k, v) for k, v in GENERATION_DEFAULTS.items()}


class TtsTalker(Talker):
    """The Qwen3-TTS talker over a batch (see the module docstring)."""

    MIN_TOKENS = 2  # generate()'s min_new_tokens
    # Prompt rows beyond the text's and the instruction's tokens, at most: 3 header + 4 tags + speaker + pad/bos
    # + the first text token.
    prompt_rows_beyond_ids = 10

    def __init__(self, root: Path, dtype: torch.dtype = torch.float32, batch_invariant: bool = True,
                 device: torch.device | str = "cpu"):
        combined = load_config(root)
        served = {"tts_model_type": (CUSTOM_VOICE, BASE), "tokenizer_type": ("qwen3_tts_tokenizer_12hz",)}
        for key, wanted in served.items():
            got = getattr(combined, key, wanted[0])
            if got not in wanted:
                raise CheckpointError(f"{Path(root) / 'config.json'}: {key} {got!r} is not served (CustomVoice and "
                                      "Base checkpoints on the 12 Hz speech tokenizer are: named speakers and "
                                      "instructions, or a cloned reference clip; not VoiceDesign or the 25 Hz "
                                      "tokenizer)")
        self.kind = combined.tts_model_type
        # qwen-tts gives the 0.6B CustomVoice model no instruction (it was not trained with one), nor a Base one
        # (generate_voice_clone takes none)
        self.takes_instructions = self.kind == CUSTOM_VOICE and getattr(combined, "tts_model_size", "") != "0b6"
        # A Base checkpoint's speaker encoder and speech tokenizer encoder (run on the stage's media threads).
        self.checkpoint = ShardedCheckpoint(root)
        self.clone_encoder = CloneEncoder(self.checkpoint, combined, dtype, device) if self.kind == BASE else None
        # on the talker's device beside it: its KV budget is what is left after both
        self.encoders = (self.clone_encoder.speaker_encoder, self.clone_encoder.codec_encoder) \
            if self.clone_encoder is not None else ()
        self.model = with_rope_buffers(Piece(TALKER, classes().talker, combined.talker_config).load(
            self.checkpoint, dtype, device))
        self.device = self.model.device
        predictor = self.model.code_predictor.config
        loaded_with = predictor._attn_implementation
        use_packed_attention(self.model.model)
        # The code predictor's config is a sub-config of the talker's, and transformers hands an attention
        # implementation down to sub-configs: it steps its own cache (not packed), so it keeps what it loaded with.
        predictor._attn_implementation = loaded_with
        if batch_invariant:
            make_batch_invariant(self.model)
        self.min_rows = MIN_MATMUL_ROWS if batch_invariant else 1
        cfg = self.cfg = self.model.config
        self.groups = cfg.num_code_groups
        self.eos = cfg.codec_eos_token_id
        self.suppress = torch.tensor([i for i in range(cfg.vocab_size - 1024, cfg.vocab_size) if i != self.eos],
                                     dtype=torch.long, device=self.device)
        with torch.inference_mode():
            special = self.text_rows([combined.tts_bos_token_id, combined.tts_eos_token_id,
                                      combined.tts_pad_token_id])
        self.tts_bos, self.tts_eos, self.tts_pad = special.unbind(0)
        self.speakers = {k.lower(): v for k, v in (cfg.spk_id or {}).items()}
        self.dialects = {k.lower(): v for k, v in (cfg.spk_is_dialect or {}).items()}
        self.languages = {k.lower(): v for k, v in (cfg.codec_language_id or {}).items()}
        self.defaults = generation_defaults(root)

    @property
    def clones(self) -> bool:
        """Whether it speaks in a reference clip's voice (a Base checkpoint) rather than named speakers'."""
        return self.clone_encoder is not None

    def prompt_rows(self, instruction_ids: list[int], ref_frames: int = 0) -> int:
        """Rows the first step feeds, at most (a cloned voice's reference frames among them in ICL mode); each
        later step feeds one (its frame plus a text row, summed)."""
        return len(instruction_ids) + self.prompt_rows_beyond_ids + ref_frames

    def text_rows(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Text token ids as the talker reads them: its text embedding through its text projection."""
        return self.model.text_projection(self.text_embeds(ids))

    def text_embeds(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        return self.model.get_text_embeddings()(torch.as_tensor(ids, dtype=torch.long, device=self.device))

    def language_id(self, language: str, speaker: str) -> int | None:
        """The codec tag of the language the prompt forces (None: detected), as generate() picks it: the
        request's, or a dialect speaker's own where the request asks for Chinese or none."""
        lang = (language or AUTO).lower()
        if lang != AUTO and lang not in self.languages:
            known = ", ".join(sorted(k for k in self.languages if "dialect" not in k))
            raise InvalidRequest("params.audio.language", f'unknown language "{language}" (known: auto, {known})')
        found = None if lang == AUTO else self.languages[lang]
        dialect = self.dialects.get(speaker.lower()) if speaker else None
        if lang in ("chinese", AUTO) and dialect:
            found = self.languages[dialect]
        return found

    def new_state(self, text_ids: list[int], instruction_ids: list[int], sampling: SamplingSettings,  # type: ignore[override]
                  max_frames: int, speaker: str, language: str = AUTO,
                  voice: VoicePrompt | None = None) -> TalkerState:
        """A state for the assistant text `text_ids` (ASSISTANT_TEXT tokenized) spoken by `speaker` (or in the
        cloned `voice`, whose speaker is unread), after an instruction (`instruction_ids`, INSTRUCTION_TEXT
        tokenized; empty: none). Its inbox holds the text it reads after the prompt (the text's embeddings: each
        step projects what it takes) and the end of text."""
        if voice is None:
            self.check_speaker(speaker)
        if len(text_ids) <= HEADER + FOOTER:
            raise InvalidRequest("params.prompt", "is empty: there is no text to speak")
        language_id = self.language_id(language, "" if voice is not None else speaker)
        ref_frames = voice.frames if voice is not None else 0
        st = TalkerState(sampling=sampling, max_frames=max_frames, speaker=speaker.lower(),
                         generator=None if sampling.greedy else new_generator(sampling.seed, self.device),
                         prompt=(list(text_ids), list(instruction_ids), language_id, voice),
                         kv=SequenceKV(limit=self.prompt_rows(instruction_ids, ref_frames) + max_frames))
        # What is read after the prompt: the text after its first token; in ICL mode, the transcript's and the
        # text's tokens past the reference frames (none, and the end of text read already, where those are more).
        after = text_ids[HEADER + 1:-FOOTER]
        if voice is not None and voice.codes is not None:
            spoken = self._icl_ids(text_ids, voice)
            after = spoken[ref_frames + 1:]
            st.end_spoken = len(spoken) <= ref_frames
        with torch.inference_mode():
            st.inbox.append(self.text_embeds(after))
        st.inbox.append(END_OF_TEXT)
        return st

    @staticmethod
    def _icl_ids(text_ids: list[int], voice: VoicePrompt) -> list[int]:
        """The tokens ICL mode speaks over the reference frames: the transcript's, then the text's."""
        assert voice.ref_ids is not None
        return list(voice.ref_ids[HEADER:-REF_FOOTER]) + list(text_ids[HEADER:-FOOTER])

    def _prefill(self, text_ids: list[int], instruction_ids: list[int], language_id: int | None,  # type: ignore[override]
                 voice: VoicePrompt | None, speaker: str) -> torch.Tensor:
        """The talker prompt rows [P, H], as generate() builds them (module docstring)."""
        c = self.cfg
        tags = ([c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id] if language_id is None else
                [c.codec_think_id, c.codec_think_bos_id, language_id, c.codec_think_eos_id])
        embed = self.model.get_input_embeddings()
        spoken_by = (voice.speaker.to(self.device)[None] if voice is not None else
                     embed(torch.tensor([self.speakers[speaker]], device=self.device)))
        codec = torch.cat([embed(torch.tensor(tags, device=self.device)), spoken_by,
                           embed(torch.tensor([c.codec_pad_id, c.codec_bos_id], device=self.device))])
        under = torch.cat([self.tts_pad.expand(len(codec) - 2, -1), self.tts_bos[None]])
        rows = [self.text_rows(instruction_ids)] if instruction_ids else []
        rows += [self.text_rows(text_ids[:HEADER]), under + codec[:-1]]
        if voice is not None and voice.codes is not None:
            rows.append(self._icl_rows(self._icl_ids(text_ids, voice), voice.codes, codec[-1:]))
        else:
            rows.append(self.text_rows(text_ids[HEADER:HEADER + 1]) + codec[-1:])
        return torch.cat(rows)

    def _icl_rows(self, ids: list[int], ref_codes: torch.Tensor, codec_bos: torch.Tensor) -> torch.Tensor:
        """generate_icl_prompt's prompt rows (reading the text as it speaks): `codec_bos` and the reference
        frames (each its groups' embeddings summed) under as many text rows of `ids` then the end of text, pad
        rows where the frames are more."""
        codes = ref_codes.to(self.device)
        tables = [self.model.get_input_embeddings(), *self.model.code_predictor.get_input_embeddings()]
        frames = torch.stack([tables[g](codes[:, g]) for g in range(codes.shape[1])], dim=1).sum(1)
        codec = torch.cat([codec_bos, frames])
        n = len(codec)
        if len(ids) + 1 > n:
            return self.text_rows(ids[:n]) + codec
        text = torch.cat([self.text_rows(ids), self.tts_eos[None], self.tts_pad.expand(n - len(ids) - 1, -1)])
        return text + codec

    def residual_sampling(self, sampling: SamplingSettings) -> SamplingSettings:  # type: ignore[override]
        """The code predictor samples with the checkpoint's subtalker settings (greedy when the request is, or
        when the checkpoint's subtalker does not sample)."""
        d = self.defaults
        if sampling.greedy or not d["subtalker_dosample"]:
            return SamplingSettings()
        return SamplingSettings(temperature=d["subtalker_temperature"], top_k=d["subtalker_top_k"],
                                top_p=d["subtalker_top_p"])

    def predictor_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.code_predictor.small_to_mtp_projection(rows)


class CodecDecoder(Code2Wav):
    """The 12 Hz speech tokenizer's decoder: codes [groups, frames] -> 24 kHz waveform, chunk by chunk."""

    def __init__(self, root: Path, dtype: torch.dtype = torch.float32, batch_invariant: bool = True,
                 device: torch.device | str = "cpu"):
        codec_root = Path(root) / SPEECH_TOKENIZER_DIR
        if not (codec_root / "config.json").exists():
            raise CheckpointError(f"{codec_root}: no config.json (a Qwen3-TTS checkpoint keeps its speech "
                                  f"tokenizer in {SPEECH_TOKENIZER_DIR}/)")
        cfg = classes().codec_config.from_pretrained(str(codec_root))
        self.checkpoint = ShardedCheckpoint(codec_root)
        self.model = with_rope_buffers(Piece(DECODER, classes().codec_decoder, cfg.decoder_config).load(
            self.checkpoint, dtype, device))
        self.device = self.model.device
        if batch_invariant:
            make_batch_invariant(self.model)
        self.upsample = int(self.model.total_upsample)
        self.sample_rate = cfg.output_sample_rate
        self.groups = cfg.decoder_config.num_quantizers
