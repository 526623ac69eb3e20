"""Diffusion stages on diffusers components: text encoding, the denoise loop, VAE decoding.

Each stage loads one component folder of a diffusers pipeline directory
(`model: sd-tiny`, `component: text_encoder | unet | vae`). All three run on
the shared step scheduler: the denoise loop batches one UNet call per step over
every image with the same latent shape, whatever step each is at (requests join
and leave between steps); the text encoder and the VAE batch what is queued.
"""

from __future__ import annotations

import inspect
import io
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import torch

from omnistage.spec import engines

from ..scheduler import StepState
from .base import InputError, OutputChunk, StageInputs, StageRequest, SteppedEngine, tensor
from .invariance import make_batch_invariant


# --------------------------------------------------------------- text encoder

@dataclass(eq=False)
class PromptState(StepState):
    prompts: list[str]  # [prompt], or [negative, prompt] under classifier-free guidance
    finished: bool = False


class TextEncoderEngine(SteppedEngine):
    ADAPTER = engines.TEXT_ENCODER
    """prompt (+ negative prompt under classifier-free guidance) -> `embeddings` [1 or 2, tokens, dim]."""

    unit = "prompts"

    def load(self) -> None:
        from transformers import CLIPTextModel, PreTrainedTokenizerFast

        root = self.model_dir.parent
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(root / "tokenizer")
        self.encoder = CLIPTextModel.from_pretrained(self.model_dir, dtype=self.dtype).eval()
        if self.options.batch_invariant:
            make_batch_invariant(self.encoder)

    def step(self, states: list[PromptState]) -> list[torch.Tensor]:
        prompts = [q for st in states for q in st.prompts]  # every prompt is padded to the model length
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids
        with torch.inference_mode():
            emb = self.encoder(ids)[0]
        out, i = [], 0
        for st in states:
            out.append(emb[i:i + len(st.prompts)].clone())
            i += len(st.prompts)
            st.finished = True
        return out

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        p = req.params
        prompts = [p.prompt] if p.guidance_scale <= 1.0 else [p.negative_prompt, p.prompt]
        async with self.scheduler.submit(req.request_id, PromptState(prompts)) as stream:
            emb = await stream.next()
        yield OutputChunk(tensors={"embeddings": emb}, last=True, queue_ms=stream.queue_ms,
                          compute_ms=stream.compute_ms)


# ------------------------------------------------------------- denoise loop

@dataclass(eq=False)
class DenoiseState(StepState):
    scheduler: Any                 # the diffusers scheduler object: it holds per-image state
    latents: torch.Tensor          # [1, C, h, w]
    embeddings: torch.Tensor       # [1 or 2, tokens, dim]
    guidance: float
    generator: torch.Generator
    timesteps: list[torch.Tensor] = field(default_factory=list)
    done_steps: int = 0
    finished: bool = False

    @property
    def key(self):  # images share a UNet call when their latents and text shapes agree
        return tuple(self.latents.shape[1:]), tuple(self.embeddings.shape[1:])

    def held_bytes(self) -> int:
        return self.latents.nbytes + self.embeddings.nbytes

    def release(self) -> None:
        self.latents = self.embeddings = torch.empty(0)  # a [:0] view would keep the storage alive
        self.scheduler = None


class DenoiseEngine(SteppedEngine):
    ADAPTER = engines.DENOISER
    """The denoise-step loop (UNet2DCondition + the pipeline's scheduler): `embeddings` -> `latents`.

    A stage chunkSize of N emits the current latents every N steps (previews); 0 emits them once.
    """

    unit = "steps"

    def load(self) -> None:
        import diffusers
        from diffusers import SchedulerMixin, UNet2DConditionModel

        root = self.model_dir.parent
        self.unet = UNet2DConditionModel.from_pretrained(self.model_dir, dtype=self.dtype).eval()
        if self.options.batch_invariant:
            make_batch_invariant(self.unet)
        sched_cfg = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
        self.scheduler_cls: type[SchedulerMixin] = getattr(diffusers, sched_cfg["_class_name"])
        self.scheduler_cfg = sched_cfg
        self.step_takes_generator = "generator" in inspect.signature(self.scheduler_cls.step).parameters
        vae_cfg = json.loads((root / "vae" / "config.json").read_text())
        self.vae_scale = 2 ** (len(vae_cfg["block_out_channels"]) - 1)
        self.latent_channels = self.unet.config.in_channels

    def new_state(self, req: StageRequest, emb: torch.Tensor) -> DenoiseState:
        p = req.params
        sched = self.scheduler_cls.from_config(self.scheduler_cfg)  # schedulers hold per-request state
        sched.set_timesteps(p.num_inference_steps)
        g = torch.Generator().manual_seed(p.seed)
        shape = (1, self.latent_channels, p.height // self.vae_scale, p.width // self.vae_scale)
        latents = torch.randn(shape, generator=g, dtype=torch.float32).to(self.dtype) * sched.init_noise_sigma
        return DenoiseState(scheduler=sched, latents=latents, embeddings=emb, guidance=p.guidance_scale,
                            generator=g, timesteps=list(sched.timesteps))

    def step(self, states: list[DenoiseState]) -> list[torch.Tensor]:
        """One denoise step of every image in the batch, each at its own timestep, in one UNet call."""
        with torch.inference_mode():
            model_in, ts, emb = [], [], []
            for st in states:
                t = st.timesteps[st.done_steps]
                x = torch.cat([st.latents] * len(st.embeddings))  # two rows under classifier-free guidance
                model_in.append(st.scheduler.scale_model_input(x, t))
                ts.append(t.expand(len(x)))
                emb.append(st.embeddings)
            noise = self.unet(torch.cat(model_in), torch.cat(ts), encoder_hidden_states=torch.cat(emb)).sample
            out, i = [], 0
            for st in states:
                n = len(st.embeddings)
                pred = noise[i:i + n]
                i += n
                if n == 2:
                    uncond, cond = pred.chunk(2)
                    pred = uncond + st.guidance * (cond - uncond)
                t = st.timesteps[st.done_steps]
                kw = {"generator": st.generator} if self.step_takes_generator else {}
                st.latents = st.scheduler.step(pred, t, st.latents, **kw).prev_sample
                st.done_steps += 1
                st.finished = st.done_steps == len(st.timesteps)
                out.append(st.latents)
        return out

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        chunks = await inputs.collect()
        if not chunks:
            raise InputError("no embeddings arrived from the text encoder")
        emb = tensor(chunks[-1], "embeddings").to(self.dtype)
        if emb.dim() != 3 or emb.shape[0] not in (1, 2) or emb.shape[2] != self.unet.config.cross_attention_dim:
            raise InputError(f"embeddings must be [1 or 2, tokens, {self.unet.config.cross_attention_dim}], "
                             f"got {list(emb.shape)}")
        transfer_ms = sum(c.transfer_ms for c in chunks)
        del chunks
        every = self.stage.chunk_size
        st = self.new_state(req, emb)
        first, done_steps, compute_before = True, 0, 0.0
        async with self.scheduler.submit(req.request_id, st) as stream:
            async for latents in stream:
                done_steps += 1
                done = done_steps == req.params.num_inference_steps
                if done or (every and done_steps % every == 0):
                    yield OutputChunk(tensors={"latents": latents}, last=done,
                                      queue_ms=stream.queue_ms if first else 0.0,
                                      compute_ms=stream.compute_ms - compute_before,
                                      transfer_ms=transfer_ms if first else 0.0)
                    first, compute_before = False, stream.compute_ms


# ---------------------------------------------------------------- VAE decode

@dataclass(eq=False)
class LatentsState(StepState):
    latents: torch.Tensor  # [1, C, h, w]
    finished: bool = False

    @property
    def key(self):
        return tuple(self.latents.shape)

    def held_bytes(self) -> int:
        return self.latents.nbytes

    def release(self) -> None:
        self.latents = torch.empty(0)


class VaeDecodeEngine(SteppedEngine):
    ADAPTER = engines.VAE_DECODER
    """`latents` -> one PNG (tensor `image`: the encoded bytes, uint8); latents of one shape share a decode."""

    unit = "images"

    def load(self) -> None:
        from diffusers import AutoencoderKL

        self.vae = AutoencoderKL.from_pretrained(self.model_dir, dtype=self.dtype).eval()
        if self.options.batch_invariant:
            make_batch_invariant(self.vae)

    def step(self, states: list[LatentsState]) -> list[torch.Tensor]:
        from PIL import Image

        with torch.inference_mode():
            latents = torch.cat([st.latents for st in states]).to(self.dtype)
            images = self.vae.decode(latents / self.vae.config.scaling_factor).sample
        out = []
        for st, img in zip(states, images):
            arr = ((img.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
            buf = io.BytesIO()
            Image.fromarray(arr).save(buf, format="PNG")
            out.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
            st.finished = True
        return out

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        chunks = await inputs.collect()
        if not chunks:
            raise InputError("no latents arrived from the denoise stage")
        latents = tensor(chunks[-1], "latents")  # the final latents; earlier chunks are previews
        channels = self.vae.config.latent_channels
        if latents.dim() != 4 or latents.shape[:2] != (1, channels):
            raise InputError(f"latents must be [1, {channels}, h, w], got {list(latents.shape)}")
        transfer_ms = sum(c.transfer_ms for c in chunks)
        del chunks
        async with self.scheduler.submit(req.request_id, LatentsState(latents)) as stream:
            png = await stream.next()
        yield OutputChunk(tensors={"image": png}, last=True, queue_ms=stream.queue_ms,
                          compute_ms=stream.compute_ms, transfer_ms=transfer_ms)
