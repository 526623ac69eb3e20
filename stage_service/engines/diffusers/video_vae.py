"""The video VAE stage (Wan's AutoencoderKLWan): the denoise stage's 5-D `latents` -> `video` frames, streamed.

Wan's VAE decodes causally, one latent frame at a time: each of its causal 3-D convolutions keeps the last
frames of its input from the call before (a feature cache, one entry per convolution), and the first latent
frame is decoded as a chunk of its own. So the decode is a loop over latent frames whose state is that cache:
here one step of the stage's step scheduler decodes one latent frame of every request in the batch (each with
its own cache; requests join and leave between steps) and hands its frames on at once: the first latent frame
makes 1 frame, every later one `scale_factor_temporal` (4). The frames are the same as one whole
`AutoencoderKLWan.decode` (the convolutions see the same inputs either way); `chunkSize` is latent frames per
chunk, so the consumer has the first frames while the rest decode.

The requests of a step at the same size and phase (first latent frame, second, later: what their caches'
shapes depend on) share one model call, their caches joined along the batch: several requests decode faster
together. Batch invariance (`engineArgs.batch_invariant`, on by default) runs every convolution and the decoder's
attention over a batch of at least 2 (`invariance.pad_lone_convolutions`, `pad_lone_calls`: a lone request gets a
zero one beside it), where each
request's frames are the same bit for bit whatever its neighbours and their number, and a lone decode is
faster too (torch's kernels for a batch of one are slower than oneDNN's). Its frames are then those of a
WanPipeline whose VAE is padded alike (unpadded, its float frames round apart in the last bits: at most a
level of 8 bits). Off, a lone request takes the batch-of-one kernels (WanPipeline's frames bit for bit), and
a neighbour changes the last bits of a request's float frames, at most a level of 8 bits.

The latents arrive as the denoiser leaves them (normalized); they are un-normalized with the VAE config's
`latents_mean` / `latents_std` as WanPipeline does, and the frames converted to 8-bit RGB as WanPipeline's
`output_type="np"` frames are (`to_uint8_frames`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import torch

from omnistage.contract.params import InvalidRequest
from stage_service.runtime.base import Chunking, OutputChunk, StageInputs, StageRequest, SteppedEngine, tensor
from stage_service.runtime.errors import EngineConfigError, InputError, RequestFailed
from stage_service.runtime.invariance import pad_lone_calls, pad_lone_convolutions
from stage_service.runtime.per_request import alone
from stage_service.runtime.scheduler import StepState


def to_uint8_frames(decoded: torch.Tensor) -> torch.Tensor:
    """A decode's output [1, 3, n, H, W] (in [-1, 1]) as frames uint8 [n, H, W, 3] on the CPU: WanPipeline's
    `output_type="np"` conversion (x / 2 + 0.5, clamped to [0, 1], as float32), then x 255 rounded, so
    `(pipeline_frames * 255).round().astype(uint8)` is these very frames."""
    x = (decoded / 2 + 0.5).clamp(0, 1).float()
    return (x * 255).round().to(torch.uint8)[0].permute(1, 2, 3, 0).contiguous().cpu()


def batch_invariant_decode(vae: Any, attention: type[torch.nn.Module] | None = None) -> Any:
    """`vae` (an AutoencoderKLWan, or Qwen-Image's VAE of the same design with its `attention` block class) with every
    convolution and its decoder's attention run over a batch of at least 2, in place: a request's frames are then
    the same bit for bit whatever its neighbours (module docstring)."""
    if attention is None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock

        attention = WanAttentionBlock
    pad_lone_convolutions(vae)
    for m in vae.decoder.modules():  # torch's CPU attention rounds a lone call apart from a batched one
        if isinstance(m, attention):
            pad_lone_calls(m)
    return vae


@dataclass(eq=False)
class VideoLatentsState(StepState):
    latents: torch.Tensor           # [1, C, F, h, w], un-normalized, on the engine's device
    cache: list[Any] = field(default_factory=list)  # the decoder's feature cache, one entry per causal conv
    decoded: int = 0                # latent frames decoded so far
    finished: bool = False

    @property
    def frames(self) -> int:
        return self.latents.shape[2]

    # Requests share a model call when their caches have one shape: the same size, the same phase.
    @property
    def key(self):  # type: ignore[override]
        return tuple(self.latents.shape[3:]), min(self.decoded, 2)

    def held_bytes(self) -> int:
        return self.latents.nbytes + sum(t.nbytes for t in self.cache if isinstance(t, torch.Tensor))

    def release(self) -> None:
        self.latents = torch.empty(0)
        self.cache = []


class VideoVaeDecodeEngine(SteppedEngine):
    """`latents` [1, z_dim, F, h, w] -> `video` uint8 [n, H, W, 3] chunks, the last with finish reason "stop";
    one step decodes one latent frame of each request in the batch (see the module docstring)."""

    ARCHITECTURES = ("AutoencoderKLWan",)

    unit = "latent_frames"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "video" not in self.stage.emits:
            raise EngineConfigError(f'stage "{self.stage.name}": a video VAE ({self.ARCHITECTURES[0]}) emits '
                                    f"video frames; its emits must list video (it lists "
                                    f"{', '.join(self.stage.emits)})")

    def load(self) -> None:
        from diffusers import AutoencoderKLWan

        self.vae = AutoencoderKLWan.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device).eval()
        if self.batch_invariant:
            batch_invariant_decode(self.vae)
        cfg = self.vae.config
        if cfg.patch_size is not None:  # Wan 2.2's patchified VAE decodes another way
            raise EngineConfigError(f"{self.model_dir / 'config.json'}: patch_size {cfg.patch_size}: this engine "
                                    "decodes the Wan 2.1 VAE (no patch_size)")
        self.z_dim, self.spatial, self.temporal = cfg.z_dim, cfg.scale_factor_spatial, cfg.scale_factor_temporal
        self.cache_entries = self.vae._cached_conv_counts["decoder"]
        # As WanPipeline un-normalizes: latents / (1 / std) + mean, in the VAE's dtype.
        shape = (1, self.z_dim, 1, 1, 1)
        self.mean = torch.tensor(cfg.latents_mean).view(shape).to(self.device, self.dtype)
        self.inv_std = (1.0 / torch.tensor(cfg.latents_std)).view(shape).to(self.device, self.dtype)

    def step(self, states: list[VideoLatentsState]) -> list[torch.Tensor | RequestFailed]:  # type: ignore[override]
        """The next latent frame of each request, decoded: its frames uint8 [n, H, W, 3]."""
        with torch.inference_mode():
            if len(states) == 1:
                return [alone(st, self._next_frames, st) for st in states]
            return self._decoded_together(states)

    def _next_frames(self, st: VideoLatentsState) -> torch.Tensor:
        i = st.decoded
        z = self.vae.post_quant_conv(st.latents[:, :, i:i + 1])
        out = self.vae.decoder(z, feat_cache=st.cache, feat_idx=[0], first_chunk=i == 0)
        st.decoded += 1
        st.finished = st.decoded == st.frames
        return to_uint8_frames(out.clamp(-1.0, 1.0))

    def _decoded_together(self, states: list[VideoLatentsState]) -> list[torch.Tensor | RequestFailed]:
        """One model call over the next latent frame of every state (one key: one size and phase), their
        caches joined along the batch and split back (copied: a request keeps only its own rows)."""
        z = torch.cat([st.latents[:, :, st.decoded:st.decoded + 1] for st in states])
        cache = [_joined([st.cache[k] for st in states]) for k in range(self.cache_entries)]
        out = self.vae.decoder(self.vae.post_quant_conv(z), feat_cache=cache, feat_idx=[0],
                               first_chunk=states[0].decoded == 0).clamp(-1.0, 1.0)
        results: list[torch.Tensor | RequestFailed] = []
        for j, st in enumerate(states):
            st.cache = [c[j:j + 1].clone() if isinstance(c, torch.Tensor) else c for c in cache]
            st.decoded += 1
            st.finished = st.decoded == st.frames
            results.append(alone(st, to_uint8_frames, out[j:j + 1]))
        return results

    def latent_frames(self, num_frames: int) -> int:
        """Latent frames of a video of `num_frames` frames (the first alone, then `temporal` per latent frame)."""
        return (num_frames - 1) // self.temporal + 1

    def checked_latents(self, req: StageRequest, latents: torch.Tensor) -> torch.Tensor:
        """The denoiser's latents for this request's size and frames, un-normalized on the engine's device."""
        p = req.params
        want = [1, self.z_dim, self.latent_frames(p.num_frames), p.height // self.spatial, p.width // self.spatial]
        if list(latents.shape) != want:
            raise InputError(f"latents must be {want} for {p.num_frames} frames of {p.width}x{p.height}, got "
                             f"{list(latents.shape)}")
        return self.on_device(latents) / self.inv_std + self.mean

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        for name, side in (("width", req.params.width), ("height", req.params.height)):
            if side % self.spatial:
                raise InvalidRequest(f"params.image.{name}", f"must be a multiple of {self.spatial} for this video "
                                                             f"VAE, got {side}")
        chunks = await inputs.collect()
        if not chunks:
            raise InputError("no latents arrived from the denoise stage")
        latents = self.checked_latents(req, tensor(chunks[-1], "latents"))  # the final ones; earlier are previews
        transfer_ms = sum(c.transfer_ms for c in chunks)
        del chunks
        state = VideoLatentsState(latents, cache=[None] * self.cache_entries)
        total = state.frames
        del latents
        chunking, pending, decoded, compute_before = Chunking(self.stage), [], 0, 0.0
        async with self.scheduler.submit(req.request_id, state) as stream:
            async for frames in stream:
                pending.append(frames)
                decoded += 1
                done = decoded == total
                if chunking.due(1, done):
                    video = pending[0] if len(pending) == 1 else torch.cat(pending)
                    pending = []
                    yield chunking.hand_on(OutputChunk(tensors={"video": video}, last=done,
                                                       finish_reason="stop" if done else "",
                                                       compute_ms=stream.compute_ms - compute_before),
                                           queue_ms=stream.queue_ms, transfer_ms=transfer_ms)
                    compute_before = stream.compute_ms


def _joined(entries: list[Any]) -> Any:
    """One cache entry of several requests as one batch: their tensors joined, or the marker they share (None
    before the first latent frame; the decoder's "Rep" for a time upsampling that has seen only the first)."""
    if isinstance(entries[0], torch.Tensor):
        return torch.cat(entries)
    if any(e != entries[0] for e in entries):  # the key keeps phases apart: this would be a bug, not a request's
        raise RuntimeError(f"video VAE caches of different phases in one batch: {sorted(set(map(repr, entries)))}")
    return entries[0]
