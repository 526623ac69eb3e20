"""Qwen3-Omni stages on transformers: Thinker (text + hidden states), Talker (codec frames),
Code2Wav (PCM audio). Async adapters over the batched step functions in qwen3_omni_steps,
each on the shared step scheduler. Every stage gets the root of the one combined checkpoint
(`model_dir`) and reads its own part of it (`ENGINES`, by the stage's `component`); its
`checkpoint` says what it read."""

from __future__ import annotations

from typing import AsyncIterator

import torch

from stage_service.engines.omni.audio import AudioDecoderEngine, PlaybackDue, to_pcm16
from stage_service.engines.omni.encoder import OmniEncoderEngine
from stage_service.engines.omni.media import QWEN3_OMNI
from stage_service.engines.omni.talker import FedTalkerEngine
from stage_service.engines.omni.thinker import OmniThinkerEngine
from stage_service.engines.qwen3_omni.steps import Code2Wav, Talker, Thinker
from stage_service.runtime.base import InputChunk, InputError, OutputChunk, StageInputs, StageRequest, tensor


class ThinkerEngine(OmniThinkerEngine):

    def load(self) -> None:
        # Fed by an encoder stage, the Thinker neither reads nor keeps the encoders.
        self.use_thinker(Thinker(self.model_dir, self.dtype, batch_invariant=self.batch_invariant,
                                 encoders=not self.stage.inputs, device=self.device, paged=self.kv_paged))
        self.checkpoint = self.thinker.checkpoint
        self.max_len = min(x for x in (self.thinker.max_positions, self.options.max_model_len) if x)


class TalkerEngine(FedTalkerEngine):
    """Consumes the Thinker's embedding rows as they arrive; emits `codes` [groups, frames] per chunk."""

    REPETITION_PENALTY = 1.05  # as Qwen3-Omni's generate()

    @staticmethod
    def build_talker(model_dir, dtype: torch.dtype, batch_invariant: bool, device) -> Talker:
        return Talker(model_dir, dtype, batch_invariant=batch_invariant, device=device)

    def spoken_rows(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return embeds  # the Talker speaks the text projection of the Thinker's embeddings


class Code2WavEngine(AudioDecoderEngine):
    """Decodes each incoming chunk of codec frames (with left context) into int16 PCM as it arrives;
    chunks of equal length from many requests share one forward."""

    CPU_MAX_BATCHED_FRAMES = 100  # a frame becomes 1920 samples; past ~100 a CPU forward slows per frame

    DECODER: type[Code2Wav] = Code2Wav  # the model part it decodes with (a family's own codec decoder)

    def load(self) -> None:
        self.c2w = self.DECODER(self.model_dir, self.dtype, batch_invariant=self.batch_invariant,
                                device=self.device)
        self.checkpoint = self.c2w.checkpoint
        self.codebook = self.c2w.model.config.codebook_size

    def step(self, states) -> list[torch.Tensor]:
        return [to_pcm16(w) for w in self.c2w.decode_batch(states)]

    def first_history(self, chunk: InputChunk) -> torch.Tensor:
        """The left context of a request's first chunk (none: its frames are the first)."""
        return torch.empty((self.c2w.groups, 0), dtype=torch.int64, device=self.device)

    def checked_codes(self, codes: torch.Tensor, name: str = "codes") -> torch.Tensor:
        """`codes` [groups, frames] in the codebook, or InputError naming `name`."""
        if codes.dim() != 2 or codes.shape[0] != self.c2w.groups:
            raise InputError(f"{name} must be [{self.c2w.groups}, frames], got {list(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook):
            raise InputError(f"{name} must lie in [0, {self.codebook})")
        return codes

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        history = None
        admitted = False
        playback = PlaybackDue()
        async for chunk in inputs.chunks():
            if history is None:
                history = self.first_history(chunk)
            codes = self.checked_codes(self.on_device(tensor(chunk, "codes")))
            pcm = torch.empty(0, dtype=torch.int16, device=self.device)
            queue_ms = compute_ms = 0.0
            if codes.shape[1]:
                # Later chunks of an admitted request skip the queue limit: refusing them would break a stream.
                state = self.c2w.chunk_state(history, codes)
                state.due = playback.due()
                async with self.scheduler.submit(req.request_id, state, admitted=admitted) as stream:
                    pcm = await stream.next()
                playback.played(pcm.numel(), self.c2w.sample_rate)
                admitted = True
                queue_ms, compute_ms = stream.queue_ms, stream.compute_ms
                history = torch.cat([history, codes], dim=1)[:, -self.c2w.LEFT_CONTEXT:]
            yield OutputChunk(tensors={"audio": pcm}, sample_rate=self.c2w.sample_rate, last=chunk.end_of_stream,
                              queue_ms=queue_ms, compute_ms=compute_ms, transfer_ms=chunk.transfer_ms)
            if chunk.end_of_stream:
                return
        yield OutputChunk(tensors={"audio": torch.empty(0, dtype=torch.int16, device=self.device)},
                          sample_rate=self.c2w.sample_rate, last=True)


class EncoderEngine(OmniEncoderEngine):
    """The Thinker's vision and audio encoders as their own stage."""

    MEDIA_FAMILY = QWEN3_OMNI

    @staticmethod
    def classes():
        from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeThinkerForConditionalGeneration
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeAudioEncoder,
            Qwen3OmniMoeVisionEncoder,
        )

        return (Qwen3OmniMoeConfig, Qwen3OmniMoeThinkerForConditionalGeneration, Qwen3OmniMoeVisionEncoder,
                Qwen3OmniMoeAudioEncoder)


# The engine of each component of a combined Qwen3-Omni checkpoint (a stage's `component`).
ENGINES = {"encoder": EncoderEngine, "thinker": ThinkerEngine, "talker": TalkerEngine, "code2wav": Code2WavEngine}
