"""The spans of one Process call on this stage, made as the call goes: queue (the call admitted, waiting for
the engine's first step for it), compute (the engine's work for the request, up to its last output chunk) and
transfer (its output chunks handed on: the data-plane put and the send, from the first chunk to the end of
the stream). Each is a child of the trace context the call came with (gRPC metadata: the orchestrator's span
of the request), so one request is one trace across the pipeline's processes.

The queue/compute boundary is the engine's first step for the request: the moment its first output chunk
came, less the compute time the engine reports for that chunk (a running step is not interrupted to say it
began). Off (omnistage/tracing.py), every method returns at once.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterable, Iterator

from omnistage import tracing
from stage_service.runtime.base import OutputChunk

SERVICE_PREFIX = "omnistage-stage-"  # service.name is this and the stage's name unless OTEL_SERVICE_NAME names one
QUEUE, COMPUTE, TRANSFER = "omnistage.stage.queue", "omnistage.stage.compute", "omnistage.stage.transfer"


def configure_from_env(stage: str) -> bool:
    return tracing.configure_from_env(SERVICE_PREFIX + stage)


class CallSpans:
    """`async with CallSpans(stage, first_message, metadata) as spans`, around the call's body: `computed(out)`
    for each engine output chunk, `with spans.transferring():` around handing each on. Spans still open when
    the call ends end with it (an error or a cancel marks them)."""

    def __init__(self, stage: str, first: Any, metadata: Iterable[tuple[str, Any]] | None):
        self._tracer = tracing.tracer()
        if self._tracer is None:
            return
        header = first.header if first is not None and first.WhichOneof("kind") == "header" else None
        self._parent = tracing.parent_context(tracing.trace_context(metadata or ()))
        self._attributes = {"omnistage.stage": stage, "omnistage.request_id": header.request_id if header else ""}
        self._queue: Any = None  # opentelemetry Spans, while open (the SDK is imported only when tracing)
        self._compute: Any = None
        self._transfer: Any = None
        self._queue_start = 0
        self._computed = {"omnistage.chunks": 0, "omnistage.compute_seconds": 0.0}
        self._sent = {"omnistage.chunks": 0, "omnistage.transfer_busy_seconds": 0.0}

    async def __aenter__(self) -> CallSpans:
        if self._tracer is not None:
            self._queue_start = time.time_ns()
            self._queue = self._start(QUEUE, self._queue_start)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self._tracer is None:
            return
        if self._compute is not None and self._compute.is_recording():  # the engine ended without a last chunk
            self._compute.set_attributes(self._computed)
        for span in (self._queue, self._compute, self._transfer):
            if span is not None and span.is_recording():
                if exc_type is not None:
                    self._failed(span, exc_type, exc)
                span.end()

    def computed(self, out: OutputChunk) -> None:
        """The engine handed out `out`: the queue span ends at its first step, compute ends at its last chunk."""
        if self._tracer is None:
            return
        now = time.time_ns()
        if self._compute is None:
            began = max(self._queue_start, now - int(out.compute_ms * 1e6))
            self._queue.set_attribute("omnistage.engine_queue_seconds", out.queue_ms / 1e3)
            self._queue.end(end_time=began)
            self._compute = self._start(COMPUTE, began)
        self._computed["omnistage.chunks"] += 1
        self._computed["omnistage.compute_seconds"] += out.compute_ms / 1e3
        if out.last:
            self._compute.set_attributes(self._computed)
            self._compute.end(end_time=now)

    @contextlib.contextmanager
    def transferring(self) -> Iterator[None]:
        """Around handing one output chunk on (its data-plane put and its send)."""
        if self._tracer is None:
            yield
            return
        t0 = time.time_ns()
        if self._transfer is None:
            self._transfer = self._start(TRANSFER, t0)
        try:
            yield
        finally:
            self._sent["omnistage.chunks"] += 1
            self._sent["omnistage.transfer_busy_seconds"] += (time.time_ns() - t0) / 1e9
            self._transfer.set_attributes(self._sent)

    def _start(self, name: str, start_ns: int):
        from opentelemetry.trace import SpanKind

        return self._tracer.start_span(name, context=self._parent, kind=SpanKind.INTERNAL,
                                       attributes=self._attributes, start_time=start_ns)

    @staticmethod
    def _failed(span, exc_type, exc) -> None:
        from opentelemetry.trace import Status, StatusCode

        if issubclass(exc_type, Exception):
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, exc_type.__name__))
        else:  # a cancel, the caller gone: no error of this stage's
            span.set_attribute("omnistage.cancelled", True)
