"""One request's walk through the stage graph.

Entry stages are called at once; a downstream stage is called when the first
chunk of its input exists, and every chunk is forwarded the moment it
arrives, so stages overlap. Output-stage chunks become client events.

A stage replica that fails mid-request is replaced by another replica of the
stage when its inputs are still held (the chunks forwarded to it are kept
until it finishes, within a byte budget; chunks by reference as descriptors,
their producers keeping the tensors until this request releases them) and none
of its output has reached the client; the new replica gets the same header and
inputs, and chunks it repeats (ids already handled) go nowhere. Otherwise the client gets
UNAVAILABLE naming the stage, and every other stage call is cancelled.
Each stage's call, with its replay and retry, is a `StageCall` (stage_call.py);
this module wires them into the graph and turns outputs into client events.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc

from omnistage.api import Pipeline, stage_inputs
from omnistage.v1 import common_pb2, orchestrator_pb2, stage_pb2

from .outputs import OutputAssembler
from .routing import NoReplica, Router
from .stage_call import StageCall, StageFailed, StageTiming

__all__ = ["RequestRun", "StageFailed", "needed_stages"]
CUT = "length"  # a stage's finish reason when it stopped at its cap (max tokens, max codec frames)


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
    trace_metadata: tuple[tuple[str, str], ...] = ()  # the request's trace context, on each stage call (otel.py)

    def __post_init__(self):
        self.needed = needed_stages(self.pipeline, set(self.outputs))
        self.assembler = OutputAssembler(self.request_id, fps=self.params.video.fps)
        self._events: asyncio.Queue = asyncio.Queue(self.max_buffered_events)
        inputs = {s.name: [e.source for e in s.inputs if e.source in self.needed]
                  for s in self.pipeline.stages if s.name in self.needed}
        self._consumers = {s: [c for c, srcs in inputs.items() if s in srcs] for s in self.needed}
        self._entry = [s.name for s in self.pipeline.stages if s.name in self.needed and not inputs[s.name]]
        self._params: dict[str, common_pb2.GenerationParams] = {}
        by_reads: dict[frozenset[str], common_pb2.GenerationParams] = {}  # one copy per set of parts read
        for s in self.needed:
            reads = stage_inputs(self.pipeline.stage(s))
            if reads not in by_reads:
                by_reads[reads] = stage_params(self.params, reads)
            self._params[s] = by_reads[reads]
        self._calls = {s: StageCall(s, frozenset(inputs[s]), self._header(s), router=self.router,
                                    deadline=self.deadline, deliver=functools.partial(self._deliver, s),
                                    ended=functools.partial(self._ended, s), max_attempts=self.max_attempts,
                                    max_replay_bytes=self.max_replay_bytes, metadata=self.trace_metadata,
                                    progress=functools.partial(self._progress, s))
                       for s in self.needed}
        self._active = 0  # stage calls whose outputs are still being read
        self._by_reference: set[str] = set()  # stages whose outputs went by reference: they hold them for retries
        self._completed = False
        self.started = time.perf_counter()
        self.first_output: float | None = None
        self._finish_reasons: dict[str, str] = {}  # stage -> the finish reason its last chunk gave

    # ------------------------------------------------------------- public
    async def events(self) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        """Client events as they appear; raises StageFailed when a stage fails for good."""
        try:
            for stage in self._entry:
                await self._open(stage)
            self.on_dispatched()
            while self._active:
                item = await self._events.get()
                if isinstance(item, _PumpDone):
                    if item.error is not None:
                        raise item.error
                    self._active -= 1
                    continue
                if self.first_output is None and not item.HasField("progress"):
                    self.first_output = time.perf_counter()
                yield item
            self._completed = True
        finally:
            await self.cancel()
            if not self._completed or any(sc.unfetched for sc in self._calls.values()):
                _background(self._release_everywhere())
            elif self._by_reference:  # producers keep fetched tensors for a retry until told the request ended
                _background(self._release_everywhere(self._by_reference))

    async def cancel(self) -> None:
        """Cancel every stage call still running (client gone, deadline, or a failed stage)."""
        for sc in self._calls.values():
            sc.cancel()
        for sc in self._calls.values():
            await sc.stopped()

    async def _release_everywhere(self, stages: set[str] | None = None) -> None:
        """Tell every replica the request touched (of `stages`; None: all) to free what it still holds for it."""
        calls = []
        for stage, sc in self._calls.items():
            if stages is not None and stage not in stages:
                continue
            pool = self.router.pools.get(stage)
            for addr in sc.tried:
                r = pool.replicas.get(addr) if pool else None
                if r is not None:
                    calls.append(r.stub.Release(stage_pb2.ReleaseRequest(request_id=self.request_id), timeout=5,
                                                metadata=self.trace_metadata))
        await asyncio.gather(*calls, return_exceptions=True)  # a replica that is gone frees by its TTL

    @property
    def finish_reason(self) -> str:
        """Why the answer ended: "length" when any stage it needed was cut at its cap (audio cut at
        maxCodecFrames is a cut answer even when the text ended on its own), else the text stage's reason;
        "" before any stage said."""
        reasons = self._finish_reasons
        if CUT in reasons.values():
            return CUT
        text = [reasons[s] for s, m in self.outputs.items() if m == "text" and s in reasons]
        return text[0] if text else next(iter(reasons.values()), "")

    @property
    def held_bytes(self) -> int:
        return sum(sc.held_bytes for sc in self._calls.values())

    @property
    def timings(self) -> dict[str, StageTiming]:
        """Per stage called so far."""
        return {s: sc.timing for s, sc in self._calls.items() if sc.timing.attempts}

    # ----------------------------------------------------------- stage calls
    def _header(self, stage: str) -> stage_pb2.StageRequestHeader:
        return stage_pb2.StageRequestHeader(
            request_id=self.request_id, params=self._params[stage], inline_outputs=stage in self.outputs,
            consumers=self._consumers[stage], deadline_unix_ms=int(self.deadline * 1e3) if self.deadline else 0,
            # a stage whose chunks go only to other stages is retried after handing some on: its repeats are
            # checked against their digests (StageCall._drain)
            digest_outputs=stage not in self.outputs,
            failure_message=True,  # StageCall._drain takes a StageFailure as the stage's answer
            progress=True)  # StageCall takes StageProgress reports between chunks (a client Progress event)

    async def _open(self, stage: str) -> None:
        if await self._calls[stage].open():
            self._active += 1

    async def _deliver(self, stage: str, chunk: stage_pb2.Chunk) -> bool:
        """A stage's new output chunk: to its consumers, then to the client as events. True when
        some of it reached the client."""
        modality = self.outputs.get(stage)
        if chunk.chunk_id == 0:
            self.assembler.count_prompt(chunk)
        if chunk.finish_reason:
            self._finish_reasons[stage] = chunk.finish_reason
        if any(t.WhichOneof("payload") == "ref" for t in chunk.tensors):
            self._by_reference.add(stage)
        for consumer in self._consumers[stage]:
            try:
                await self._open(consumer)  # its first input exists now
            except NoReplica as e:
                raise StageFailed(consumer, grpc.StatusCode.UNAVAILABLE, str(e)) from None
            await self._calls[consumer].forward(stage, chunk)
        reached = False
        if modality:
            for ev in self.assembler.events(modality, chunk):
                reached = True
                await self._events.put(ev)
        return reached

    async def _progress(self, stage: str, progress: stage_pb2.StageProgress) -> None:
        """A stage's report of how far it has come: a client event (no consumer stage reads it)."""
        await self._events.put(self.assembler.progress(stage, progress))

    async def _ended(self, stage: str, error: StageFailed | None) -> None:
        await self._events.put(_PumpDone(stage, error))

    # -------------------------------------------------------------- trace
    def trace(self, admission_wait_ms: float = 0.0, media_decode_ms: float = 0.0) -> common_pb2.RequestTrace:
        end = time.perf_counter()
        stages = []
        for st in self.pipeline.stages:
            t = self.timings.get(st.name)
            if t is None:
                continue
            stages.append(common_pb2.StageTrace(
                stage=st.name, replica=t.replica, queue_ms=t.queue_ms, compute_ms=t.compute_ms,
                transfer_ms=t.transfer_ms, encode_ms=t.encode_ms, transfer_path=",".join(sorted(t.transfer_paths)),
                first_chunk_ms=((t.first_chunk or end) - t.dispatched) * 1e3,
                total_ms=((t.finished or end) - t.dispatched) * 1e3, chunks=t.chunks, attempts=t.attempts,
                units=t.units, unit=t.unit))
        return common_pb2.RequestTrace(admission_wait_ms=admission_wait_ms, media_decode_ms=media_decode_ms,
                                       first_output_ms=((self.first_output or end) - self.started) * 1e3,
                                       total_ms=(end - self.started) * 1e3, stages=stages)


_BACKGROUND: set[asyncio.Task] = set()


def _background(coro) -> None:
    """Run `coro` after the request has answered, keeping a reference until it is done."""
    task = asyncio.get_running_loop().create_task(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


def stage_params(params: common_pb2.GenerationParams, inputs: frozenset[str]) -> common_pb2.GenerationParams:
    """`params` as sent to a stage whose adapter reads the content parts `inputs`: each media part it does
    not read becomes an empty message of its kind, so the stage is not sent megabytes it ignores and part
    indices still match the request. `params` itself when the stage reads every part it has."""
    keep = [p.WhichOneof("part") in inputs | {"text", None} for p in params.parts]
    if all(keep):
        return params
    out = common_pb2.GenerationParams()
    for fd, value in params.ListFields():  # every field but the parts, without copying the parts' bytes
        if fd.name == "parts":
            continue
        if fd.is_repeated:
            getattr(out, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(out, fd.name).CopyFrom(value)
        else:
            setattr(out, fd.name, value)
    for part, kept in zip(params.parts, keep):
        out.parts.append(part if kept else common_pb2.ContentPart(**{part.WhichOneof("part"): {}}))
    return out


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
