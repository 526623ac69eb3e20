"""The engine-client protocol every stage engine implements, and what flows through it.

An engine turns one request plus the chunks of its input edges into a stream
of output chunks. Adapters (vLLM, transformers, diffusers) live beside this
module; the servicer only translates between these types and protobuf.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, TypeVar

import torch

from omnistage.chunks import EdgeReorderBuffer
from omnistage.params import InvalidRequest, RequestParams
from omnistage.spec import Pipeline, Stage, StageDeployment

R = TypeVar("R")


class EngineError(RuntimeError):
    """The engine failed while working on a request."""


class EngineOverloaded(RuntimeError):
    """The stage's queue is full."""


class StageDraining(RuntimeError):
    """The stage is shutting down and takes no new work."""


class InputError(ValueError):
    """Inputs from upstream that this engine cannot use (missing tensor, wrong shape)."""


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


def torch_dtype(name: str, default: torch.dtype = torch.float32) -> torch.dtype:
    return {"auto": default, "float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[name]


class Engine(ABC):
    """One stage's engine. Subclasses implement `load` and `generate`."""

    def __init__(self, pipeline: Pipeline, stage: Stage, model_dir: Path):
        self.pipeline = pipeline
        self.stage = stage
        self.settings: StageDeployment = pipeline.deployment.stages[stage.name]
        self.model_dir = model_dir
        self.running = 0
        self.queued = 0
        self.max_running = 1
        self.max_queued = self.settings.scheduler.max_queued
        self.failed: BaseException | None = None  # set when the engine cannot recover

    async def start(self) -> None:
        await asyncio.to_thread(self.load)

    @abstractmethod
    def load(self) -> None:
        """Load the model (blocking; runs on a worker thread)."""

    @abstractmethod
    def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        """Stream this request's output chunks; the last has `last=True`."""

    async def shutdown(self) -> None:
        pass

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.settings.dtype)


class SerialEngine(Engine):
    """An engine whose model runs one request at a time on one worker thread.

    Requests beyond the running one wait in a bounded queue; each model call
    is one step, and a cancelled request stops at the next step boundary.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"engine-{self.stage.name}")
        self._slot = asyncio.Semaphore(1)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Wait for the model; yields the queue time in ms."""
        if self.queued >= self.max_queued and self._slot.locked():
            raise EngineOverloaded(f"stage {self.stage.name}: {self.queued} requests queued "
                                   f"(maxQueued {self.max_queued})")
        t0 = time.perf_counter()
        self.queued += 1
        try:
            await self._slot.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        try:
            yield (time.perf_counter() - t0) * 1e3
        finally:
            self.running -= 1
            self._slot.release()

    async def run(self, fn: Callable[..., R], *args) -> tuple[R, float]:
        """Run one blocking model step on the engine thread; returns (result, ms)."""
        t0 = time.perf_counter()
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except (InputError, InvalidRequest):
            raise
        except Exception as e:
            raise EngineError(f"{type(e).__name__} in engine step") from e
        return result, (time.perf_counter() - t0) * 1e3

    async def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
