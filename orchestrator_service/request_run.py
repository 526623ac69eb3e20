"""One request's walk through the stage graph.

Entry stages are called at once; a downstream stage is called when the first
chunk of its input exists, and every chunk descriptor is forwarded the moment
it arrives, so stages overlap. Output-stage chunks become client events. Any
stage failing cancels every other stage call of the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from omnistage.spec import Pipeline
from omnistage.v1 import common_pb2, orchestrator_pb2, stage_pb2

from .outputs import OutputAssembler
from .routing import NoReplica, Replica, Router


class StageFailed(Exception):
    """A stage call ended badly; carries the status the client should get."""

    def __init__(self, stage: str, code: grpc.StatusCode, message: str, replica: str = ""):
        self.stage, self.code, self.replica = stage, code, replica
        super().__init__(message)


def client_status(stage: str, code: grpc.StatusCode, details: str) -> tuple[grpc.StatusCode, str]:
    """The one place a stage's status becomes the client's: its own answer for bad input,
    overload and deadlines; UNAVAILABLE naming the stage for everything else."""
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return code, details
    return grpc.StatusCode.UNAVAILABLE, f"stage {stage} failed: {details or code.name}"


@dataclass
class StageTiming:
    replica: str = ""
    dispatched: float = 0.0
    first_chunk: float | None = None
    finished: float | None = None
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    transfer_ms: float = 0.0
    chunks: int = 0
    attempts: int = 0


@dataclass
class _PumpDone:
    stage: str
    error: BaseException | None = None


@dataclass
class RequestRun:
    pipeline: Pipeline
    router: Router
    request_id: str
    params: common_pb2.GenerationParams
    outputs: dict[str, str]  # stage -> modality, for the outputs this request asked for
    deadline: float | None = None  # time.time() seconds
    max_buffered_events: int = 64
    timings: dict[str, StageTiming] = field(default_factory=dict)

    def __post_init__(self):
        self.needed = self._needed_stages()
        self.assembler = OutputAssembler(self.request_id)
        self._events: asyncio.Queue = asyncio.Queue(self.max_buffered_events)
        self._calls: dict[str, grpc.aio.StreamStreamCall] = {}
        self._replicas: dict[str, Replica] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._ended_inputs: dict[str, set[str]] = {s: set() for s in self.needed}
        self._inputs = {s.name: [e.source for e in s.inputs if e.source in self.needed]
                        for s in pipeline_stages(self.pipeline, self.needed)}
        self._open_lock = asyncio.Lock()
        self._active = 0  # stage calls whose outputs are still being pumped
        self.started = time.perf_counter()
        self.first_output: float | None = None
        self.finish_reason = ""

    def _needed_stages(self) -> set[str]:
        graph = {s.name: [e.source for e in s.inputs] for s in self.pipeline.stages}
        needed, todo = set(self.outputs), list(self.outputs)
        while todo:
            for src in graph[todo.pop()]:
                if src not in needed:
                    needed.add(src)
                    todo.append(src)
        return needed

    async def events(self) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        """Client events as they appear; raises StageFailed when a stage fails."""
        try:
            for st in self.pipeline.stages:
                if st.name in self.needed and not self._inputs[st.name]:
                    await self._open(st.name)
            while self._active:
                item = await self._events.get()
                if isinstance(item, _PumpDone):
                    if item.error is not None:
                        raise item.error
                    self._active -= 1
                    continue
                if self.first_output is None:
                    self.first_output = time.perf_counter()
                yield item
        finally:
            await self.cancel()

    async def cancel(self) -> None:
        """Cancel every stage call still running (client gone, deadline, or a failed stage)."""
        for call in self._calls.values():
            call.cancel()
        for t in self._tasks.values():
            t.cancel()
        for t in self._tasks.values():
            with contextlib.suppress(BaseException):
                await t

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.time())

    async def _open(self, stage: str) -> grpc.aio.StreamStreamCall:
        """Call a replica of `stage` and start pumping its outputs."""
        async with self._open_lock:
            if stage in self._calls:
                return self._calls[stage]
            replica = self.router.pool(stage).choose()
            replica.outstanding += 1
            self._replicas[stage] = replica
            timing = self.timings.setdefault(stage, StageTiming())
            timing.replica, timing.dispatched, timing.attempts = replica.address, time.perf_counter(), timing.attempts + 1
            call = replica.stub.Process(timeout=self.remaining())
            self._calls[stage] = call
            header = stage_pb2.StageRequestHeader(
                request_id=self.request_id, params=self.params, inline_outputs=stage in self.outputs,
                deadline_unix_ms=int(self.deadline * 1e3) if self.deadline else 0)
            try:
                await call.write(stage_pb2.StageInput(header=header))
                if not self._inputs[stage]:
                    await call.done_writing()
            except BaseException:
                replica.outstanding -= 1
                raise
            self._active += 1
            self._tasks[stage] = asyncio.create_task(self._pump(stage, call, replica), name=f"pump-{stage}")
            return call

    async def _pump(self, stage: str, call: grpc.aio.StreamStreamCall, replica: Replica) -> None:
        error: BaseException | None = None
        timing = self.timings[stage]
        consumers = [s for s, srcs in self._inputs.items() if stage in srcs]
        modality = self.outputs.get(stage)
        try:
            ended = False
            async for out in call:
                chunk = out.chunk
                now = time.perf_counter()
                if timing.first_chunk is None:
                    timing.first_chunk = now
                timing.chunks += 1
                timing.queue_ms += chunk.timing.queue_ms
                timing.compute_ms += chunk.timing.compute_ms
                timing.transfer_ms += chunk.timing.transfer_ms
                if chunk.chunk_id == 0:
                    self.assembler.count_prompt(chunk)
                if chunk.finish_reason and modality == "text":
                    self.finish_reason = chunk.finish_reason
                for consumer in consumers:
                    await self._forward(stage, consumer, chunk)
                if modality:
                    for ev in self.assembler.events(modality, chunk):
                        await self._events.put(ev)
                if chunk.end_of_stream:
                    ended = True
                    break
            if not ended:
                raise StageFailed(stage, grpc.StatusCode.UNAVAILABLE,
                                  f"stage {stage} ended its stream without end of stream", replica.address)
            timing.finished = time.perf_counter()
        except grpc.aio.AioRpcError as e:
            code, message = client_status(stage, e.code(), e.details() or "")
            error = StageFailed(stage, code, message, replica.address)
        except NoReplica as e:
            error = StageFailed(e.stage, grpc.StatusCode.UNAVAILABLE, str(e))
        except asyncio.CancelledError:
            raise
        except StageFailed as e:
            error = e
        except Exception as e:  # noqa: BLE001 - reported to the client as this stage's failure
            error = StageFailed(stage, grpc.StatusCode.UNAVAILABLE, f"stage {stage} failed: {type(e).__name__}: {e}",
                                replica.address)
        finally:
            replica.outstanding -= 1
        await self._events.put(_PumpDone(stage, error))

    async def _forward(self, source: str, consumer: str, chunk: stage_pb2.Chunk) -> None:
        try:
            call = await self._open(consumer)
        except grpc.aio.AioRpcError as e:  # the consumer failed as it was called: its failure, not ours
            code, message = client_status(consumer, e.code(), e.details() or "")
            raise StageFailed(consumer, code, message) from None
        except NoReplica as e:
            raise StageFailed(consumer, grpc.StatusCode.UNAVAILABLE, str(e)) from None
        try:
            await call.write(stage_pb2.StageInput(chunk=chunk))
            if chunk.end_of_stream:
                self._ended_inputs[consumer].add(source)
                if self._ended_inputs[consumer] >= set(self._inputs[consumer]):
                    await call.done_writing()
        except grpc.aio.AioRpcError:
            pass  # the consumer's own pump reports its failure
        except asyncio.InvalidStateError:
            pass  # the consumer already finished (e.g. stopped at its own length limit)

    def trace(self, admission_wait_ms: float = 0.0) -> "common_pb2.RequestTrace":
        t0 = self.started
        end = time.perf_counter()
        stages = []
        for st in self.pipeline.stages:
            t = self.timings.get(st.name)
            if t is None:
                continue
            stages.append(common_pb2.StageTrace(
                stage=st.name, replica=t.replica, queue_ms=t.queue_ms, compute_ms=t.compute_ms,
                transfer_ms=t.transfer_ms,
                first_chunk_ms=((t.first_chunk or end) - t.dispatched) * 1e3,
                total_ms=((t.finished or end) - t.dispatched) * 1e3, chunks=t.chunks, attempts=t.attempts))
        return common_pb2.RequestTrace(admission_wait_ms=admission_wait_ms,
                                       first_output_ms=((self.first_output or end) - t0) * 1e3,
                                       total_ms=(end - t0) * 1e3, stages=stages)


def pipeline_stages(pipeline: Pipeline, names: set[str]):
    return [s for s in pipeline.stages if s.name in names]
