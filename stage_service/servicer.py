"""StageService.Process: header -> engine -> streamed chunks. Thin: parsing, converting, and
mapping domain errors to status codes happen in one place each."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from typing import AsyncIterator

import grpc

from omnistage.chunks import ChunkOrderError
from omnistage.connector import ChunkTooLarge, ConnectorError, PeerUnreachable, TensorNotFound
from omnistage.params import InvalidRequest, resolve
from omnistage.spec import Pipeline, Stage
from omnistage.tensors import TensorFormatError
from omnistage.v1 import stage_pb2, stage_pb2_grpc

from .convert import output_to_proto
from .data_plane import DataPlane
from .engines.base import Engine, OutputChunk, StageInputs, StageRequest
from .errors import CallerGone, EngineDead, EngineError, EngineOverloaded, InputError, StageDraining
from .metrics import StageMetrics

log = logging.getLogger("omnistage.stage")


def status_for(stage: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place where a domain error becomes a gRPC status."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (InputError, TensorFormatError, ChunkOrderError)):
        return grpc.StatusCode.INVALID_ARGUMENT, f"stage {stage}: bad input: {exc}"
    if isinstance(exc, EngineOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, StageDraining):
        return grpc.StatusCode.UNAVAILABLE, f"stage {stage} is draining"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"stage {stage}: deadline passed"
    if isinstance(exc, EngineDead):  # retryable on another replica: this one is going down
        return grpc.StatusCode.UNAVAILABLE, f"stage {stage}: engine failed for good ({exc}); the replica is going down"
    if isinstance(exc, EngineError):
        return grpc.StatusCode.INTERNAL, f"stage {stage}: engine failed ({exc})"
    if isinstance(exc, (TensorNotFound, PeerUnreachable)):  # the producer's data is gone or out of reach
        return grpc.StatusCode.UNAVAILABLE, f"stage {stage}: input not fetched: {exc}"
    if isinstance(exc, (ChunkTooLarge, ConnectorError)):
        return grpc.StatusCode.INTERNAL, f"stage {stage}: data plane: {exc}"
    return grpc.StatusCode.INTERNAL, f"stage {stage}: internal error ({type(exc).__name__})"


class StageServicer(stage_pb2_grpc.StageServiceServicer):
    def __init__(self, pipeline: Pipeline, stage: Stage, engine: Engine, metrics: StageMetrics,
                 data_plane: DataPlane | None = None):
        self.pipeline = pipeline
        self.data_plane = data_plane or DataPlane(pipeline, stage)
        self.stage = stage
        self.engine = engine
        self.metrics = metrics
        self.sources = tuple(e.source for e in stage.inputs)
        self.draining = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._calls: dict[str, set[asyncio.Task]] = {}  # request id -> its Process calls, for Release
        self._released: set[asyncio.Task] = set()

    async def Process(self, request_iterator, context) -> AsyncIterator[stage_pb2.StageOutput]:
        name = self.stage.name
        # Read the header before any refusal: a status sent while the client is still writing its first
        # message reaches some clients as INTERNAL ("Internal error from Core") instead of UNAVAILABLE.
        first = await anext(aiter(request_iterator), None)
        if self.draining or self.engine.failed is not None:
            self.metrics.outcome("rejected")
            await context.abort(*status_for(name, StageDraining() if self.draining else EngineDead(
                f"{type(self.engine.failed).__name__}: {self.engine.failed}")))
        self.inflight += 1
        self.idle.clear()
        outcome = "failed"
        status: tuple[grpc.StatusCode, str] | None = None
        reader: asyncio.Task | None = None
        try:
            if first is None or first.WhichOneof("kind") != "header":
                raise InvalidRequest("header", "the first message of a Process stream must be a header")
            h = first.header
            if not h.request_id:
                raise InvalidRequest("header.request_id", "is required")
            req = StageRequest(request_id=h.request_id, params=resolve(h.params, self.pipeline.limits),
                               deadline=h.deadline_unix_ms / 1e3 if h.deadline_unix_ms else None)
            self._calls.setdefault(req.request_id, set()).add(asyncio.current_task())
            inputs = StageInputs(self.sources)
            reader = asyncio.create_task(self._read_inputs(request_iterator, context, inputs))
            chunk_id = 0
            last = False
            async with asyncio.timeout_at(_loop_time(req.deadline)):
                gen = self.engine.generate(req, inputs)
                try:
                    async for out in gen:
                        yield stage_pb2.StageOutput(chunk=await self._to_proto(h, out, chunk_id))
                        chunk_id += 1
                        if out.last:
                            last = True
                            break
                    if reader.done() and reader.exception():
                        raise reader.exception()
                finally:
                    await gen.aclose()
            if not last:
                yield stage_pb2.StageOutput(chunk=output_to_proto(OutputChunk(), name, chunk_id, True))
            outcome = "cancelled" if context.cancelled() else "finished"
        except asyncio.CancelledError:
            outcome = "cancelled"
            task = asyncio.current_task()
            if task not in self._released:
                raise  # the caller went away (or the server stops): nothing to answer
            # Release ended this call: answer it, rather than leave the caller waiting.
            self._released.discard(task)
            task.uncancel()
            status = (grpc.StatusCode.CANCELLED, f"stage {name}: request {first.header.request_id} was released")
        except CallerGone:
            outcome = "cancelled"  # nobody is left to answer
        except GeneratorExit:
            outcome = "cancelled"  # gRPC closed this generator: the caller went away
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status below
            if reader is not None and reader.done() and not reader.cancelled() and reader.exception():
                e = reader.exception()  # the input was bad: report that, not its consequence
            status = status_for(name, e)
            code = status[0]
            outcome = "invalid" if code == grpc.StatusCode.INVALID_ARGUMENT else \
                "rejected" if code == grpc.StatusCode.RESOURCE_EXHAUSTED else \
                "timeout" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
            if code == grpc.StatusCode.INTERNAL:  # as text: a kept traceback would keep the request's state
                log.error("stage %s: request failed\n%s", name, "".join(traceback.format_exception(e)).rstrip())
        finally:
            if reader is not None:
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader
            self._released.discard(asyncio.current_task())
            if outcome != "finished" and first is not None and first.header.request_id:
                self.data_plane.release(first.header.request_id)  # nobody will fetch what it held
            if first is not None and first.header.request_id in self._calls:
                calls = self._calls[first.header.request_id]
                calls.discard(asyncio.current_task())
                if not calls:
                    del self._calls[first.header.request_id]
            self.metrics.outcome(outcome)
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()
        if status is not None:
            # Outside the except block: the abort must not carry the error's traceback (and with it
            # the engine's frames and request state) into gRPC's call state.
            await context.abort(*status)

    async def _to_proto(self, header: stage_pb2.StageRequestHeader, out: OutputChunk, chunk_id: int):
        descriptors = await self.data_plane.outputs(header, chunk_id, out.tensors)
        msg = output_to_proto(out, self.stage.name, chunk_id, out.last, descriptors)
        self.metrics.chunks.labels(self.stage.name).inc()
        self.metrics.output_bytes.labels(self.stage.name).inc(sum(t.numel() * t.element_size()
                                                                  for t in out.tensors.values()))
        if out.queue_ms:
            self.metrics.queue_ms.labels(self.stage.name).observe(out.queue_ms)
        return msg

    async def _read_inputs(self, request_iterator, context, inputs: StageInputs) -> None:
        try:
            async for msg in request_iterator:
                if msg.WhichOneof("kind") != "chunk":
                    raise InputError("only chunks may follow the header")
                await inputs.put(await self.data_plane.input_chunk(msg.chunk))
            if context.cancelled():  # the stream ended because the caller went away, not a half-close:
                inputs.fail(CallerGone())  # the engine must stop, not finish on partial input
                return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            inputs.fail(e)
            raise
        finally:
            inputs.close_all()

    async def Release(self, request, context) -> stage_pb2.ReleaseResponse:
        """Free what this stage holds for a request that ended elsewhere: its calls still running here
        end (the engine frees their state at the next step boundary), and the data plane frees the chunks
        it holds for the request's consumers."""
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: is required")
        freed = self.engine.held_bytes(request.request_id)
        for task in list(self._calls.get(request.request_id, ())):
            self._released.add(task)
            task.cancel()
        freed += self.data_plane.release(request.request_id)
        return stage_pb2.ReleaseResponse(bytes_freed=freed)

    async def GetLoad(self, request, context) -> stage_pb2.StageLoad:
        e = self.engine
        return stage_pb2.StageLoad(stage=self.stage.name, running=e.running, queued=e.queued,
                                   max_running=e.max_running, max_queued=e.max_queued, draining=self.draining,
                                   buffered_bytes=self.data_plane.held_bytes)


def _loop_time(deadline: float | None) -> float | None:
    """A time.time() deadline on the event loop's clock (None: no deadline)."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.time())
