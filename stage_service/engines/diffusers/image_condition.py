"""The image-to-video conditioning stage (WanImageToVideoPipeline's `image_encoder` component): the request's
reference image -> what the denoise loop conditions each video on.

Two tensors, as the pipeline makes them before its loop:
- `image_embeddings` [1, tokens, width]: the CLIP vision encoder's penultimate hidden states over the image as
  the pipeline's own `image_processor` prepares it (`encode_image`); the Wan DiT attends to them beside the
  prompt's;
- `condition` [1, mask + latent channels, latent frames, h, w] (float32): a first-frame mask (1 over the latent
  frame that holds the reference, 0 after it, one channel per frame the VAE folds into a latent frame) beside
  the video VAE's encoding of the reference resized to the video's size followed by black frames, normalized
  with the VAE config's `latents_mean` / `latents_std` (`prepare_latents`). The denoise loop puts these channels
  beside its noise latents at every step.

So the stage reads the image encoder and the VAE's encoder; the VAE stage decodes, the denoise stage never
sees pixels. Decoding the image, the CLIP processor and the resize to the video's size run on the stage's media
threads (`runtime/media_work.py`), beside the step loop. Requests queued together share one CLIP call; each
video's VAE encoding runs alone (its frame count and size are its own, and the causal encoder keeps a cache per
call). A size or frame count the denoise stage would refuse is refused here first, by the same check
(`engines.check_size`), before any encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np
import torch

from omnistage.api import Limits
from omnistage.contract.params import InvalidRequest
from omnistage.media import Image, decode_parts
from stage_service.engines.diffusers.engines import DenoiserShape, check_size, vae_scales
from stage_service.engines.diffusers.layout import PipelineDir
from stage_service.runtime.base import OutputChunk, StageInputs, StageRequest, SteppedEngine
from stage_service.runtime.invariance import make_batch_invariant
from stage_service.runtime.media_work import MediaStage
from stage_service.runtime.per_request import alone
from stage_service.runtime.scheduler import StepState


@dataclass(eq=False)
class ReferenceState(StepState):
    pixels: torch.Tensor  # [1, 3, side, side]: the image as the CLIP processor prepares it
    frame: torch.Tensor   # [1, 3, H, W] in [-1, 1], float32: the image at the video's size
    num_frames: int
    finished: bool = False

    def held_bytes(self) -> int:
        return self.pixels.nbytes + self.frame.nbytes

    def release(self) -> None:
        self.pixels = self.frame = torch.empty(0)


def first_frame_mask(num_frames: int, temporal: int, latent_h: int, latent_w: int) -> torch.Tensor:
    """[1, temporal, latent frames, h, w]: 1 where a frame is the reference (the first), 0 after it, each latent
    frame's `temporal` frames as channels (the first frame repeated to fill its latent frame), as
    WanImageToVideoPipeline.prepare_latents lays it out."""
    mask = torch.ones(1, 1, num_frames, latent_h, latent_w)
    mask[:, :, 1:] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
    mask = torch.cat([first, mask[:, :, 1:]], dim=2)
    return mask.view(1, -1, temporal, latent_h, latent_w).transpose(1, 2)


def reference_image(parts: tuple, limits: Limits, use: str = "image-to-video") -> Any:
    """The request's one image part, decoded and bounded as the orchestrator checked it, as a PIL image (`use`: what
    the stage makes from it, for the refusal of none or several)."""
    from PIL import Image as PILImage

    decoded = decode_parts(parts, limits, frozenset({"text", "image"}))
    images = [p for p in decoded if isinstance(p, Image)]
    if len(images) != 1:
        raise InvalidRequest("params.parts", f"{use} takes one reference image, got {len(images)}")
    return PILImage.fromarray(np.ascontiguousarray(images[0].pixels))


class ImageConditionEngine(MediaStage, SteppedEngine):
    """reference image -> `image_embeddings` and `condition` (module docstring)."""

    ARCHITECTURES = ("CLIPVisionModel",)  # the component's class

    unit = "images"

    def load(self) -> None:
        from diffusers.video_processor import VideoProcessor

        pipe = PipelineDir(self.model_dir, self.stage.trust_remote_code)
        self.encoder = pipe.load("image_encoder", device=self.device, dtype=self.dtype)
        if self.batch_invariant:
            make_batch_invariant(self.encoder)
        self.processor = pipe.load("image_processor")
        self.vae = pipe.load("vae", device=self.device, dtype=self.dtype)
        self.spatial, self.temporal = vae_scales(pipe)
        self.denoiser = DenoiserShape.of(pipe)  # the sizes the denoise stage takes, refused here first
        self.video = VideoProcessor(vae_scale_factor=self.spatial)
        cfg = self.vae.config
        self.latents_mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, cfg.z_dim, 1, 1, 1)
        self.latents_inv_std = 1.0 / torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, cfg.z_dim, 1, 1, 1)

    def prepare(self, p) -> ReferenceState:
        """On a media thread: the image decoded, as CLIP's processor prepares it, and at the video's size."""
        image = reference_image(p.parts, self.pipeline.limits)
        pixels = self.processor(images=image, return_tensors="pt")["pixel_values"]
        frame = self.video.preprocess(image, height=p.height, width=p.width).to(torch.float32)
        return ReferenceState(pixels, frame, p.num_frames)

    def step(self, states: list[ReferenceState]) -> list[dict[str, torch.Tensor]]:
        with torch.inference_mode():
            pixels = torch.cat([st.pixels for st in states]).to(self.device)
            hidden = self.encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
            out = []
            for i, st in enumerate(states):
                out.append(alone(st, self._conditioned, st, hidden[i:i + 1]))
                st.finished = True
        return out

    def _conditioned(self, st: ReferenceState, embeddings: torch.Tensor) -> dict[str, torch.Tensor]:
        """The video's own part: its reference at its size through the VAE's encoder, beside the mask."""
        frames = st.frame.to(self.device).unsqueeze(2)  # [1, 3, 1, H, W]: the reference, then black frames
        video = torch.cat([frames, frames.new_zeros(1, 3, st.num_frames - 1, *frames.shape[-2:])], dim=2)
        latents = self.vae.encode(video.to(self.dtype)).latent_dist.mode().to(torch.float32)
        latents = (latents - self.latents_mean.to(latents.device)) * self.latents_inv_std.to(latents.device)
        mask = first_frame_mask(st.num_frames, self.temporal, latents.shape[-2], latents.shape[-1])
        return {"image_embeddings": embeddings.clone(),
                "condition": torch.cat([mask.to(latents.device), latents], dim=1)}

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        check_size(req.params, self.denoiser)
        state = await self.media.run(self.prepare, req.params)
        async with self.scheduler.submit(req.request_id, state) as stream:
            conditioned = await stream.next()
        yield OutputChunk(tensors=conditioned, last=True, queue_ms=stream.queue_ms, compute_ms=stream.compute_ms)
