"""Qwen2.5-Omni stages on transformers: Thinker (text + rows), Talker (codec tokens), Token2Wav (PCM
audio, chunked). Async adapters over qwen2_5_omni_steps and qwen2_5_omni_token2wav, each on the shared
step scheduler; each loads only its part of the combined published checkpoint (`self.checkpoint`)."""

from __future__ import annotations

from typing import AsyncIterator

import torch

from omnistage.checkpoints.shards import ShardedCheckpoint
from stage_service.engines.omni.audio import AudioDecoderEngine, PlaybackDue, to_pcm16
from stage_service.engines.omni.encoder import OmniEncoderEngine
from stage_service.engines.omni.media import QWEN2_5_OMNI
from stage_service.engines.omni.talker import FedTalkerEngine
from stage_service.engines.omni.thinker import OmniThinkerEngine
from stage_service.engines.qwen2_5_omni.steps import SPEECH_SYSTEM_PROMPT, Talker, Thinker
from stage_service.engines.qwen2_5_omni.token2wav import SpeechChunkState, Token2Wav
from stage_service.runtime.base import InputError, OutputChunk, StageInputs, StageRequest, tensor
from stage_service.runtime.components import read_config


class _Checkpoint:
    """The combined checkpoint at the stage's model directory and its config."""

    def open_checkpoint(self):
        from transformers import Qwen2_5OmniConfig

        self.checkpoint = ShardedCheckpoint(self.model_dir)
        return read_config(self.model_dir, Qwen2_5OmniConfig)


class ThinkerEngine(_Checkpoint, OmniThinkerEngine):
    DEFAULT_SYSTEM_PROMPT = SPEECH_SYSTEM_PROMPT
    MEDIA_FAMILY = QWEN2_5_OMNI

    def load(self) -> None:
        config = self.open_checkpoint()
        self.use_thinker(Thinker(self.checkpoint, config, self.dtype, batch_invariant=self.batch_invariant,
                                 encoders=not self.stage.inputs, device=self.device, paged=self.kv_paged))
        text = config.thinker_config.text_config
        self.max_len = min(x for x in (text.max_position_embeddings, self.options.max_model_len) if x)


class TalkerEngine(FedTalkerEngine):
    """Consumes the Thinker's rows as they arrive; emits `codes` [1, frames] per chunk."""

    REPETITION_PENALTY = 1.05  # as Qwen2.5-Omni's generate()

    @staticmethod
    def build_talker(model_dir, dtype: torch.dtype, batch_invariant: bool, device) -> Talker:
        from transformers import Qwen2_5OmniConfig

        return Talker(ShardedCheckpoint(model_dir), read_config(model_dir, Qwen2_5OmniConfig), dtype,
                      batch_invariant=batch_invariant, device=device)

    def spoken_rows(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + embeds  # generate() feeds the Talker the sum (in this order)


class Token2WavEngine(_Checkpoint, AudioDecoderEngine):
    """Turns the Talker's codec tokens into int16 PCM as they arrive (see qwen2_5_omni_token2wav for how
    chunk boundaries are handled); chunks of equal shape from many requests share one forward."""

    CPU_MAX_BATCHED_FRAMES = 200

    def load(self) -> None:
        config = self.open_checkpoint()
        self.t2w = Token2Wav(self.checkpoint, config, batch_invariant=self.batch_invariant, device=self.device)

    def step(self, states: list[SpeechChunkState]) -> list:
        return [(mel, to_pcm16(wav)) for mel, wav in self.t2w.decode_batch(states)]

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        speech = self.t2w.stream(self.t2w.voice(req.params.speaker), req.params.seed)
        admitted = False
        playback = PlaybackDue()
        while True:
            chunk = await inputs.next()
            ended = chunk is None or chunk.end_of_stream
            if chunk is not None:
                codes = self.on_device(tensor(chunk, "codes"))
                if codes.dim() != 2 or codes.shape[0] != 1:
                    raise InputError(f"codes must be [1, tokens], got {list(codes.shape)}")
                if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.t2w.codebook):
                    raise InputError(f"codes must lie in [0, {self.t2w.codebook})")
                try:
                    speech.add(codes[0], ended)
                except ValueError as e:
                    raise InputError(str(e)) from None
            else:
                speech.add(torch.empty(0, dtype=torch.int64, device=self.device), ended=True)
            pcm = torch.empty(0, dtype=torch.int16, device=self.device)
            queue_ms = compute_ms = 0.0
            if (work := speech.next_chunk()) is not None:
                work.due = playback.due()
                # Later chunks of an admitted request skip the queue limit: refusing them would break a stream.
                async with self.scheduler.submit(req.request_id, work, admitted=admitted) as stream:
                    mel, pcm = await stream.next()
                playback.played(pcm.numel(), self.t2w.sample_rate)
                speech.done(work, mel)
                admitted = True
                queue_ms, compute_ms = stream.queue_ms, stream.compute_ms
            yield OutputChunk(tensors={"audio": pcm}, sample_rate=self.t2w.sample_rate, last=ended,
                              queue_ms=queue_ms, compute_ms=compute_ms,
                              transfer_ms=chunk.transfer_ms if chunk is not None else 0.0)
            if ended:
                return


class EncoderEngine(OmniEncoderEngine):
    """The Thinker's vision and audio encoders as their own stage."""

    MEDIA_FAMILY = QWEN2_5_OMNI
    DEFAULT_SYSTEM_PROMPT = SPEECH_SYSTEM_PROMPT

    @staticmethod
    def classes():
        from transformers import Qwen2_5OmniConfig, Qwen2_5OmniThinkerForConditionalGeneration
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniAudioEncoder,
            Qwen2_5OmniVisionEncoder,
        )

        return (Qwen2_5OmniConfig, Qwen2_5OmniThinkerForConditionalGeneration, Qwen2_5OmniVisionEncoder,
                Qwen2_5OmniAudioEncoder)


ENGINES = {"encoder": EncoderEngine, "thinker": ThinkerEngine, "talker": TalkerEngine,
           "token2wav": Token2WavEngine}  # by stage component
