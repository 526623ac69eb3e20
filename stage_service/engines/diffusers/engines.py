"""Diffusion stages on diffusers components: text encoding, the denoise loop, VAE decoding.

Each stage loads one component folder of a diffusers pipeline directory as published
(`model: sd-tiny`, `component: text_encoder | unet | vae`; an SD3-style DiT pipeline:
`text_encoder | transformer | vae`). What differs between pipeline families is configuration, not
engines: the text stage's prompt encoding by pipeline class (diffusion_text.py), the denoiser's call by
model class (diffusion_denoisers.py), the scheduler class by `scheduler_config.json`, the VAE's latent
shift and scale by its config. All three run on the shared step scheduler: the denoise loop batches one
model call per step over every image with the same latent and text shapes, whatever step each is at
(requests join and leave between steps); the text encoder and the VAE batch what is queued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import io
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import numpy as np
import torch

from omnistage.contract.devices import DevicePlan
from omnistage.contract.params import InvalidRequest, RequestParams
from omnistage.families import adapter_for
from omnistage.families.adapters import REFERENCE_IMAGE
from stage_service.engines.diffusers.denoisers import DENOISERS
from stage_service.engines.diffusers.layout import PipelineDir
from stage_service.engines.diffusers.step_cache import CachedRequest, StepCachePolicy, StepCacheState, cached_forward
from stage_service.engines.diffusers.text import prompt_encoder
from stage_service.runtime import device
from stage_service.runtime.base import (
    Chunking,
    InputChunk,
    OutputChunk,
    StageInputs,
    StageRequest,
    SteppedEngine,
    tensor,
)
from stage_service.runtime.engine_process import CoreStates, PendingReply, RemoteState
from stage_service.runtime.errors import EngineConfigError, EngineDead, EngineError, InputError, RequestFailed
from stage_service.runtime.invariance import make_batch_invariant
from stage_service.runtime.per_request import alone
from stage_service.runtime.scheduler import StepState

log = logging.getLogger("omnistage.stage")

# --------------------------------------------------------------- text encoder

@dataclass(eq=False)
class PromptState(StepState):
    prompts: list[str]  # [prompt], or [negative, prompt] under classifier-free guidance
    finished: bool = False


class TextEncoderEngine(SteppedEngine):
    """prompt (+ negative prompt under classifier-free guidance) -> `embeddings` [1 or 2, tokens, dim], and
    what else the pipeline's denoiser takes (SD3, FLUX.1: `pooled_embeddings` [1 or 2, dim]); the rows as the
    pipeline's prompt encoding says (`PromptEncoder.prompts`: FLUX.1's one row)."""

    ARCHITECTURES = ("CLIPTextModel", "CLIPTextModelWithProjection", "UMT5EncoderModel",  # the component's class
                     "Qwen2_5_VLForConditionalGeneration")


    unit = "prompts"

    def load(self) -> None:
        self.encoder = prompt_encoder(PipelineDir(self.model_dir, self.stage.trust_remote_code), self.dtype,
                                      self.batch_invariant, self.device)

    def step(self, states: list[PromptState]) -> list[dict[str, torch.Tensor]]:
        prompts = [q for st in states for q in st.prompts]  # every prompt is padded to the model length
        with torch.inference_mode():
            encoded = self.encoder.encode(prompts)
        out, i = [], 0
        for st in states:
            out.append(self.encoder.request_rows({name: t[i:i + len(st.prompts)].clone()
                                                  for name, t in encoded.items()}))
            i += len(st.prompts)
            st.finished = True
        return out

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        prompts = self.encoder.prompts(req.params)
        async with self.scheduler.submit(req.request_id, PromptState(prompts)) as stream:
            encoded = await stream.next()
        yield OutputChunk(tensors=encoded, last=True, queue_ms=stream.queue_ms, compute_ms=stream.compute_ms)


# ------------------------------------------------------------- denoise loop

@dataclass(eq=False)
class DenoiseState(StepState):
    scheduler: Any                 # the diffusers scheduler object: it holds per-image state
    latents: torch.Tensor          # [1, C, h, w]; a video's [1, C, latent frames, h, w]; in DenoiserCall.latents_dtype
    text: dict[str, torch.Tensor]  # forward argument -> [1 or 2 rows, ...]: [unconditional, conditional]
    guidance: float  # each row's guidance scale, where the model takes it as an input (FLUX.1-dev's)
    generator: torch.Generator
    # image-to-video: the channels put beside the latents at every step [1, C', ...latents' shape[2:]] (float32)
    condition: torch.Tensor | None = None
    # image editing: the reference image's latents [1, C, h', w'], put beside the latents' tokens at every step
    reference: torch.Tensor | None = None
    timesteps: list[torch.Tensor] = field(default_factory=list)
    done_steps: int = 0
    finished: bool = False
    cache: StepCacheState | None = None  # with the step cache on (step_cache.py)
    cfg_scale: float = 1.0  # two rows' combination scale: `guidance`, or true CFG's scale (FLUX's true_cfg_scale)

    @property
    def rows(self) -> int:
        return len(next(iter(self.text.values())))

    @property
    def key(self):  # images share a model call when their latents, condition, reference and text shapes agree
        condition = None if self.condition is None else tuple(self.condition.shape[1:])
        reference = None if self.reference is None else tuple(self.reference.shape[1:])
        return (tuple(self.latents.shape[1:]), condition, reference,
                tuple((k, tuple(t.shape[1:])) for k, t in self.text.items()))

    def held_bytes(self) -> int:
        beside = sum(t.nbytes for t in (self.condition, self.reference) if t is not None)
        cache = 0 if self.cache is None else self.cache.held_bytes()
        return self.latents.nbytes + beside + cache + sum(t.nbytes for t in self.text.values())

    def release(self) -> None:
        self.latents = torch.empty(0)  # a [:0] view would keep the storage alive
        self.text = {}
        self.condition = self.reference = None
        self.scheduler = None
        if self.cache is not None:
            self.cache.release()


def _is_image_encoder(stage) -> bool:
    adapter = adapter_for(stage.engine, stage.kind, stage.component)
    return adapter is not None and adapter.name in REFERENCE_IMAGE


def _named(chunks: list[InputChunk], name: str) -> torch.Tensor:
    """The tensor `name` of whichever input edge's chunk carries it."""
    for chunk in chunks:
        if name in chunk.tensors:
            return chunk.tensors[name]
    return tensor(chunks[0], name) if len(chunks) == 1 else _missing(chunks, name)


def _missing(chunks: list[InputChunk], name: str) -> torch.Tensor:
    have = ", ".join(f'"{c.stage}" ({", ".join(c.tensors) or "none"})' for c in chunks)
    raise InputError(f'no input stage sent a tensor "{name}" (stages: {have})')


def vae_scales(pipe: PipelineDir) -> tuple[int, int]:
    """(spatial, temporal) compression of the pipeline's VAE. A video VAE's config names both
    (AutoencoderKLWan's `scale_factor_spatial`, `scale_factor_temporal`; its class's defaults where a
    published config predates them, as diffusers fills them in); an image VAE halves the side in each
    block after the first and has no frames; Qwen-Image's (a one-frame causal VAE of Wan's design, its config
    naming neither) once per `temperal_downsample` entry, as QwenImagePipeline computes it."""
    cfg = pipe.config("vae")
    defaults = inspect.signature(pipe.component_class("vae")).parameters
    scales = []
    for key in ("scale_factor_spatial", "scale_factor_temporal"):
        value = cfg.get(key, defaults[key].default if key in defaults else None)
        scales.append(value if isinstance(value, int) and value > 0 else None)
    spatial, temporal = scales
    if spatial is None and isinstance(cfg.get("temperal_downsample"), list):  # (sic) AutoencoderKLQwenImage's
        return 2 ** len(cfg["temperal_downsample"]), 1
    if spatial is None:
        if "block_out_channels" not in cfg:
            raise EngineConfigError(f"{pipe.root / 'vae' / 'config.json'}: no block_out_channels nor "
                                    "scale_factor_spatial (the VAE's downsampling, which sets the latent size)")
        spatial = 2 ** (len(cfg["block_out_channels"]) - 1)
    return spatial, temporal or 1


@dataclass(frozen=True)
class DenoiserShape:
    """What bounds a request's size for a denoiser: its class's entry and config, the VAE's compression."""
    arch: str
    call: Any  # its DenoiserCall
    config: dict
    vae_scale: int
    vae_frames: int

    @classmethod
    def of(cls, pipe: PipelineDir) -> DenoiserShape:
        """The pipeline's denoiser (`transformer` or `unet`), read from the directory without loading it."""
        component = "transformer" if pipe.has("transformer") else "unet"
        config = pipe.config(component)
        arch = config.get("_class_name", "")
        if arch not in DENOISERS:
            raise EngineConfigError(f"{pipe.root / component / 'config.json'}: no denoise loop for a {arch or 'model'}")
        return cls(arch, DENOISERS[arch], config, *vae_scales(pipe))


def check_size(params, shape: DenoiserShape) -> None:
    """Image sides the denoiser can take: whole patches of latents, within its position embedding; a video
    model's frame count too: one the VAE decodes (1 + k x its temporal compression; WanPipeline would round
    another down, so it is refused rather than silently changed), within its position embedding. The denoise
    stage checks it, and so does a stage that works for it at the request's size before it (image-to-video's
    reference image stage)."""
    call, config, scale, arch = shape.call, shape.config, shape.vae_scale, shape.arch
    side = scale * call.patch(config)
    most = call.max_latent_side(config)
    for name, value in (("width", params.width), ("height", params.height)):
        if value % side:
            raise InvalidRequest(f"params.image.{name}", f"must be a multiple of {side} for this {arch}, got {value}")
        if most is not None and value // scale > most:
            raise InvalidRequest(f"params.image.{name}", f"must be at most {most * scale} for this {arch}, got {value}")
    if not call.video:
        return
    frames, step = params.num_frames, shape.vae_frames
    if frames < 1 or (frames - 1) % step:
        raise InvalidRequest("params.video.num_frames", f"must be {step}k + 1 for this {arch}'s VAE, got {frames}")
    most = call.max_latent_frames(config)
    if most is not None and (frames - 1) // step + 1 > most:
        raise InvalidRequest("params.video.num_frames", f"must be at most {(most - 1) * step + 1} for this "
                                                        f"{arch}, got {frames}")


class DenoiseEngine(SteppedEngine):
    """The denoise-step loop (a UNet or a DiT, called as its `DENOISERS` entry says, with the pipeline's own
    scheduler): the text stage's `embeddings` (and pooled embeddings where the model takes them) -> `latents`;
    a video model's are [1, C, (num_frames - 1) // temporal compression + 1, h, w]. An image-to-video model also
    reads the reference image's stage (`image_embeddings`, and the `condition` channels put beside the latents); an
    editing pipeline's (FLUX.1 Kontext) the image's latents (`image_latents`), which go in as tokens beside the
    latents' at every step.

    A stage chunkSize of N emits the current latents every N steps (previews); 0 emits them once. After every
    step the client hears how many of the request's steps are done (`OutputChunk.progress`). With
    `engineArgs.step_cache_threshold` a DiT's requests each reuse their last computed step's residual while their
    first block's output barely moves (step_cache.py).
    """

    ARCHITECTURES = tuple(DENOISERS)  # UNet or DiT: one denoise loop, a table entry per class
    STEP_CACHE = True  # over a DiT whose entry splits its forward (step_cache.py)

    unit = "steps"

    def load(self) -> None:
        pipe = PipelineDir(self.model_dir, self.stage.trust_remote_code)
        cfg = pipe.config(pipe.component)
        self.arch = cfg.get("_class_name", "")
        if self.arch not in DENOISERS:
            raise EngineConfigError(f"{self.model_dir / 'config.json'}: no denoise loop for a {self.arch or 'model'} "
                                    f"(known: {', '.join(DENOISERS)})")
        self.call = DENOISERS[self.arch]
        why = self.call.unserved(pipe.index, pipe.config(pipe.component))
        if why:
            raise EngineConfigError(f"{pipe.index_file}: {why}")
        self.step_cache = self._step_cache(cfg)
        self.model = pipe.load(pipe.component, device=self.device, dtype=self.dtype)
        if self.batch_invariant:  # a video DiT's patch embedding (Wan's Conv3d) too
            make_batch_invariant(self.model, patch_embed_3d=True)
        self.config = dict(self.model.config)
        self.scheduler_cls = pipe.scheduler_class()
        self.scheduler_cfg = pipe.config("scheduler")
        self.step_takes_generator = "generator" in inspect.signature(self.scheduler_cls.step).parameters
        self.timesteps_take_device = "device" in inspect.signature(self.scheduler_cls.set_timesteps).parameters
        self.vae_scale, self.vae_frames = vae_scales(pipe)
        # The channels it denoises; those it takes beyond them are a condition another stage sends (image-to-video).
        self.latent_channels = self.call.latent_channels(self.config)
        self.condition_channels = self.call.condition_channels(self.config)
        self.takes_image = self.call.takes_image(self.config)
        self.pins_first_step = pipe.pipeline_class in self.call.pins_first_step
        self.edits = pipe.pipeline_class in self.call.reference_tokens  # the reference image's latents as tokens
        image_inputs = [e.source for e in self.stage.inputs if _is_image_encoder(self.pipeline.stage(e.source))]
        reads_image = self.takes_image or bool(self.condition_channels) or self.edits
        if reads_image and not image_inputs:
            raise EngineConfigError(f"{self.model_dir / 'config.json'}: this {self.arch} generates from a reference "
                                    f"image (a {pipe.pipeline_class}): stage \"{self.stage.name}\" needs an input from "
                                    "an image-encoder stage beside the text encoder's")
        if image_inputs and not reads_image:
            raise EngineConfigError(f"{self.model_dir / 'config.json'}: this {self.arch} takes no reference image (a "
                                    f"{pipe.pipeline_class}): stage \"{self.stage.name}\" would drop what its input "
                                    f"{image_inputs[0]} sends; remove that input")
        self.latents_dtype = self.call.latents_dtype or self.dtype  # the model's input is cast to self.dtype

    def _step_cache(self, cfg: dict) -> StepCachePolicy | None:
        threshold = self.options.step_cache_threshold
        if threshold is None:
            return None
        field = f"spec.deployment.stages.{self.stage.name}.engineArgs.step_cache_threshold"
        if self.call.blocks is None:
            split = ", ".join(name for name, call in DENOISERS.items() if call.blocks is not None)
            raise EngineConfigError(f"{field}: a {self.arch} has no step-cache split (`DitBlocks`) in DENOISERS; the "
                                    f"step cache runs over {split}")
        blocks = self.call.blocks.count(cfg)
        if blocks < 2:
            raise EngineConfigError(f"{field}: this {self.arch} has {blocks} transformer block(s); the step cache "
                                    "skips the blocks after the first, so it needs two or more")
        if not self.batch_invariant:  # a last-bit difference from a neighbour could flip a whole step's decision
            raise EngineConfigError(f"{field}: needs batch invariance (engineArgs.batch_invariant, on by default): "
                                    "without it a request's reuse decisions, and so its image, would depend on its "
                                    "neighbours in the batch")
        return StepCachePolicy(threshold, self.options.step_cache_warmup)

    def new_state(self, req: StageRequest, text: dict[str, torch.Tensor], condition: torch.Tensor | None = None,
                  reference: torch.Tensor | None = None) -> DenoiseState:
        """The image's scheduler, timesteps and latents on the engine's device. Its noise comes from a CPU
        generator whatever the device (as diffusers advises for reproducible images): a seed starts from the
        same latents on a GPU as on the CPU, and the scheduler's own draws take it as diffusers'
        `randn_tensor` does, on the CPU then moved."""
        p = req.params
        frames = (self.latent_frames(p.num_frames),) if self.call.video else ()
        shape = (1, self.latent_channels, *frames, p.height // self.vae_scale, p.width // self.vae_scale)
        sched = self.scheduler_cls.from_config(self.scheduler_cfg)  # schedulers hold per-request state
        patch = self.call.patch(self.config)
        image_tokens = (shape[-2] // patch) * (shape[-1] // patch) * (frames[0] if frames else 1)
        on = {"device": self.device} if self.timesteps_take_device else {}
        sched.set_timesteps(p.num_inference_steps, **on,
                            **self.call.schedule(p.num_inference_steps, image_tokens, self.scheduler_cfg))
        if self.pins_first_step:
            sched.set_begin_index(0)
        g = torch.Generator().manual_seed(p.seed)
        latents = torch.randn(shape, generator=g, dtype=torch.float32).to(self.device, self.latents_dtype)
        if hasattr(sched, "init_noise_sigma"):  # flow-matching schedulers start from plain noise
            latents = latents * sched.init_noise_sigma
        if condition is not None and tuple(condition.shape[2:]) != shape[2:]:
            raise InputError(f"condition must be [1, {self.condition_channels}, {', '.join(map(str, shape[2:]))}] for "
                             f"this request's size, got {list(condition.shape)}")
        return DenoiseState(scheduler=sched, latents=latents, text=text, guidance=p.guidance_scale, generator=g,
                            timesteps=list(sched.timesteps), condition=condition, reference=reference,
                            cfg_scale=p.guidance_scale if self.call.guidance_rows else p.true_cfg_scale,
                            cache=None if self.step_cache is None else StepCacheState())

    def step(self, states: list[DenoiseState]) -> list[torch.Tensor]:
        """One denoise step of every image in the batch, each at its own timestep, in one model call."""
        call = self.call
        with torch.inference_mode():
            model_in, ts, text, references = [], [], {k: [] for k in states[0].text}, []
            for st in states:
                t = st.timesteps[st.done_steps]
                x = torch.cat([st.latents] * st.rows)  # two rows under classifier-free guidance
                if hasattr(st.scheduler, "scale_model_input"):
                    x = st.scheduler.scale_model_input(x, t)
                if st.condition is not None:  # beside the latents, in their dtype, as the pipeline puts it
                    x = torch.cat([x, st.condition.to(x.dtype).expand(len(x), *st.condition.shape[1:])], dim=1)
                model_in.append(x.to(self.dtype))  # itself where the latents are kept in the stage dtype
                if st.reference is not None:  # one row, shared by the image's guidance rows
                    references.append(st.reference.expand(len(x), *st.reference.shape[1:]))
                ts.append(t.expand(len(x)))
                for k, v in st.text.items():
                    text[k].append(v)
            x = torch.cat(model_in)
            timestep = torch.cat(ts)
            if call.timestep_divisor != 1.0:  # in the model's dtype first, as the pipelines cast it
                timestep = timestep.to(self.dtype) / call.timestep_divisor
            text = {k: torch.cat(v) for k, v in text.items()}
            guidance = torch.tensor([st.guidance for st in states for _ in range(st.rows)], device=self.device)
            packed = call.pack(x, self.config)
            forward = {call.latents_kwarg: packed, "timestep": timestep, **text,
                       **call.extra(x, text, guidance, self.config)}
            if references:  # every state of a batch has one (the key has its shape), in the stage dtype
                assert call.with_reference is not None
                forward = call.with_reference(forward, torch.cat(references), self.config)
            if self.step_cache is None:
                pred_all = self.model(**forward, return_dict=False)[0]
            else:  # each request's own reuse decision (step_cache.py)
                assert call.blocks is not None
                pred_all, reused = cached_forward(self.model, call.blocks, self.step_cache,
                                                  [self._cached(st) for st in states], forward)
                if reused and self.metrics is not None:
                    self.metrics.cached_steps.labels(self.stage.name).inc(reused)
            if references:  # the prediction for the latents' own tokens: the reference's follow them
                pred_all = pred_all[:, :packed.shape[1]]
            pred_all = call.unpack(pred_all, x.shape, self.config)
            out, i = [], 0
            for st in states:
                out.append(alone(st, self._denoised, st, pred_all[i:i + st.rows]))
                i += st.rows
        return out

    @staticmethod
    def _cached(st: DenoiseState) -> CachedRequest:
        assert st.cache is not None  # every state has one while the step cache is on
        return CachedRequest(st.cache, st.rows, st.done_steps, len(st.timesteps))

    def _denoised(self, st: DenoiseState, pred: torch.Tensor) -> torch.Tensor:
        """The image's own part of a step: its guidance and its scheduler's step from the model's prediction."""
        if st.rows == 2:
            uncond, cond = pred.chunk(2)
            pred = self.call.combine(uncond, cond, st.cfg_scale, self.config)
        t = st.timesteps[st.done_steps]
        kw = {"generator": st.generator} if self.step_takes_generator else {}
        st.latents = st.scheduler.step(pred, t, st.latents, **kw).prev_sample
        st.done_steps += 1
        st.finished = st.done_steps == len(st.timesteps)
        return st.latents

    def text_inputs(self, chunks: list[InputChunk], params: RequestParams) -> dict[str, torch.Tensor]:
        """The text stage's tensors (and an image-to-video model's image embeddings, repeated over the guidance
        rows) as the model's forward arguments, each checked against its config width. Rows: one or two where
        guidance runs over rows; else two only under true classifier-free guidance, as the text stage sends them."""
        call = self.call
        text = self._checked(chunks, call.text,
                             allowed=(1, 2) if call.guidance_rows else (2,) if params.true_cfg else (1,))
        if self.takes_image:
            rows = len(next(iter(text.values())))
            image = self._checked(chunks, self.call.image, rows=1)
            text.update({k: v.expand(rows, *v.shape[1:]).contiguous() for k, v in image.items()})
        return text

    def condition(self, chunks: list[InputChunk]) -> torch.Tensor | None:
        """An image-to-video request's condition channels (float32, as the pipeline keeps them)."""
        if not self.condition_channels:
            return None
        t = self.on_device(_named(chunks, "condition")).float()
        if t.dim() != (5 if self.call.video else 4) or t.shape[:2] != (1, self.condition_channels):
            raise InputError(f"condition must be [1, {self.condition_channels}, ...the latents' shape], "
                             f"got {list(t.shape)}")
        return t

    def reference(self, chunks: list[InputChunk]) -> torch.Tensor | None:
        """An edit's reference image latents [1, latent channels, h', w'] (whole packed patches), in the stage dtype."""
        if not self.edits:
            return None
        t = self.on_device(_named(chunks, "image_latents")).to(self.dtype)
        side = self.call.patch(self.config)
        if t.dim() != 4 or t.shape[:2] != (1, self.latent_channels) or t.shape[2] % side or t.shape[3] % side:
            raise InputError(f"image_latents must be [1, {self.latent_channels}, h, w] with h and w multiples of "
                             f"{side}, got {list(t.shape)}")
        return t

    def _checked(self, chunks: list[InputChunk], wanted: tuple, rows: int = 0,
                 allowed: tuple[int, ...] = (1,)) -> dict[str, torch.Tensor]:
        text: dict[str, torch.Tensor] = {}
        tokens = 0  # of the last per-token tensor: a mask's
        # `rows`: of the first (per-token) tensor unless given (one of `allowed`); the others must agree
        for ti in wanted:
            t = self.on_device(_named(chunks, ti.tensor))
            if ti.mask:
                if t.dim() != 2 or t.shape != (rows, tokens) or t.dtype != torch.bool:
                    raise InputError(f"{ti.tensor} must be [{rows}, {tokens}] bool, got {list(t.shape)} {t.dtype}")
                text[ti.kwarg] = t
                continue
            t = t.to(self.dtype)
            width = self.config[ti.width]
            if ti.per_token:
                allowed = (rows,) if rows else allowed
                ok = t.dim() == 3 and t.shape[0] in allowed and t.shape[2] == width
                want = f"[{rows or ' or '.join(map(str, allowed))}, tokens, {width}]"
                rows = rows or (t.shape[0] if ok else 0)
                tokens = t.shape[1] if ok else 0
            else:
                ok, want = t.dim() == 2 and t.shape[0] == rows and t.shape[1] == width, f"[{rows}, {width}]"
            if not ok:
                raise InputError(f"{ti.tensor} must be {want}, got {list(t.shape)}")
            text[ti.kwarg] = t
        return text

    def latent_frames(self, num_frames: int) -> int:
        """A video's latent frames: its first frame, then one per `vae_frames` frames."""
        return (num_frames - 1) // self.vae_frames + 1

    def check_size(self, req: StageRequest) -> None:
        check_size(req.params, DenoiserShape(self.arch, self.call, self.config, self.vae_scale, self.vae_frames))

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        self.check_size(req)
        last, transfer_ms = [], 0.0
        for source in inputs.sources:  # the text encoder's; an image-to-video model's reference image stage's too
            received = await inputs.collect(source)
            if not received:
                raise InputError(f'no embeddings arrived from stage "{source}"')
            last.append(received[-1])
            transfer_ms += sum(c.transfer_ms for c in received)
        text, condition, reference = self.text_inputs(last, req.params), self.condition(last), self.reference(last)
        del last, received
        chunks = Chunking(self.stage)
        st = self.new_state(req, text, condition, reference)
        done_steps, compute_before, total = 0, 0.0, req.params.num_inference_steps
        async with self.scheduler.submit(req.request_id, st) as stream:
            async for latents in stream:
                done_steps += 1
                done = done_steps == total
                progress = (done_steps, total)
                if chunks.due(1, done):
                    yield chunks.hand_on(OutputChunk(tensors={"latents": latents}, last=done,
                                                     compute_ms=stream.compute_ms - compute_before,
                                                     progress=progress),
                                         queue_ms=stream.queue_ms, transfer_ms=transfer_ms)
                    compute_before = stream.compute_ms
                else:  # the latents stay here; the client hears of the step
                    yield OutputChunk(progress=progress)


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


# The image VAE classes the decode stage runs (its component's `_class_name`).
IMAGE_VAES = ("AutoencoderKL", "AutoencoderKLQwenImage")
ONE_FRAME_VAE = "AutoencoderKLQwenImage"  # Qwen-Image's: a causal video VAE of Wan's design, decoding one frame


def image_vae_class(model_dir: Path) -> str:
    from diffusers import AutoencoderKL

    name = AutoencoderKL.load_config(model_dir).get("_class_name", "")
    if name not in IMAGE_VAES:
        raise EngineConfigError(f"{model_dir / 'config.json'}: the image VAE stage decodes {', '.join(IMAGE_VAES)}, "
                                f"not a {name or 'model without _class_name'}")
    return name


class VaeDecoder:
    """The VAE's decode as both placements run it (in the stage process, or in an engine process): latents
    of one shape in, each image's 8-bit RGB pixels out. The denoiser's latents are scaled and shifted as the
    VAE's config says (`scaling_factor`, and `shift_factor` where it has one, as SD3's does); Qwen-Image's
    (`ONE_FRAME_VAE`) are un-normalized with its `latents_mean` / `latents_std` and decoded as one frame, as
    QwenImagePipeline does."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device, batch_invariant: bool):
        import diffusers

        arch = image_vae_class(model_dir)
        self.vae = getattr(diffusers, arch).from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device, self.dtype = device, dtype
        cfg = self.vae.config
        self.one_frame = arch == ONE_FRAME_VAE
        if self.one_frame:
            from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageAttentionBlock

            from stage_service.engines.diffusers.video_vae import batch_invariant_decode

            if batch_invariant:
                batch_invariant_decode(self.vae, QwenImageAttentionBlock)
            shape = (1, cfg.z_dim, 1, 1, 1)
            self.mean = torch.tensor(cfg.latents_mean).view(shape).to(device, dtype)
            self.inv_std = (1.0 / torch.tensor(cfg.latents_std)).view(shape).to(device, dtype)
            return
        if batch_invariant:
            make_batch_invariant(self.vae)
        self.scaling = cfg.scaling_factor
        self.shift = getattr(cfg, "shift_factor", None)

    def decode(self, latents: list[torch.Tensor]) -> list[np.ndarray]:
        """Each image's pixels [h, w, 3] (uint8), converted for the whole batch at once."""
        with torch.inference_mode():
            x = torch.cat(latents).to(self.device, self.dtype)
            if self.one_frame:
                images = self.vae.decode(x.unsqueeze(2) / self.inv_std + self.mean).sample[:, :, 0]
            else:
                x = x / self.scaling
                if self.shift is not None:
                    x = x + self.shift
                images = self.vae.decode(x).sample
            pixels = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
            return list(pixels.permute(0, 2, 3, 1).contiguous().cpu().numpy())


class VaeCore(CoreStates):
    """In the engine process (`engineArgs.engine_process: true`, `engine_process.py`): the VAE and the latents
    of every image not yet decoded, by id. Latents arrive and pixels leave as numpy arrays (plain bytes on
    the pipe: a tensor would travel through shared memory and a file descriptor)."""

    def __init__(self, model_dir: str, placement: DevicePlan, batch_invariant: bool):
        super().__init__()
        device.apply(placement)
        self.decoder = VaeDecoder(Path(model_dir), device.DTYPES[placement.dtype], torch.device(placement.device),
                                  batch_invariant)

    def info(self) -> dict:
        return {}

    def add(self, sid: int, latents: np.ndarray) -> None:
        self.states[sid] = LatentsState(torch.from_numpy(latents).to(self.decoder.device, self.decoder.dtype))

    def step(self, sids: list[int], feeds=None) -> list[tuple[np.ndarray, str, int]]:
        """Each image's pixels, its finish reason (decoded: one step) and the bytes still held for it."""
        states = [self.states[s] for s in sids]
        pixels = self.decoder.decode([st.latents for st in states])
        return [(px, "decoded", st.held_bytes()) for st, px in zip(states, pixels)]


@dataclass(eq=False, kw_only=True)
class RemoteLatentsState(RemoteState):
    """An image decoded by the engine process, as the stage process sees it."""

    shape: tuple[int, ...]
    sent_at: float | None = None      # perf_counter() when its decode went to the engine process
    answered_at: float | None = None  # perf_counter() when its decode's answer was taken (its PNG follows)

    @property
    def key(self):
        return self.shape

    def took(self, pixels: np.ndarray) -> np.ndarray:
        return pixels


class VaeDecodeEngine(SteppedEngine):
    """`latents` -> one PNG (tensor `image`: the encoded bytes, uint8); latents of one shape share a decode
    (`VaeDecoder`), in the stage process or, with `engineArgs.engine_process: true`, in a process of its own.

    The PNGs are encoded beside the step thread: a step hands its batch's pixels to the encoder thread in
    one job and returns at once (each state's result is a future of the event loop, settled for the whole
    batch in one call), so the next decode starts while this batch is encoded. In an engine process the
    step only sends the batch (`EngineProcess.submit`) and the encoder thread takes the core's answer
    (`collect`, in the order sent): the core decodes the next batch while this one's PNGs are encoded, at
    most `MAX_STEPS_IN_FLIGHT` decodes outstanding. A decode that fails after its step returned fails its
    requests as a failed step does, and ends the engine as the scheduler would (the process gone, or
    `max_failed_steps` in a row).
    """

    ARCHITECTURES = IMAGE_VAES

    ENGINE_PROCESS = True

    unit = "images"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"png-{self.stage.name}")
        self.loop: asyncio.AbstractEventLoop | None = None  # where the PNGs are awaited
        self._failed_in_a_row = 0  # decodes sent ahead that failed, on the encoder thread

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        await super().start()

    def load(self) -> None:
        from diffusers import AutoencoderKL

        cfg = AutoencoderKL.load_config(self.model_dir)
        one_frame = image_vae_class(self.model_dir) == ONE_FRAME_VAE
        self.latent_channels = cfg["z_dim"] if one_frame else cfg["latent_channels"]
        if self.options.engine_process:
            self.start_core(VaeCore, (str(self.model_dir), self.placement, self.batch_invariant))
            return
        self.decoder = VaeDecoder(self.model_dir, self.dtype, self.device, self.batch_invariant)

    @property
    def vae(self):
        """The model, where it is in the stage process."""
        return self.decoder.vae

    def step(self, states: list[LatentsState | RemoteLatentsState]) -> list[asyncio.Future | RequestFailed]:
        """The batch's decode; each state's result is the future of its PNG."""
        if self.core is not None:
            return self._sent(states)
        pixels = self.decoder.decode([st.latents for st in states])
        for st in states:
            st.finished = True
        out, batch = [], []
        for st, px in zip(states, pixels):
            if isinstance(px, RequestFailed):
                out.append(px)
                continue
            png = asyncio.Future(loop=self.loop)  # only made here: the loop settles it
            batch.append((st, px, png))
            out.append(png)
        if batch:
            self.encoder.submit(self._encode, batch)
        return out

    def _sent(self, states: list[RemoteLatentsState]) -> list[asyncio.Future]:
        """The batch sent to the engine process, not waited for: the encoder thread takes its answer."""
        pending = self.core.submit([st.seq for st in states])  # blocks while the core has enough to do
        sent = time.perf_counter()
        pngs = []
        for st in states:
            st.finished = True  # one decode each; the core's answer says so too
            st.sent_at = sent
            pngs.append(asyncio.Future(loop=self.loop))
        self.encoder.submit(self._decoded, pending, list(zip(states, pngs)))
        return pngs

    def _decoded(self, pending: PendingReply, batch: list[tuple[RemoteLatentsState, asyncio.Future]]) -> None:
        """On the encoder thread: a decode's answer from the engine process, then its PNGs."""
        try:
            answers = self.core.collect(pending)
        except Exception as e:  # noqa: BLE001 - the decode's failure is its requests': none may wait forever
            error = e if isinstance(e, EngineError) else EngineError(f"{type(e).__name__}: {e}")
            return self._decode_failed(batch, error)
        self._failed_in_a_row = 0
        answered = time.perf_counter()
        for (st, _), r in zip(batch, answers):
            st.answered_at = answered
            if not isinstance(r, RequestFailed):  # as remote_step reads an answer: its end, and what the core holds
                st.finish_reason, st.child_bytes = r[1], r[2]
        failed = [(png, r) for (_, png), r in zip(batch, answers) if isinstance(r, RequestFailed)]
        if failed:
            self._settle(failed)
        self._encode([(st, r[0], png) for (st, png), r in zip(batch, answers) if not isinstance(r, RequestFailed)])

    def _decode_failed(self, batch: list[tuple[RemoteLatentsState, asyncio.Future]], error: EngineError) -> None:
        """A decode sent ahead failed: its requests fail as a failed step's do (UNAVAILABLE when the process
        is gone, INTERNAL otherwise), and the engine is dead as the scheduler would declare it."""
        dead = isinstance(error, EngineDead)
        self._failed_in_a_row = self.options.max_failed_steps if dead else self._failed_in_a_row + 1
        log.error("stage %s: a decode failed for %d requests (%d in a row): %s", self.stage.name, len(batch),
                  self._failed_in_a_row, error)
        if self.metrics is not None:
            self.metrics.failed_steps.labels(self.stage.name).inc()
        self._settle([(png, EngineDead(str(error)) if dead else EngineError(f"step failed: EngineError: {error}"))
                      for _, png in batch])
        if self._failed_in_a_row >= self.options.max_failed_steps:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the stage is gone already
                self.loop.call_soon_threadsafe(self.fail_for_good, error)

    def _settle(self, done: list[tuple[asyncio.Future, Any]]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: no request waits any more
            self.loop.call_soon_threadsafe(_settle, done)

    def _encode(self, batch: list[tuple[StepState, np.ndarray, asyncio.Future]]) -> None:
        """On the encoder thread: the batch's PNGs (each image's own part, failing alone), handed to the loop
        in one call."""
        if batch:
            self._settle([(png, alone(st, self._png, px)) for st, px, png in batch])

    @staticmethod
    def _png(pixels: np.ndarray) -> torch.Tensor:
        """The image's own part: its PNG bytes."""
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        chunks = await inputs.collect()
        if not chunks:
            raise InputError("no latents arrived from the denoise stage")
        latents = self.on_device(tensor(chunks[-1], "latents"))  # the final latents; earlier ones are previews
        if latents.dim() != 4 or latents.shape[:2] != (1, self.latent_channels):
            raise InputError(f"latents must be [1, {self.latent_channels}, h, w], got {list(latents.shape)}")
        transfer_ms = sum(c.transfer_ms for c in chunks)
        del chunks
        if self.core is not None:  # float32 on the pipe (numpy has no bfloat16); the core casts back
            state = RemoteLatentsState(seq=self.core.sequence(latents.float().numpy()), core=self.core,
                                       shape=tuple(latents.shape))
        else:
            state = LatentsState(latents)
        del latents
        async with self.scheduler.submit(req.request_id, state) as stream:
            encoded = await stream.next()
        t0 = time.perf_counter()
        png = await encoded
        if isinstance(png, EngineError):  # its own failure, or its decode's in the engine process
            raise png
        waited = time.perf_counter() - t0
        # In an engine process the step only sent the decode: from its sending to its answer is compute (it may
        # have been answered before this resumed), what this waited after the answer is the PNG.
        sent, answered = getattr(state, "sent_at", None), getattr(state, "answered_at", None)
        decoding = answered - sent if sent is not None and answered is not None else 0.0
        encoding = waited - max(0.0, (answered or t0) - t0)
        yield OutputChunk(tensors={"image": png}, last=True, queue_ms=stream.queue_ms,
                          compute_ms=stream.compute_ms + decoding * 1e3, transfer_ms=transfer_ms,
                          encode_ms=encoding * 1e3)

    async def shutdown(self) -> None:
        try:
            await super().shutdown()
        finally:  # PNGs already handed over are finished and delivered
            await asyncio.to_thread(self.encoder.shutdown)


def _settle(done: list[tuple[asyncio.Future, torch.Tensor | EngineError]]) -> None:
    """On the loop: a batch's PNGs to the requests still waiting for them."""
    for png, result in done:
        if not png.done():  # else its request was cancelled meanwhile
            png.set_result(result)
