"""One stage's call within a request: the replica serving it, the inputs forwarded to it (kept for a
replay), the outputs it has delivered, and its retry on another replica, within the retry budget the
orchestrator's stage calls share (retry_budget.py).

Two tasks per call, each the only one doing its job. The reader takes the stage's output chunks in
order, hands each new one to the request (`deliver`) and, when the replica fails, dispatches another:
a call that never reached its replica (connection refused) goes to another one without counting as an
attempt or against the budget, and the replica is ejected from routing (outliers.py).
The writer is the only task that writes to the stage's stream; it is fed by a queue of attempts (the
header, then the inputs held so far) and forwarded chunks, so a chunk forwarded during a retry waits
behind the replay and a new replica sees every input once and in order, without a lock passed
between tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc

from omnistage.v1 import stage_pb2

from .outliers import nothing_sent
from .retry_budget import CallBudget
from .routing import NoReplica, Replica, Router

log = logging.getLogger("omnistage.orchestrator")
# What a stage's failure details may carry that is the operator's to know, not the client's: replica
# addresses (IPv4, [IPv6], with a port) and shared-memory segment paths. The log keeps them whole.
INTERNAL_DETAIL = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\[[0-9A-Fa-f:.]+\](?::\d+)?|/dev/shm/\S+")
# Failures another replica may not repeat. Bad input, deadlines and cancels are the request's own.
RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS}
# Failures the stage itself returned (its engine went wrong on this request): their retries are bounded by
# the retry budget, so one bad request cannot mark every replica down. A replica that is gone
# (UNAVAILABLE, a stream cut short) or full is not the request's fault: those retries are not budgeted,
# or losing one replica of two would fail whatever the budget could not re-home.
BUDGETED = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}


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
    shown = INTERNAL_DETAIL.sub("<internal>", details)
    return grpc.StatusCode.UNAVAILABLE, f"stage {stage} failed: {shown or code.name}"


def remaining(deadline: float | None) -> float | None:
    """Seconds left before a time.time() deadline (None: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.time())


@dataclass
class StageTiming:
    replica: str = ""
    dispatched: float = 0.0
    first_chunk: float | None = None
    finished: float | None = None
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    transfer_ms: float = 0.0
    encode_ms: float = 0.0
    chunks: int = 0
    attempts: int = 0
    transfer_paths: set[str] = field(default_factory=set)  # memory paths of the stage's inputs (connector)
    units: int = 0  # the stage's work for the request, from its last chunk (ChunkTiming.units), and its name
    unit: str = ""


class _Incomplete(Exception):
    """The stream ended without end of stream: the replica went away."""


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Reported(Exception):
    """The stage said which status it ends the call with (a StageFailure message): that is its answer, whatever
    status the gRPC library then reports (one still writing inputs may be told INTERNAL: stage.proto)."""

    def __init__(self, failure: stage_pb2.StageFailure):
        super().__init__(failure.message)
        self.code = _STATUS_CODES.get(failure.code, grpc.StatusCode.UNKNOWN)
        self.details = failure.message


@dataclass(frozen=True)
class _Attempt:
    """A call just opened on a replica: the writer sends it the header, then `replay`."""
    call: grpc.aio.StreamStreamCall
    replay: tuple[stage_pb2.Chunk, ...]
    inputs_ended: bool  # every input edge has ended within `replay`: half-close after it


@dataclass(frozen=True)
class _Input:
    """A chunk forwarded from an upstream stage."""
    chunk: stage_pb2.Chunk
    inputs_ended: bool  # the end of the last input edge still open: half-close after it


class StageCall:
    """The request's call on one stage, across its attempts on replicas."""

    def __init__(self, stage: str, sources: frozenset[str], header: stage_pb2.StageRequestHeader, *,
                 router: Router, deadline: float | None,
                 deliver: Callable[[stage_pb2.Chunk], Awaitable[bool]],
                 ended: Callable[[StageFailed | None], Awaitable[None]],
                 max_attempts: int, max_replay_bytes: int, metadata: tuple[tuple[str, str], ...] = (),
                 progress: Callable[[stage_pb2.StageProgress], Awaitable[None]] | None = None):
        """`deliver(chunk)` hands on each output chunk once, in order, and says whether any of it
        reached the client; `ended(error)` is awaited once the call is over (error None: finished).
        `metadata` goes with every attempt (the request's trace context). `progress(p)` is awaited for each
        step forward the stage reports (StageOutput.progress); a retried replica's reports count again from
        its start, and only those past what was reported already are handed on."""
        self.stage, self.sources, self.header, self.metadata = stage, sources, header, metadata
        self.router, self.deadline = router, deadline
        self._deliver, self._ended, self._progress = deliver, ended, progress
        self.progress_done = 0         # the furthest progress handed on (units done)
        self.max_attempts, self.max_replay_bytes = max_attempts, max_replay_bytes
        self.tried: set[str] = set()   # replicas called, for Release when the request ends
        self.timing = StageTiming()
        self.delivered = 0             # output chunks (ids 0..delivered-1) already handed on
        self._digests: list[bytes] = []  # the digests of those chunks (empty when the stage gives none)
        self.client_saw = False        # some of this stage's output reached the client
        self.finished = False
        self.unfetched = False         # a chunk forwarded here was never sent: its producer may hold it
        self._counted = 0              # attempts that reached a replica (refused connections are not counted)
        self._log: list[stage_pb2.Chunk] = []  # every input so far while `_replayable`, for a new replica
        self._log_bytes = 0
        self._replayable = True
        self._ended_sources: set[str] = set()
        self._call: grpc.aio.StreamStreamCall | None = None
        self._replica: Replica | None = None
        self._writes: asyncio.Queue[_Attempt | _Input] = asyncio.Queue()
        # Taken only inside open(): a second source forwarding meanwhile waits for the first dispatch.
        self._opening = asyncio.Lock()
        self._reader: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None

    @property
    def held_bytes(self) -> int:
        return self._log_bytes

    # ------------------------------------------------------------ request side
    async def open(self) -> bool:
        """Dispatch the first attempt and start reading and writing; False when it is open or over."""
        async with self._opening:
            if self._reader is not None or self.finished:
                return False
            replica = await self._acquire()
            self._writer = asyncio.create_task(self._write(), name=f"write-{self.stage}")
            self._attempt(replica)
            self._reader = asyncio.create_task(self._read(), name=f"read-{self.stage}")
            return True

    async def forward(self, source: str, chunk: stage_pb2.Chunk) -> None:
        """Send `chunk` from `source` to the stage. Returns once the writer has sent everything queued,
        so a stage that reads slowly holds its producer back."""
        if self.finished:
            self.unfetched = True  # the stage stopped early: the producer may hold this chunk
            return
        self._hold(chunk)
        if chunk.end_of_stream:
            self._ended_sources.add(source)
        self._writes.put_nowait(_Input(chunk, chunk.end_of_stream and self._ended_sources >= self.sources))
        await self._writes.join()

    def cancel(self) -> None:
        """Stop the call where it stands (the request failed, or its client went away)."""
        if self._call is not None and not self.finished:
            self._call.cancel()
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()

    async def stopped(self) -> None:
        """Wait until both tasks have ended (after `cancel`)."""
        for task in (self._reader, self._writer):
            if task is not None:
                with contextlib.suppress(BaseException):
                    await task

    # --------------------------------------------------------------- inputs
    def _hold(self, chunk: stage_pb2.Chunk) -> None:
        """Keep `chunk` for a replay, or give up replaying when it cannot be kept."""
        if not self._replayable:
            return
        # A chunk by reference is held here as its descriptor only: its producer keeps the tensors after
        # they were fetched until the request is released (or its TTL, or its budget needs the room:
        # omnistage/connector/store.py), so a new replica fetches them again; one the producer no longer
        # holds fails that replica's fetch, and the call ends there. Past the byte budget the orchestrator
        # will not hold more.
        size = chunk.ByteSize()
        if self._log_bytes + size > self.max_replay_bytes:
            self._replayable = False
            self._log.clear()
            self._log_bytes = 0
            return
        self._log.append(chunk)
        self._log_bytes += size

    async def _write(self) -> None:
        call: grpc.aio.StreamStreamCall | None = None
        while True:
            item = await self._writes.get()
            try:
                if isinstance(item, _Attempt):
                    call = item.call
                    messages = [stage_pb2.StageInput(header=self.header),
                                *(stage_pb2.StageInput(chunk=c) for c in item.replay)]
                elif self.finished:
                    self.unfetched = True  # the stage stopped early: the producer may hold this chunk
                    continue
                else:
                    messages = [stage_pb2.StageInput(chunk=item.chunk)]
                for message in messages:
                    await call.write(message)
                if item.inputs_ended:
                    await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the call failed: the reader sees its status, and the log holds the inputs for a replay
            finally:
                self._writes.task_done()

    # -------------------------------------------------------------- outputs
    async def _read(self) -> None:
        error: StageFailed | None = None
        try:
            with self.router.retry_budget.call() as budget:  # the call is active (and maybe retrying) till here
                while True:
                    call, replica = self._call, self._replica
                    try:
                        await self._drain(call)
                        self.router.served(replica)
                        break
                    except grpc.aio.AioRpcError as e:
                        code, details = e.code(), e.details() or ""
                    except _Reported as e:
                        code, details = e.code, e.details
                    except _Incomplete:
                        code, details = grpc.StatusCode.UNAVAILABLE, "stream ended without end of stream"
                    finally:
                        self.router.release(replica)
                    await self._retry(replica, code, details, budget)
            self.finished = True
            self.timing.finished = time.perf_counter()
            self._log.clear()
            self._log_bytes = 0
        except asyncio.CancelledError:
            raise
        except StageFailed as e:
            error = e
        except NoReplica as e:
            error = StageFailed(e.stage, grpc.StatusCode.UNAVAILABLE, str(e))
        except Exception as e:  # noqa: BLE001 - reported to the client as this stage's failure
            error = StageFailed(self.stage, grpc.StatusCode.UNAVAILABLE,
                                f"stage {self.stage} failed: {type(e).__name__}: {e}")
        await self._ended(error)

    async def _drain(self, call: grpc.aio.StreamStreamCall) -> None:
        """Hand on one attempt's new output chunks until end of stream."""
        timing = self.timing
        async for out in call:
            kind = out.WhichOneof("kind")
            if kind == "failure":
                raise _Reported(out.failure)
            if kind == "progress":
                await self._progressed(out.progress)
                continue
            chunk = out.chunk
            if chunk.chunk_id < self.delivered:  # a retried replica repeating what was already handed on
                self._check_repeat(chunk)
                continue
            if chunk.chunk_id != self.delivered:
                raise StageFailed(self.stage, grpc.StatusCode.UNAVAILABLE,
                                  f"stage {self.stage} sent chunk {chunk.chunk_id}, expected {self.delivered}")
            if timing.first_chunk is None:
                timing.first_chunk = time.perf_counter()
            timing.chunks += 1
            timing.queue_ms += chunk.timing.queue_ms
            timing.compute_ms += chunk.timing.compute_ms
            timing.transfer_ms += chunk.timing.transfer_ms
            timing.encode_ms += chunk.timing.encode_ms
            if chunk.timing.transfer_path:
                timing.transfer_paths.update(chunk.timing.transfer_path.split(","))
            timing.units += chunk.timing.units
            timing.unit = chunk.timing.unit or timing.unit
            if await self._deliver(chunk):
                self.client_saw = True
            self.delivered += 1
            self._digests.append(chunk.digest)
            if chunk.end_of_stream:
                return
        raise _Incomplete()

    async def _progressed(self, progress: stage_pb2.StageProgress) -> None:
        if progress.done <= self.progress_done or self._progress is None:
            return  # a retry repeating steps already reported: the client saw them
        self.progress_done = progress.done
        await self._progress(progress)

    def _check_repeat(self, chunk: stage_pb2.Chunk) -> None:
        """A chunk repeated after a retry must be the one handed on: a replica that generates something else
        (an engine that is not reproducible across replicas, batches or builds) fails the request rather
        than splice its continuation onto another generation."""
        before = self._digests[chunk.chunk_id]
        if before and chunk.digest != before:
            raise StageFailed(self.stage, grpc.StatusCode.UNAVAILABLE,
                              f"stage {self.stage}: the retry did not reproduce chunk {chunk.chunk_id} already handed "
                              f"on (its content differs), so its output cannot be continued on another replica")

    # ------------------------------------------------------------- attempts
    async def _acquire(self) -> Replica:
        try:
            return await self.router.acquire(self.stage, self.tried, remaining(self.deadline))
        except TimeoutError as e:
            raise StageFailed(self.stage, grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from None

    def _attempt(self, replica: Replica) -> None:
        """Open the call on `replica` and queue its header and replay, in one step with nothing
        forwarded in between: inputs queued after it are not in the replay."""
        self.tried.add(replica.address)
        timing = self.timing
        if not timing.attempts:
            timing.dispatched = time.perf_counter()
        timing.replica, timing.attempts = replica.address, timing.attempts + 1
        self._counted += 1
        self._call = replica.stub.Process(timeout=remaining(self.deadline), metadata=self.metadata)
        self._replica = replica
        self._writes.put_nowait(_Attempt(self._call, tuple(self._log), self._ended_sources >= self.sources))

    async def _retry(self, failed: Replica, code: grpc.StatusCode, details: str, budget: CallBudget) -> None:
        """Dispatch another replica after `failed` ended the call, or raise StageFailed saying why not."""
        refused = nothing_sent(code, details)
        if refused:  # it never reached the replica: not an attempt, and the replica leaves routing now
            self._counted -= 1
            self.router.eject(failed)
        self._may_retry(failed, code, details)
        if code in BUDGETED and not budget.try_retry():
            raise self._not_retried(failed, code, details, "retry budget exhausted")
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED and not refused:
            self.router.report_failure(failed)
        try:
            replica = await self._acquire()
        except NoReplica:
            c, message = client_status(self.stage, code, details)
            raise StageFailed(self.stage, c, f"{message} (no other ready replica)", failed.address) from None
        try:
            self._may_retry(failed, code, details)  # an input forwarded while we waited may not be held
        except StageFailed:
            self.router.release(replica)
            raise
        self._attempt(replica)

    def _may_retry(self, failed: Replica, code: grpc.StatusCode, details: str) -> None:
        # Output the client has seen is never sent again, and a new replica does not resume after it: even
        # seeded per request, a stage repeats its output bit for bit on another replica only when its engine
        # is batch-invariant (an engine option, off by default, and not vLLM's): other batch neighbours change
        # the arithmetic, a token can flip, and a resumed stream would splice two different answers. Only a
        # call whose output went nowhere but to other stages (which skip chunk ids they have) is retried.
        why = ("its output already reached the client" if self.client_saw else
               "its inputs are no longer held" if not self._replayable else
               f"{self._counted} attempts made" if self._counted >= self.max_attempts else "")
        if code not in RETRIABLE or why:
            raise self._not_retried(failed, code, details, why)

    def _not_retried(self, failed: Replica, code: grpc.StatusCode, details: str, why: str) -> StageFailed:
        """The call's failure as the client gets it, saying why it was not retried (`why`: "" when its
        status is the request's own)."""
        c, message = client_status(self.stage, code, details)
        if c == grpc.StatusCode.UNAVAILABLE:
            log.warning("stage %s replica %s failed (%s): %s", self.stage, failed.address, code.name, details)
        if c == grpc.StatusCode.UNAVAILABLE and why and code in RETRIABLE:
            message += f" (not retried: {why})"
        return StageFailed(self.stage, c, message, failed.address)
