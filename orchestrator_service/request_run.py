"""One request's walk through the stage graph.

Entry stages are called at once; a downstream stage is called when the first
chunk of its input exists, and every chunk is forwarded the moment it
arrives, so stages overlap. Output-stage chunks become client events.

A stage replica that fails mid-request is replaced by another replica of the
stage when its inputs are still held (the chunks forwarded to it are kept
until it finishes, within a byte budget) and none of its output has reached
the client; the new replica gets the same header and inputs, and chunks it
repeats (ids already handled) go nowhere. Otherwise the client gets
UNAVAILABLE naming the stage, and every other stage call is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import grpc

from omnistage.spec import Pipeline
from omnistage.v1 import common_pb2, orchestrator_pb2, stage_pb2

from .outputs import OutputAssembler
from .routing import NoReplica, Replica, Router

# Failures another replica may not repeat. Bad input, deadlines and cancels are the request's own.
RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS}


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


class _Incomplete(Exception):
    """The stream ended without end of stream: the replica went away."""


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
class _StageCall:
    """The request's current call on one stage and what it has been sent and has given back."""

    call: grpc.aio.StreamStreamCall | None = None
    replica: Replica | None = None
    tried: set[str] = field(default_factory=set)
    inputs_log: list[stage_pb2.Chunk] = field(default_factory=list)  # for replay on another replica
    log_bytes: int = 0
    log_complete: bool = True
    ended_inputs: set[str] = field(default_factory=set)
    delivered: int = 0          # output chunks (ids 0..delivered-1) already forwarded / sent to the client
    client_saw: bool = False    # some of this stage's output reached the client
    finished: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


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
    max_attempts: int = 3
    max_replay_bytes: int = 64 << 20
    on_dispatched: Callable[[], None] = lambda: None  # the request reached its first stage
    max_buffered_events: int = 64
    timings: dict[str, StageTiming] = field(default_factory=dict)

    def __post_init__(self):
        self.needed = needed_stages(self.pipeline, set(self.outputs))
        self.assembler = OutputAssembler(self.request_id)
        self._events: asyncio.Queue = asyncio.Queue(self.max_buffered_events)
        self._stages = {s: _StageCall() for s in self.needed}
        self._tasks: dict[str, asyncio.Task] = {}
        self._inputs = {s.name: [e.source for e in s.inputs if e.source in self.needed]
                        for s in self.pipeline.stages if s.name in self.needed}
        self._consumers = {s: [c for c, srcs in self._inputs.items() if s in srcs] for s in self.needed}
        self._active = 0  # stage calls whose outputs are still being pumped
        self._unfetched = False  # some chunk may never be fetched from its producer
        self._completed = False
        self.started = time.perf_counter()
        self.first_output: float | None = None
        self.finish_reason = ""

    # ------------------------------------------------------------- public
    async def events(self) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        """Client events as they appear; raises StageFailed when a stage fails for good."""
        try:
            for st in self.pipeline.stages:
                if st.name in self.needed and not self._inputs[st.name]:
                    await self._open(st.name)
            self.on_dispatched()
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
            self._completed = True
        finally:
            await self.cancel()
            if self._unfetched or not self._completed:
                _background(self._release_everywhere())

    async def cancel(self) -> None:
        """Cancel every stage call still running (client gone, deadline, or a failed stage)."""
        for sc in self._stages.values():
            if sc.call is not None and not sc.finished:
                sc.call.cancel()
        for t in self._tasks.values():
            t.cancel()
        for t in self._tasks.values():
            with contextlib.suppress(BaseException):
                await t

    async def _release_everywhere(self) -> None:
        """Tell every replica the request touched to free what it still holds for it."""
        calls = []
        for stage, sc in self._stages.items():
            pool = self.router.pools.get(stage)
            for addr in sc.tried:
                r = pool.replicas.get(addr) if pool else None
                if r is not None:
                    calls.append(r.stub.Release(stage_pb2.ReleaseRequest(request_id=self.request_id), timeout=5))
        await asyncio.gather(*calls, return_exceptions=True)  # a replica that is gone frees by its TTL

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.time())

    @property
    def held_bytes(self) -> int:
        return sum(sc.log_bytes for sc in self._stages.values())

    # ----------------------------------------------------------- dispatch
    async def _open(self, stage: str) -> None:
        sc = self._stages[stage]
        await sc.lock.acquire()
        handed_over = False
        try:
            if sc.call is None and not sc.finished:
                handed_over = await self._dispatch(stage)
                self._active += 1
                self._tasks[stage] = asyncio.create_task(self._pump(stage), name=f"pump-{stage}")
        finally:
            if not handed_over:
                sc.lock.release()

    async def _dispatch(self, stage: str) -> bool:
        """Call a replica of `stage`: the header, then every input held so far.

        The caller holds the stage's lock. When inputs are replayed, the lock passes to the replay
        task (which releases it when done) and this returns True: chunks forwarded meanwhile wait
        behind the replay, so the new replica sees every input once and in order."""
        sc = self._stages[stage]
        try:
            replica = await self.router.acquire(stage, sc.tried, self.remaining())
        except TimeoutError as e:
            raise StageFailed(stage, grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from None
        sc.tried.add(replica.address)
        timing = self.timings.setdefault(stage, StageTiming())
        if not timing.attempts:
            timing.dispatched = time.perf_counter()
        timing.replica, timing.attempts = replica.address, timing.attempts + 1
        call = replica.stub.Process(timeout=self.remaining())
        sc.call, sc.replica = call, replica
        header = stage_pb2.StageRequestHeader(
            request_id=self.request_id, params=self.params, inline_outputs=stage in self.outputs,
            consumers=self._consumers[stage], deadline_unix_ms=int(self.deadline * 1e3) if self.deadline else 0)
        try:
            await call.write(stage_pb2.StageInput(header=header))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return False  # the call failed already: its pump sees the status and decides
        if sc.inputs_log:
            # On its own task, so the pump goes back to reading this call's outputs at once
            # (a stage may need to emit before it reads more input).
            self._tasks[f"replay-{stage}-{len(sc.tried)}"] = asyncio.create_task(
                self._replay(stage, call), name=f"replay-{stage}")
            return True
        if sc.ended_inputs >= set(self._inputs[stage]):
            await _done_writing(call)
        return False

    async def _replay(self, stage: str, call: grpc.aio.StreamStreamCall) -> None:
        sc = self._stages[stage]
        try:
            for chunk in list(sc.inputs_log):
                await call.write(stage_pb2.StageInput(chunk=chunk))
            if sc.ended_inputs >= set(self._inputs[stage]):
                await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the pump sees the failure
        finally:
            sc.lock.release()

    async def _forward(self, source: str, consumer: str, chunk: stage_pb2.Chunk) -> None:
        sc = self._stages[consumer]
        if sc.finished:
            self._unfetched = True  # the consumer stopped early: the producer may hold this chunk
            return
        if sc.call is None:
            try:
                await self._open(consumer)
            except NoReplica as e:
                raise StageFailed(consumer, grpc.StatusCode.UNAVAILABLE, str(e)) from None
        async with sc.lock:
            if sc.finished:
                return
            if sc.log_complete and any(t.WhichOneof("payload") == "ref" for t in chunk.tensors):
                # The bytes live in the producer's connector, which frees them once fetched: a new
                # replica could not fetch them again, so this stage can no longer be retried.
                sc.log_complete = False
                sc.inputs_log.clear()
                sc.log_bytes = 0
            if sc.log_complete:
                size = chunk.ByteSize()
                if sc.log_bytes + size <= self.max_replay_bytes:
                    sc.inputs_log.append(chunk)
                    sc.log_bytes += size
                else:  # too big to hold for a replay: this stage can no longer be retried
                    sc.log_complete = False
                    sc.inputs_log.clear()
                    sc.log_bytes = 0
            if chunk.end_of_stream:
                sc.ended_inputs.add(source)
            try:
                await sc.call.write(stage_pb2.StageInput(chunk=chunk))
                if chunk.end_of_stream and sc.ended_inputs >= set(self._inputs[consumer]):
                    await sc.call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the consumer's pump sees its failure; the chunk is in the log for a replay

    # -------------------------------------------------------------- pumps
    async def _pump(self, stage: str) -> None:
        sc = self._stages[stage]
        error: BaseException | None = None
        try:
            while True:
                call, replica = sc.call, sc.replica
                try:
                    await self._drain(stage, call)
                    break
                except grpc.aio.AioRpcError as e:
                    code, details = e.code(), e.details() or ""
                except _Incomplete:
                    code, details = grpc.StatusCode.UNAVAILABLE, "stream ended without end of stream"
                finally:
                    self.router.release(replica)
                await self._retry_or_fail(stage, replica, code, details)
            sc.finished = True
            self.timings[stage].finished = time.perf_counter()
            sc.inputs_log.clear()
            sc.log_bytes = 0
        except asyncio.CancelledError:
            raise
        except StageFailed as e:
            error = e
        except NoReplica as e:
            error = StageFailed(e.stage, grpc.StatusCode.UNAVAILABLE, str(e))
        except Exception as e:  # noqa: BLE001 - reported to the client as this stage's failure
            error = StageFailed(stage, grpc.StatusCode.UNAVAILABLE, f"stage {stage} failed: {type(e).__name__}: {e}")
        await self._events.put(_PumpDone(stage, error))

    async def _retry_or_fail(self, stage: str, replica: Replica, code: grpc.StatusCode, details: str) -> None:
        sc = self._stages[stage]
        timing = self.timings[stage]
        why = ("its output already reached the client" if sc.client_saw else
               "its inputs are no longer held" if not sc.log_complete else
               f"{timing.attempts} attempts made" if timing.attempts >= self.max_attempts else "")
        if code not in RETRIABLE or why:
            c, message = client_status(stage, code, details)
            if c == grpc.StatusCode.UNAVAILABLE and why and code in RETRIABLE:
                message += f" (replica {replica.address}; not retried: {why})"
            raise StageFailed(stage, c, message, replica.address)
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.router.report_failure(replica)
        await sc.lock.acquire()
        handed_over = False
        try:
            handed_over = await self._dispatch(stage)
        except NoReplica:
            c, message = client_status(stage, code, details)
            raise StageFailed(stage, c, f"{message} (replica {replica.address}; no other ready replica)",
                              replica.address) from None
        finally:
            if not handed_over:
                sc.lock.release()

    async def _drain(self, stage: str, call: grpc.aio.StreamStreamCall) -> None:
        """Handle one call's output chunks until end of stream."""
        sc = self._stages[stage]
        timing = self.timings[stage]
        modality = self.outputs.get(stage)
        async for out in call:
            chunk = out.chunk
            if chunk.chunk_id < sc.delivered:
                continue  # a retried replica repeating what was already handled
            if chunk.chunk_id != sc.delivered:
                raise StageFailed(stage, grpc.StatusCode.UNAVAILABLE,
                                  f"stage {stage} sent chunk {chunk.chunk_id}, expected {sc.delivered}")
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
            for consumer in self._consumers[stage]:
                await self._forward(stage, consumer, chunk)
            if modality:
                for ev in self.assembler.events(modality, chunk):
                    sc.client_saw = True
                    await self._events.put(ev)
            sc.delivered += 1
            if chunk.end_of_stream:
                return
        raise _Incomplete()

    # -------------------------------------------------------------- trace
    def trace(self, admission_wait_ms: float = 0.0) -> common_pb2.RequestTrace:
        end = time.perf_counter()
        stages = []
        for st in self.pipeline.stages:
            t = self.timings.get(st.name)
            if t is None:
                continue
            stages.append(common_pb2.StageTrace(
                stage=st.name, replica=t.replica, queue_ms=t.queue_ms, compute_ms=t.compute_ms,
                transfer_ms=t.transfer_ms, first_chunk_ms=((t.first_chunk or end) - t.dispatched) * 1e3,
                total_ms=((t.finished or end) - t.dispatched) * 1e3, chunks=t.chunks, attempts=t.attempts))
        return common_pb2.RequestTrace(admission_wait_ms=admission_wait_ms,
                                       first_output_ms=((self.first_output or end) - self.started) * 1e3,
                                       total_ms=(end - self.started) * 1e3, stages=stages)


_BACKGROUND: set[asyncio.Task] = set()


def _background(coro) -> None:
    """Run `coro` after the request has answered, keeping a reference until it is done."""
    task = asyncio.get_running_loop().create_task(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


async def _done_writing(call: grpc.aio.StreamStreamCall) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        await call.done_writing()


def needed_stages(pipeline: Pipeline, output_stages: set[str]) -> set[str]:
    """The output stages and every stage upstream of them."""
    graph = {s.name: [e.source for e in s.inputs] for s in pipeline.stages}
    needed, todo = set(output_stages), list(output_stages)
    while todo:
        for src in graph[todo.pop()]:
            if src not in needed:
                needed.add(src)
                todo.append(src)
    return needed
