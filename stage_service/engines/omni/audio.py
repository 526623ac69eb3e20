"""What the stages that end in audio share: int16 PCM from a waveform, and how much decoding one step
may take."""

from __future__ import annotations

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
