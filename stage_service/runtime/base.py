"""The engine-client protocol every stage engine implements, and what flows through it.

An engine turns one request plus the chunks of its input edges into a stream
of output chunks. Adapters (vLLM, transformers, diffusers) live beside this
module; the servicer only translates between these types and protobuf.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import torch

from omnistage.api import Pipeline, Stage, StageDeployment
from omnistage.contract.chunks import EdgeReorderBuffer
from omnistage.contract.devices import DevicePlan
from omnistage.contract.params import InvalidRequest, RequestParams
from stage_service.runtime import device, invariance, kv_budget
from stage_service.runtime.engine_process import EngineProcess
from stage_service.runtime.errors import (  # noqa: F401
    EngineConfigError,
    EngineDead,
    EngineError,
    EngineOverloaded,
    InputError,
    StageDraining,  # re-exported for the adapters
)
from stage_service.runtime.kv_budget import KvPages
from stage_service.runtime.scheduler import StepScheduler, StepState
from stage_service.runtime.work_tally import WorkTally


@dataclass
class InputChunk:
    stage: str
    chunk_id: int
    tensors: dict[str, torch.Tensor]
    text: str = ""
    end_of_stream: bool = False
    sample_rate: int = 0
    transfer_ms: float = 0.0


@dataclass
class OutputChunk:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    text: str = ""
    last: bool = False           # the engine's final chunk for this request
    finish_reason: str = ""
    sample_rate: int = 0
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    transfer_ms: float = 0.0
    encode_ms: float = 0.0       # media decoding, processing and encoders behind this chunk
    # (done, total) units of the request's work so far (a denoise loop's steps), for the client only: a chunk
    # whose only content it is goes out as a StageOutput.progress, not a chunk (no consumer stage sees it).
    progress: tuple[int, int] | None = None

    @property
    def progress_only(self) -> bool:
        """The chunk says how far the request has come and carries nothing else."""
        return (self.progress is not None and not self.tensors and not self.text and not self.last
                and not self.finish_reason)


# A token stage whose chunks only the client reads hands its first token on alone: the client's first token
# as soon as it is made, as an LM server streams it (a first chunk of chunkSize 4 held it 3 decode steps more);
# the later chunks keep chunkSize, fewer messages per token.
CLIENT_FIRST_CHUNK = 1


def first_chunk_units(pipeline: Pipeline, stage: Stage) -> int:
    """The units of a token stage's first chunk when the spec leaves it open (pure): CLIENT_FIRST_CHUNK when no
    stage reads `stage`'s chunks (they go to the client only) and it sets no initialChunkSize; else 0 (the
    stage's own rule, `Stage.chunk_units`)."""
    if stage.initial_chunk_size or stage.chunk_size <= CLIENT_FIRST_CHUNK:
        return 0
    if any(e.source == stage.name for s in pipeline.stages for e in s.inputs):
        return 0
    return CLIENT_FIRST_CHUNK


@dataclass
class Chunking:
    """One request's output chunks under the stage's chunk rule (`Stage.chunk_due`), which every engine
    follows: a chunk once `chunkSize` units are made (the first at `initialChunkSize`, or at `first_units`
    when given: `first_chunk_units`), what is left at the end. The timings of what came before the
    request's first unit (its queue wait, its media encoding, its input's transfer) go on the first chunk
    only."""
    stage: Stage
    always_end: bool = False  # hand on a chunk at the end even with no unit left (see Stage.chunk_due)
    first_units: int = 0      # the first chunk's units (0: the stage's rule)
    handed_on: int = 0        # chunks handed on so far
    pending: int = 0          # units made since the last one

    @property
    def first(self) -> bool:
        """The next chunk handed on is the request's first."""
        return self.handed_on == 0

    def due(self, made: int, done: bool) -> bool:
        """`made` more units (`done`: the request's last): whether a chunk goes on now."""
        self.pending += made
        if self.first_units and self.first and not done:
            return self.pending >= self.first_units
        return self.stage.chunk_due(self.handed_on, self.pending, done, always_end=self.always_end)

    def hand_on(self, chunk: OutputChunk, **first_only: float) -> OutputChunk:
        """`chunk`, counted as handed on; the first carries the `first_only` timings (queue_ms, encode_ms,
        transfer_ms), a later one none of them."""
        if self.first:
            chunk = replace(chunk, **first_only)
        self.handed_on, self.pending = self.handed_on + 1, 0
        return chunk


@dataclass
class StageRequest:
    request_id: str
    params: RequestParams
    deadline: float | None = None  # time.time() seconds


class StageInputs:
    """The chunks of one request's input edges, delivered in chunk order per edge.

    Bounded: when the engine does not keep up, `put` waits, the servicer stops
    reading the gRPC stream, and flow control pushes back on the sender.
    """

    def __init__(self, sources: tuple[str, ...], max_buffered: int = 64):
        self.sources = sources
        self._queues = {s: asyncio.Queue(max_buffered) for s in sources}
        self._order = {s: EdgeReorderBuffer[InputChunk](s) for s in sources}
        self._ended: set[str] = set()
        self._error: BaseException | None = None

    async def put(self, chunk: InputChunk) -> None:
        if chunk.stage not in self._queues:
            raise InputError(f'chunk from "{chunk.stage}", which is not an input of this stage '
                             f"(inputs: {', '.join(self.sources) or 'none'})")
        for ready in self._order[chunk.stage].push(chunk.chunk_id, chunk, chunk.end_of_stream):
            await self._queues[chunk.stage].put(ready)

    def fail(self, error: BaseException) -> None:
        """Bad input arrived: every reader of this request gets `error`."""
        self._error = error
        self.close_all()

    def close_all(self) -> None:
        """The sender half-closed: edges that never sent end of stream end now."""
        for s, q in self._queues.items():
            if not self._order[s].finished:
                with contextlib.suppress(asyncio.QueueFull):
                    q.put_nowait(None)

    async def next(self, source: str | None = None) -> InputChunk | None:
        """The next chunk of an edge (the only edge when there is one), or None once it has ended."""
        source = source or self._single()
        if self._error is not None:
            raise self._error
        if source in self._ended:
            return None
        item = await self._queues[source].get()
        if self._error is not None:
            raise self._error
        if item is None or item.end_of_stream:
            self._ended.add(source)
        return item

    async def chunks(self, source: str | None = None) -> AsyncIterator[InputChunk]:
        while (chunk := await self.next(source)) is not None:
            yield chunk
            if chunk.end_of_stream:
                return

    async def collect(self, source: str | None = None) -> list[InputChunk]:
        """Every chunk of an edge, for engines that need their whole input."""
        return [c async for c in self.chunks(source)]

    def _single(self) -> str:
        if len(self.sources) != 1:
            raise InputError(f"stage has {len(self.sources)} inputs; name the edge to read")
        return self.sources[0]


def tensor(chunk: InputChunk, name: str) -> torch.Tensor:
    try:
        return chunk.tensors[name]
    except KeyError:
        raise InputError(f'input chunk {chunk.chunk_id} from stage "{chunk.stage}" has no tensor "{name}" '
                         f"(it has: {', '.join(chunk.tensors) or 'none'})") from None


class Engine(ABC):
    """One stage's engine. Subclasses implement `start` (load) and `generate`."""

    unit = ""  # what its work is counted in (omnistage_stage_units_total's unit); "": it counts none

    def __init__(self, pipeline: Pipeline, stage: Stage, model_dir: Path):
        self.pipeline = pipeline
        self.stage = stage
        self.settings: StageDeployment = pipeline.deployment.stages[stage.name]
        self.placement: DevicePlan = device.resolve(stage.name, self.settings)  # refuses GPUs it cannot have
        self.model_dir = model_dir
        self.metrics = None  # StageMetrics, bound by the server
        self.failed: BaseException | None = None  # set when the engine cannot recover
        self.dead = asyncio.Event()
        # Units done per request, as counted in metrics; its call's last chunk carries them (work_tally.py).
        self.tally = WorkTally()

    def bind_metrics(self, metrics) -> None:
        self.metrics = metrics

    def fail_for_good(self, error: BaseException) -> None:
        """The engine cannot recover: the server flips health and exits non-zero."""
        if self.failed is None:
            self.failed = error
            self.dead.set()

    @abstractmethod
    async def start(self) -> None:
        """Load the model; the stage reports SERVING only after this returns."""

    @abstractmethod
    def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        """Stream this request's output chunks; the last has `last=True`. Cancelling the consumer aborts
        the engine request within one step and frees what it held."""

    async def shutdown(self) -> None:
        pass

    # Load, for GetLoad and routing.
    running: int = 0
    queued: int = 0
    parked: int = 0   # out of the batch until their readers catch up (scheduler.py, Parking)
    max_running: int = 1
    max_queued: int = 0

    def unfinished(self) -> int:
        """Requests the engine still holds (queued, parked or running)."""
        return self.running + self.queued + self.parked

    def held_bytes(self, request_id: str | None = None) -> int:
        """Bytes of per-request state the engine holds (KV caches, latents): all, or one request's."""
        return 0

    @property
    def dtype(self) -> torch.dtype:
        """The weights' and activations' dtype (the spec's; auto: bfloat16 on a GPU, float32 on the CPU)."""
        return device.DTYPES[self.placement.dtype]

    @property
    def device(self) -> torch.device:
        """Where the engine's model and per-request tensors live (cuda: the first GPU this process sees)."""
        return torch.device(self.placement.device)

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """An input tensor on the engine's device and, when floating, in its dtype (an upstream stage may run
        in another: bfloat16 on a GPU, float32 on the CPU); itself when already so. Copies to a GPU do not
        wait (the GPU stream orders them before any use); a copy to the CPU waits, since the CPU reads it next."""
        dtype = self.dtype if t.is_floating_point() else None
        return t.to(self.device, dtype=dtype, non_blocking=self.placement.on_cuda)


SHUTDOWN_STEP_S = 30.0  # shutting down, how long a step in the engine process may still take


@dataclass(frozen=True)
class EngineOptions:
    """`spec.deployment.stages.<name>.engineArgs` of the engines that run on the step scheduler."""

    batch_invariant: bool = True   # pad small kernels so batching never changes a result (invariance.py)
    max_failed_steps: int = 3      # failed steps in a row after which the engine is declared dead
    max_model_len: int | None = None  # AR engines: bound on prompt + generated tokens (as vLLM's)
    max_batched_frames: int | None = None  # Code2Wav: codec frames (with context) in one forward
    engine_process: bool = False   # the model in a process of its own (engine_process.py; engines that can)
    kv_cache_bytes: int | None = None  # AR engines that can: the KV budget in bytes (kvCacheBytes; kv_budget.py)
    max_num_batched_tokens: int | None = None  # AR engines that can: the most tokens one step feeds (as vLLM's)
    # The denoise loop's step cache (step_cache.py): a request reuses its last computed step's residual while its
    # first DiT block's output changed by less than this (relative L1); None: off
    step_cache_threshold: float | None = None
    step_cache_warmup: int = 1  # with the step cache: steps always computed at the start

    KEYS = {"kvCacheBytes": "kv_cache_bytes"}  # keys spelled as the spec spells them, by field

    @classmethod
    def parse(cls, stage: str, args: dict[str, Any]) -> "EngineOptions":
        path = f"spec.deployment.stages.{stage}.engineArgs"
        known = {"batch_invariant": bool, "max_failed_steps": int, "max_model_len": int, "max_batched_frames": int,
                 "engine_process": bool, "kvCacheBytes": int, "max_num_batched_tokens": int,
                 "step_cache_threshold": float, "step_cache_warmup": int}
        args = {k.replace("-", "_"): v for k, v in args.items()}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise EngineConfigError(f"{path}: unknown key(s) {', '.join(unknown)} for this engine "
                             f"(known: {', '.join(sorted(known))})")
        for k, v in args.items():
            if known[k] is float:  # a fraction: YAML's 1 is an int
                if type(v) not in (int, float) or not 0 < v <= 1:
                    raise EngineConfigError(f"{path}.{k}: expected a number above 0 and at most 1, got {v!r}")
                args[k] = float(v)
            elif type(v) is not known[k] or (known[k] is int and v < 1):
                raise EngineConfigError(f"{path}.{k}: expected "
                                        f"{'a positive integer' if known[k] is int else 'true or false'}, got {v!r}")
        if "step_cache_warmup" in args and "step_cache_threshold" not in args:
            raise EngineConfigError(f"{path}.step_cache_warmup: applies with step_cache_threshold (without it the "
                                    "step cache is off)")
        return cls(**{cls.KEYS.get(k, k): v for k, v in args.items()})


class SteppedEngine(Engine):
    """An engine whose model runs in steps over batches of requests, on the shared `StepScheduler`.

    Subclasses implement `load` (blocking), `step(states) -> results` (blocking, on the worker
    thread, one result per state) and `generate`, which submits a `StepState` and turns its
    results into output chunks.
    """

    unit = "steps"  # what one state's step produces, for metrics
    ENGINE_PROCESS = False  # whether it can run its model in a process of its own (engineArgs.engine_process)
    KV_BUDGET = False  # whether it bounds its KV caches by a budget (engineArgs.kvCacheBytes, kv_budget.py)
    # Whether its states' `cost` is the tokens their next step feeds, so that engineArgs.max_num_batched_tokens
    # bounds a step's tokens (prompts join a step while they fit it; a longer one steps alone).
    TOKEN_BUDGET = False
    STEP_CACHE = False  # whether it can reuse a step's work for the next (engineArgs.step_cache_threshold)
    core: EngineProcess | None = None  # engine_process: the model's process

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.options = EngineOptions.parse(self.stage.name, dict(self.settings.engine_args))
        if self.options.engine_process and not self.ENGINE_PROCESS:
            raise EngineConfigError(f"spec.deployment.stages.{self.stage.name}.engineArgs.engine_process: this "
                                    f"engine ({type(self).__name__}) runs its model in the stage process only; "
                                    "the causal LM, Talker and VAE engines support it")
        if self.options.max_num_batched_tokens is not None and not self.TOKEN_BUDGET:
            raise EngineConfigError(f"spec.deployment.stages.{self.stage.name}.engineArgs.max_num_batched_tokens: "
                                    f"this engine ({type(self).__name__}) does not count its steps in tokens; the "
                                    "transformers causal LM, Thinker and omni Talkers do")
        if self.options.kv_cache_bytes is not None and not self.KV_BUDGET:
            raise EngineConfigError(f"spec.deployment.stages.{self.stage.name}.engineArgs.kvCacheBytes: this engine "
                                    f"({type(self).__name__}) does not bound its KV cache by a budget yet; the "
                                    "transformers causal LM and the omni Thinkers and Talkers do")
        if self.options.step_cache_threshold is not None and not self.STEP_CACHE:
            raise EngineConfigError(f"spec.deployment.stages.{self.stage.name}.engineArgs.step_cache_threshold: "
                                    f"this engine ({type(self).__name__}) has no step cache; the diffusers denoise "
                                    "loop over a DiT has one")
        self.scheduler = StepScheduler(self.stage.name, self.settings.scheduler, self.step, unit=self.unit,
                                       tally=self.tally,
                                       max_failed_steps=self.options.max_failed_steps,
                                       max_step_cost=self.max_step_cost(), on_dead=self.fail_for_good)

    def bind_metrics(self, metrics) -> None:
        super().bind_metrics(metrics)
        self.scheduler.metrics = metrics

    async def start(self) -> None:
        if not self.options.engine_process:  # else the model's process applies it (no CUDA context here)
            device.apply(self.placement)
        await self.scheduler.run_on_worker(self.load)
        self.scheduler.start()

    @property
    def batch_invariant(self) -> bool:
        """Pad for batch invariance: the engineArgs ask for it and the device takes it (invariance.py)."""
        return self.options.batch_invariant and invariance.applies_on(self.placement)

    def max_step_cost(self) -> int | None:
        """The most work one step may take, summed over its states' `cost` (None: only maxBatch bounds it)."""
        return self.options.max_num_batched_tokens if self.TOKEN_BUDGET else None

    kv_pages: KvPages | None = None  # under a KV budget: how a sequence's cache is sized (kv_budget.py)

    @property
    def kv_paged(self) -> bool:
        """Whether the stage has a KV budget (kv_budget.py: kvCacheBytes, or a GPU share), so caches grow by pages."""
        plan, given = self.placement, self.options.kv_cache_bytes is not None
        return self.KV_BUDGET and (given or bool(plan.on_cuda and plan.memory_fraction))

    def bound_kv(self, per_token: int, weights_bytes: int, gpu_bytes: int | None) -> None:
        """Once loaded: give the scheduler the stage's KV budget, if it has one, and size caches by `per_token`
        KV bytes (`gpu_bytes`: the GPU's total memory, None off a GPU)."""
        if not self.kv_paged:
            return
        try:
            budget = kv_budget.resolve_budget(self.stage.name, self.options.kv_cache_bytes,
                                              self.placement.memory_fraction, gpu_bytes, weights_bytes,
                                              self.step_activation_bytes() if gpu_bytes is not None else 0)
        except ValueError as e:
            raise EngineConfigError(str(e)) from None
        self.kv_pages, self.scheduler.kv_budget = KvPages(per_token), budget

    def step_activation_bytes(self) -> int:
        """What the stage's largest step holds beside its weights and KV cache, by the memory plan's rule
        (`omnistage.checkpoints.plan.ar_plan`, from the checkpoint's config)."""
        from omnistage.checkpoints.configs import read_json
        from omnistage.checkpoints.plan import ar_plan

        dtype = str(self.dtype).removeprefix("torch.")
        dep = self.pipeline.deployment.stages.get(self.stage.name)
        return ar_plan(read_json(self.model_dir / "config.json"), self.stage, dep, dtype)[2]

    def kv_refusal(self, field: str, what: str, tokens: int) -> InvalidRequest | None:
        """The error for a request whose KV reaches `tokens` tokens, more than the whole budget holds (`what`
        says what it is made of); None when it fits or there is no budget."""
        budget = self.scheduler.kv_budget
        if budget is None or self.kv_pages is None:
            return None
        why = kv_budget.never_fits(self.stage.name, tokens, self.kv_pages, budget)
        return None if why is None else InvalidRequest(field, f"{what} {why}")

    @abstractmethod
    def load(self) -> None:
        """Load the model (blocking; runs on the worker thread)."""

    @abstractmethod
    def step(self, states: list[StepState]) -> list[Any]:
        """One model step over a batch (blocking; runs on the worker thread)."""

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """With an engine process, inputs stay on the CPU here (in the engine's dtype): the engine process
        puts them on its device, and this process makes no CUDA context of its own."""
        if self.core is None:
            return super().on_device(t)
        return t.to("cpu", dtype=self.dtype if t.is_floating_point() else None)

    def start_core(self, factory: Callable[..., Any], args: tuple) -> dict:
        """Start the engine process (`engine_process.py`; on the worker thread, from `load`): its core is
        `factory` (a class, pickled by reference into the child) built from `args`; returns the core's
        `info()`. Releases travel on the step thread."""
        self.core = EngineProcess(self.stage.name, factory, args)
        self.core.on_release = lambda: self.scheduler.call_on_worker(self.core.flush)
        try:
            return self.core.start()
        except BaseException:
            self.core.close()  # the stage does not start: no engine process left behind
            raise

    async def shutdown(self) -> None:
        if self.core is None:
            return await self.scheduler.shutdown()
        stopping = asyncio.create_task(self.scheduler.shutdown())  # waits for the step in flight
        done, _ = await asyncio.wait({stopping}, timeout=SHUTDOWN_STEP_S)
        if not done:  # the step hangs in the engine process: ending the process ends the step
            self.core.kill()
        await stopping
        await asyncio.to_thread(self.core.close)

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def parked(self) -> int:
        return self.scheduler.parked

    @property
    def max_running(self) -> int:
        return self.scheduler.max_batch

    @property
    def max_queued(self) -> int:
        return self.scheduler.max_queued

    def held_bytes(self, request_id: str | None = None) -> int:
        return self.scheduler.held_bytes(request_id)
