"""Diffusion stages on diffusers components: text encoding, the denoise loop, VAE decoding.

Each stage loads one component folder of a diffusers pipeline directory
(`model: sd-tiny`, `component: text_encoder | unet | vae`).
"""

from __future__ import annotations

import io
import json
from typing import AsyncIterator

import torch

from .base import InputError, OutputChunk, SerialEngine, StageInputs, StageRequest, tensor


class TextEncoderEngine(SerialEngine):
    """prompt (+ negative prompt under classifier-free guidance) -> `embeddings` [1 or 2, tokens, dim]."""

    def load(self) -> None:
        from transformers import CLIPTextModel, PreTrainedTokenizerFast

        root = self.model_dir.parent
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(root / "tokenizer")
        self.encoder = CLIPTextModel.from_pretrained(self.model_dir, dtype=self.dtype).eval()

    def _encode(self, prompts: list[str]) -> torch.Tensor:
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids
        with torch.inference_mode():
            return self.encoder(ids)[0]

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        p = req.params
        prompts = [p.prompt] if p.guidance_scale <= 1.0 else [p.negative_prompt, p.prompt]
        async with self.slot() as queue_ms:
            emb, ms = await self.run(self._encode, prompts)
        yield OutputChunk(tensors={"embeddings": emb}, last=True, queue_ms=queue_ms, compute_ms=ms)


class DenoiseEngine(SerialEngine):
    """The denoise-step loop (UNet2DCondition + the pipeline's scheduler): `embeddings` -> `latents`.

    A stage chunkSize of N emits the current latents every N steps (previews); 0 emits them once.
    """

    def load(self) -> None:
        from diffusers import SchedulerMixin, UNet2DConditionModel
        import diffusers

        root = self.model_dir.parent
        self.unet = UNet2DConditionModel.from_pretrained(self.model_dir, dtype=self.dtype).eval()
        sched_cfg = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
        self.scheduler_cls: type[SchedulerMixin] = getattr(diffusers, sched_cfg["_class_name"])
        self.scheduler_cfg = sched_cfg
        vae_cfg = json.loads((root / "vae" / "config.json").read_text())
        self.vae_scale = 2 ** (len(vae_cfg["block_out_channels"]) - 1)
        self.latent_channels = self.unet.config.in_channels

    def _init(self, req: StageRequest, emb: torch.Tensor):
        p = req.params
        sched = self.scheduler_cls.from_config(self.scheduler_cfg)  # schedulers hold per-request state
        sched.set_timesteps(p.num_inference_steps)
        g = torch.Generator().manual_seed(p.seed)
        shape = (1, self.latent_channels, p.height // self.vae_scale, p.width // self.vae_scale)
        latents = torch.randn(shape, generator=g, dtype=torch.float32).to(self.dtype) * sched.init_noise_sigma
        return sched, latents

    def _step(self, sched, latents: torch.Tensor, t, emb: torch.Tensor, guidance: float) -> torch.Tensor:
        with torch.inference_mode():
            cfg = emb.shape[0] == 2
            model_in = torch.cat([latents] * 2) if cfg else latents
            model_in = sched.scale_model_input(model_in, t)
            noise = self.unet(model_in, t, encoder_hidden_states=emb).sample
            if cfg:
                uncond, cond = noise.chunk(2)
                noise = uncond + guidance * (cond - uncond)
            return sched.step(noise, t, latents).prev_sample

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        chunks = await inputs.collect()
        if not chunks:
            raise InputError("no embeddings arrived from the text encoder")
        emb = tensor(chunks[-1], "embeddings").to(self.dtype)
        if emb.dim() != 3 or emb.shape[0] not in (1, 2) or emb.shape[2] != self.unet.config.cross_attention_dim:
            raise InputError(f"embeddings must be [1 or 2, tokens, {self.unet.config.cross_attention_dim}], "
                             f"got {list(emb.shape)}")
        every = self.stage.chunk_size
        async with self.slot() as queue_ms:
            (sched, latents), compute = await self.run(self._init, req, emb)
            steps = list(sched.timesteps)
            first = True
            for i, t in enumerate(steps):
                latents, ms = await self.run(self._step, sched, latents, t, emb, req.params.guidance_scale)
                compute += ms
                done = i == len(steps) - 1
                if done or (every and (i + 1) % every == 0):
                    yield OutputChunk(tensors={"latents": latents}, last=done, queue_ms=queue_ms if first else 0.0,
                                      compute_ms=compute, transfer_ms=sum(c.transfer_ms for c in chunks) if first else 0)
                    first = False
                    compute = 0.0


class VaeDecodeEngine(SerialEngine):
    """`latents` -> one PNG (tensor `image`: the encoded bytes, uint8)."""

    def load(self) -> None:
        from diffusers import AutoencoderKL

        self.vae = AutoencoderKL.from_pretrained(self.model_dir, dtype=self.dtype).eval()

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        from PIL import Image

        with torch.inference_mode():
            img = self.vae.decode(latents.to(self.dtype) / self.vae.config.scaling_factor).sample[0]
        arr = ((img.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        chunks = await inputs.collect()
        if not chunks:
            raise InputError("no latents arrived from the denoise stage")
        latents = tensor(chunks[-1], "latents")  # the final latents; earlier chunks are previews
        channels = self.vae.config.latent_channels
        if latents.dim() != 4 or latents.shape[:2] != (1, channels):
            raise InputError(f"latents must be [1, {channels}, h, w], got {list(latents.shape)}")
        async with self.slot() as queue_ms:
            png, ms = await self.run(self._decode, latents)
        yield OutputChunk(tensors={"image": png}, last=True, queue_ms=queue_ms, compute_ms=ms,
                          transfer_ms=sum(c.transfer_ms for c in chunks))
