"""What the stages that end in audio share: int16 PCM from a waveform, how much decoding one step may take,
and when each chunk of a request's audio is due."""

from __future__ import annotations

import time

import torch

from stage_service.runtime.base import SteppedEngine


def to_pcm16(wav: torch.Tensor) -> torch.Tensor:
    """A waveform in [-1, 1] (clipped there) as int16 PCM samples."""
    return (wav.float().clamp(-1, 1) * 32767).round().to(torch.int16)


class AudioDecoderEngine(SteppedEngine):
    """A stage that decodes codec chunks into PCM on the step scheduler: chunks of equal shape from many
    requests share one forward, up to `max_batched_frames` codec frames (with their context) per step.

    On a CPU a decoder is bound by memory traffic (each frame becomes hundreds of samples through wide
    upsampling layers): past some frames per forward it gets slower per frame, so a family names that
    bound as its CPU default (`CPU_MAX_BATCHED_FRAMES`); on a GPU the default is no bound.
    """

    unit = "chunks"
    CPU_MAX_BATCHED_FRAMES: int

    def max_step_cost(self) -> int | None:
        if self.options.max_batched_frames is not None:
            return self.options.max_batched_frames
        return None if self.placement.on_cuda else self.CPU_MAX_BATCHED_FRAMES


class PlaybackDue:
    """When one request's next audio chunk is due (its step state's `due`, scheduler.py Deadlines): a listener
    starts playing at its first chunk and each later chunk must be out before the audio before it has played.
    The first is due when it is submitted (nothing plays yet); each later one when the first came out plus the
    seconds decoded so far. The stage's own clock: the hops to the listener add about the same to every chunk."""

    def __init__(self) -> None:
        self.started: float | None = None  # time.perf_counter() when the first chunk's audio came out
        self.seconds = 0.0                 # of audio out so far

    def due(self) -> float:
        return time.perf_counter() if self.started is None else self.started + self.seconds

    def played(self, samples: int, sample_rate: int) -> None:
        """A chunk of `samples` (one channel) came out."""
        if samples and sample_rate:
            if self.started is None:
                self.started = time.perf_counter()
            self.seconds += samples / sample_rate
