"""StageService.Process: header -> engine -> streamed chunks. Thin: parsing, converting, and
mapping domain errors to status codes happen in one place each; the call itself (its input reader,
release, outcome) is a scope in call_scope.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import AsyncIterator

import grpc

from omnistage.api import Pipeline, Stage
from omnistage.connector import ChunkTooLarge, ConnectorError, PeerUnreachable, TensorKey, TensorNotFound
from omnistage.connector.errors import BadReference
from omnistage.contract.chunks import ChunkOrderError
from omnistage.contract.params import InvalidRequest, resolve
from omnistage.contract.tensors import TensorFormatError, descriptor_bytes
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from stage_service.call_scope import RequestReleased, StageCalls
from stage_service.chunk_digest import chunk_digest
from stage_service.convert import output_to_proto
from stage_service.data_plane import DataPlane
from stage_service.metrics import StageMetrics
from stage_service.runtime.base import Engine, InputChunk, OutputChunk, StageRequest
from stage_service.runtime.errors import (
    EngineDead,
    EngineError,
    EngineOverloaded,
    InputError,
    RequestFailed,
    StageDraining,
)
from stage_service.tracing import CallSpans


def status_for(stage: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place where a domain error becomes a gRPC status."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (InputError, TensorFormatError, ChunkOrderError, BadReference)):
        return grpc.StatusCode.INVALID_ARGUMENT, f"stage {stage}: bad input: {exc}"
    if isinstance(exc, EngineOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, RequestReleased):
        return grpc.StatusCode.CANCELLED, f"stage {stage}: {exc}"
    if isinstance(exc, StageDraining):
        return grpc.StatusCode.UNAVAILABLE, f"stage {stage} is draining"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"stage {stage}: deadline passed"
    if isinstance(exc, EngineDead):  # retryable on another replica: this one is going down
        return grpc.StatusCode.UNAVAILABLE, f"stage {stage}: engine failed for good ({exc}); the replica is going down"
    if isinstance(exc, RequestFailed):  # its own values failed it: any replica would fail it the same way
        return grpc.StatusCode.INVALID_ARGUMENT, (f"stage {stage}: this request failed in the engine ({exc}); "
                                                  "its batch and the engine went on: change its parameters")
    if isinstance(exc, EngineError):
        return grpc.StatusCode.INTERNAL, f"stage {stage}: engine failed ({exc})"
    if isinstance(exc, (TensorNotFound, PeerUnreachable)):  # the producer's data is gone or out of reach
        return grpc.StatusCode.UNAVAILABLE, f"stage {stage}: input not fetched: {exc}"
    if isinstance(exc, (ChunkTooLarge, ConnectorError)):
        return grpc.StatusCode.INTERNAL, f"stage {stage}: data plane: {exc}"
    return grpc.StatusCode.INTERNAL, f"stage {stage}: internal error ({type(exc).__name__})"



def asks_failure_message(first: stage_pb2.StageInput | None) -> bool:
    """Whether the call's header asks for its error status in a StageFailure message first (stage.proto)."""
    return first is not None and first.WhichOneof("kind") == "header" and first.header.failure_message


def failure_output(code: grpc.StatusCode, message: str) -> stage_pb2.StageOutput:
    """The message that tells the client the status the call is about to end with."""
    return stage_pb2.StageOutput(failure=stage_pb2.StageFailure(code=code.value[0], message=message))


def progress_output(progress: tuple[int, int], unit: str) -> stage_pb2.StageOutput:
    """How far the request has come (`done` of `total` units): for a client whose header asked for it
    (StageRequestHeader.progress), sent between chunks."""
    done, total = progress
    return stage_pb2.StageOutput(progress=stage_pb2.StageProgress(done=done, total=total, unit=unit))


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
        self.calls = StageCalls(stage.name, engine, self.sources, self.data_plane, metrics,
                                functools.partial(status_for, stage.name))
        self.idle = self.calls.idle

    @property
    def inflight(self) -> int:
        return self.calls.inflight

    async def Process(self, request_iterator, context) -> AsyncIterator[stage_pb2.StageOutput]:
        # Read the header before any refusal: a status sent while the client is still writing its first
        # message reaches some clients as INTERNAL ("Internal error from Core") instead of UNAVAILABLE.
        first = await anext(aiter(request_iterator), None)
        refusal = self._refusal()
        if refusal is not None:
            self.metrics.outcome("rejected")
            status = status_for(self.stage.name, refusal)
            if asks_failure_message(first):
                yield failure_output(*status)
            await context.abort(*status)
        spans = CallSpans(self.stage.name, first, context.invocation_metadata())
        async with self.calls.scope() as call, spans:
            header = header_from_proto(first)
            call.serve(header.request_id)
            req = request_from_proto(header, self.pipeline.limits)
            chunk_id, last = 0, False
            reports = header.progress  # a client that did not ask would read a report as an empty chunk
            to_input = functools.partial(self._input_from_proto, header.request_id)
            async with contextlib.aclosing(call.run(req, request_iterator, to_input,
                                                    context.cancelled)) as outputs:
                async for out in outputs:
                    if out.progress is not None:
                        if reports:
                            with call.sending():
                                yield progress_output(out.progress, self.engine.unit)
                        if out.progress_only:
                            continue
                    spans.computed(out)
                    with spans.transferring():
                        msg = stage_pb2.StageOutput(chunk=await self._to_proto(header, out, chunk_id))
                        with call.sending():  # gRPC sends it in its own frame: see CallScope.sending
                            yield msg
                    chunk_id, last = chunk_id + 1, out.last
            if not last:  # the engine ended without a last chunk: the stream still ends with one
                units, unit = self._work(header.request_id)
                msg = stage_pb2.StageOutput(chunk=output_to_proto(OutputChunk(), self.stage.name, chunk_id, True,
                                                                  units=units, unit=unit))
                if header.digest_outputs:
                    msg.chunk.digest = chunk_digest({}, "")
                with call.sending():
                    yield msg
        if call.status is not None:
            # Outside the scope: the abort must not carry the error's traceback (and with it the
            # engine's frames and request state) into gRPC's call state. The status goes in a message first:
            # a client still writing inputs may not be told it (stage.proto StageFailure).
            if asks_failure_message(first) and not context.cancelled():  # one that cancelled reads nothing more
                yield failure_output(*call.status)
            await context.abort(*call.status)

    def _refusal(self) -> Exception | None:
        """Why this replica takes no new call, if it takes none."""
        if self.draining:
            return StageDraining()
        if self.engine.failed is not None:
            return EngineDead(f"{type(self.engine.failed).__name__}: {self.engine.failed}")
        return None

    async def _to_proto(self, header: stage_pb2.StageRequestHeader, out: OutputChunk, chunk_id: int):
        descriptors = await self.data_plane.outputs(header, chunk_id, out.tensors)
        units, unit = self._work(header.request_id) if out.last else (0, "")
        msg = output_to_proto(out, self.stage.name, chunk_id, out.last, descriptors, units=units, unit=unit)
        msg.timing.transfer_path = self.data_plane.input_paths(header.request_id, done=out.last)
        if header.digest_outputs:
            msg.digest = chunk_digest(out.tensors, out.text)
        self.metrics.chunks.labels(self.stage.name).inc()
        self.metrics.output_bytes.labels(self.stage.name).inc(sum(t.numel() * t.element_size()
                                                                  for t in out.tensors.values()))
        if out.queue_ms:
            self.metrics.queue_seconds.labels(self.stage.name).observe(out.queue_ms / 1e3)
        return msg

    def _work(self, request_id: str) -> tuple[int, str]:
        """(units, unit): the request's work on this replica, for its last chunk (taken: the tally forgets it)."""
        return self.engine.tally.take(request_id), self.engine.unit

    async def _input_from_proto(self, request_id: str, msg: stage_pb2.StageInput) -> InputChunk:
        if msg.WhichOneof("kind") != "chunk":
            raise InputError("only chunks may follow the header")
        check_input_chunk(msg.chunk, request_id, self.pipeline, self.sources, set(self.data_plane.connector.stores))
        return await self.data_plane.input_chunk(msg.chunk, request_id)

    async def Release(self, request, context) -> stage_pb2.ReleaseResponse:
        """Free what this stage holds for a request that ended elsewhere: its calls still running here
        end (the engine frees their state at the next step boundary), and the data plane frees the chunks
        it holds for the request's consumers."""
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: is required")
        freed = self.engine.held_bytes(request.request_id)
        self.calls.release(request.request_id)
        freed += self.data_plane.release(request.request_id)
        return stage_pb2.ReleaseResponse(bytes_freed=freed)

    async def GetLoad(self, request, context) -> stage_pb2.StageLoad:
        e = self.engine
        # parked requests are reported as queued: they hold maxQueued room as queued ones do, and will step again
        return stage_pb2.StageLoad(stage=self.stage.name, running=e.running, queued=e.queued + e.parked,
                                   max_running=e.max_running, max_queued=e.max_queued, draining=self.draining,
                                   buffered_bytes=self.data_plane.held_bytes)


def header_from_proto(first: stage_pb2.StageInput | None) -> stage_pb2.StageRequestHeader:
    """The header that opens a Process stream."""
    if first is None or first.WhichOneof("kind") != "header":
        raise InvalidRequest("header", "the first message of a Process stream must be a header")
    if not first.header.request_id:
        raise InvalidRequest("header.request_id", "is required")
    return first.header


def check_input_chunk(chunk: stage_pb2.Chunk, request_id: str, pipeline: Pipeline, sources: tuple[str, ...],
                      backends: set[str]) -> None:
    """An input chunk as its producer could have sent it, checked before anything is fetched for it: from an
    input of this stage, its tensors well formed, each reference in a store this stage reads, naming this
    request's tensor of this chunk, and no bigger than the producer's buffer budget (the most its store
    holds, and so the most a fetch allocates here)."""
    if chunk.stage not in sources:
        raise InputError(f'chunk from "{chunk.stage}", which is not an input of this stage '
                         f"(inputs: {', '.join(sources) or 'none'})")
    budget = pipeline.deployment.stages[chunk.stage].transfer.max_buffered_bytes
    for t in chunk.tensors:
        nbytes = descriptor_bytes(t)
        if t.WhichOneof("payload") != "ref":
            continue
        where = f'chunk {chunk.chunk_id} from "{chunk.stage}": tensor "{t.name}"'
        if t.ref.backend not in backends:
            raise TensorFormatError(f'{where} is held in "{t.ref.backend}", which this stage does not read '
                                    f"(it reads: {', '.join(sorted(backends)) or 'inline only'})")
        if nbytes > budget:
            raise TensorFormatError(f"{where} declares {nbytes} bytes, more than its producer's buffer budget "
                                    f"({budget})")
        try:
            key = TensorKey.parse(t.ref.key)
        except ValueError as e:
            raise TensorFormatError(f"{where}: {e}") from None
        if (key.request_id, key.stage, key.chunk_id, key.name) != (request_id, chunk.stage, chunk.chunk_id, t.name):
            raise TensorFormatError(f'{where} references "{t.ref.key}", not a tensor of this chunk')


def request_from_proto(h: stage_pb2.StageRequestHeader, limits) -> StageRequest:
    """The header as the engine's typed request. resolve() checks the params against the pipeline's limits
    (a stage does not trust its caller) but adds no second set of defaults to a request from the orchestrator:
    it sends the values it resolved (`fill_resolved`), and resolve() of resolved values is those values again.
    Only a caller that leaves a field out (a test, a benchmark, a client of the stage itself) gets the default,
    the same one the orchestrator would have applied: a stage process fills the limits the file leaves to the
    model from the same checkpoints at start, as the orchestrator does (`omnistage.checkpoints.defaults`)."""
    return StageRequest(request_id=h.request_id, params=resolve(h.params, limits),
                        deadline=h.deadline_unix_ms / 1e3 if h.deadline_unix_ms else None)
