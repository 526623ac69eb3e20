"""The image-editing reference stage (FluxKontextPipeline's; `component: image_encoder`, which reads the VAE's
encoder): the request's image to edit -> its VAE latents, which the denoise loop takes as tokens beside the noise's.

As FluxKontextPipeline prepares its `image` before its loop: the image (its sides first cut down to whole 16-pixel
patches: the VAE's 8 x the 2x2 packing) resized to the preferred Kontext resolution whose aspect ratio is nearest
its own (the pipeline's `PREFERRED_KONTEXT_RESOLUTIONS`, read from diffusers), in [-1, 1] (its VaeImageProcessor),
through the VAE's encoder (the distribution's mode), shifted and scaled as the VAE's config says: `image_latents`
[1, latent channels, h / 8, w / 8]. The image's size sets the reference's tokens, never the size of the image made
(the request's width and height).

Decoding and resizing run on the stage's media threads (`runtime/media_work.py`), beside the step loop. Images
queued together whose resized sizes agree share one VAE encode (batch invariant, as the decode stage's VAE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

import torch

from omnistage.contract.params import InvalidRequest
from stage_service.engines.diffusers.engines import vae_scales
from stage_service.engines.diffusers.image_condition import reference_image
from stage_service.engines.diffusers.layout import PipelineDir
from stage_service.runtime.base import OutputChunk, StageInputs, StageRequest, SteppedEngine
from stage_service.runtime.invariance import make_batch_invariant
from stage_service.runtime.media_work import MediaStage
from stage_service.runtime.scheduler import StepState

PACKING = 2  # FLUX's 2x2 latent patches: the image's sides are whole patches of the VAE's latents


@dataclass(eq=False)
class EditState(StepState):
    pixels: torch.Tensor  # [1, 3, H, W] in [-1, 1]: the image at its preferred Kontext resolution
    finished: bool = False

    @property
    def key(self):  # images of one resized size share an encode
        return tuple(self.pixels.shape)

    def held_bytes(self) -> int:
        return self.pixels.nbytes

    def release(self) -> None:
        self.pixels = torch.empty(0)


def preferred_size(width: int, height: int, multiple: int, preferred) -> tuple[int, int]:
    """(width, height) FluxKontextPipeline resizes an image of this size to: its sides cut down to `multiple`, the
    `preferred` (width, height) whose aspect ratio is nearest theirs (ties to the narrower), cut down to `multiple`."""
    width, height = width - width % multiple, height - height % multiple
    if not (width and height):
        raise InvalidRequest("params.parts", f"the image to edit must be at least {multiple} x {multiple} pixels")
    aspect = width / height
    _, w, h = min((abs(aspect - w / h), w, h) for w, h in preferred)
    return w // multiple * multiple, h // multiple * multiple


class ReferenceLatentsEngine(MediaStage, SteppedEngine):
    """image to edit -> `image_latents` (module docstring)."""

    ARCHITECTURES = ("AutoencoderKL",)  # the component the stage loads: the VAE, for its encoder

    unit = "images"

    def load(self) -> None:
        from diffusers.image_processor import VaeImageProcessor
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        pipe = PipelineDir(self.model_dir, self.stage.trust_remote_code)
        self.vae = pipe.load("vae", device=self.device, dtype=self.dtype)
        if self.batch_invariant:
            make_batch_invariant(self.vae)
        self.multiple = vae_scales(pipe)[0] * PACKING
        self.processor = VaeImageProcessor(vae_scale_factor=self.multiple)  # as the pipeline makes its own
        self.preferred = tuple(PREFERRED_KONTEXT_RESOLUTIONS)
        cfg = self.vae.config
        self.shift, self.scaling = cfg.shift_factor or 0.0, cfg.scaling_factor

    def prepare(self, p) -> EditState:
        """On a media thread: the image decoded and resized as the pipeline resizes it."""
        image = reference_image(p.parts, self.pipeline.limits, "image editing")
        width, height = preferred_size(image.width, image.height, self.multiple, self.preferred)
        image = self.processor.resize(image, height, width)
        return EditState(self.processor.preprocess(image, height, width).to(torch.float32))

    def step(self, states: list[EditState]) -> list[dict[str, torch.Tensor]]:
        with torch.inference_mode():
            pixels = torch.cat([st.pixels for st in states]).to(self.device, self.dtype)
            latents = (self.vae.encode(pixels).latent_dist.mode() - self.shift) * self.scaling
        out = []
        for i, st in enumerate(states):
            out.append({"image_latents": latents[i:i + 1].clone()})
            st.finished = True
        return out

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        state = await self.media.run(self.prepare, req.params)
        async with self.scheduler.submit(req.request_id, state) as stream:
            encoded = await stream.next()
        yield OutputChunk(tensors=encoded, last=True, queue_ms=stream.queue_ms, compute_ms=stream.compute_ms)
