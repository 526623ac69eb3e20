"""The orchestrator's span of a request: the root of the request's trace, live from the moment the request
is admitted to its queue until it ends, and the trace context every stage call carries (gRPC metadata), so
that the stages' spans (stage_service/tracing.py) are its children. A client's W3C `traceparent` (gRPC
metadata on Generate, the HTTP header on the OpenAI-compatible API) makes it a child of the client's span.

Tracing is set up by the standard OTEL_* variables (omnistage/tracing.py); off, a request costs one object
and passes the client's trace context on unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from omnistage import tracing

SERVICE_NAME = "omnistage-orchestrator"  # the resource's service.name unless OTEL_SERVICE_NAME names one
ROOT_SPAN = "omnistage.request"
# Outcomes that are not the server's fault: the span is not marked as an error for them.
NOT_ERRORS = ("finished", "cancelled", "invalid", "rejected")


def configure_from_env() -> bool:
    return tracing.configure_from_env(SERVICE_NAME)


@dataclass(frozen=True)
class Incoming:
    """Where a request came in (`door`: grpc or http) and the W3C trace context it came with (checked)."""
    door: str
    context: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, door: str, pairs: Iterable[tuple[str, Any]]) -> "Incoming":
        """From the door's headers or metadata."""
        return cls(door, tracing.trace_context(pairs))


class RequestSpan:
    """The root span of one request; `metadata` is what each of its stage calls carries."""

    def __init__(self, incoming: Incoming | None, pipeline: str, request_id: str, client_request_id: str,
                 max_tokens: int):
        incoming = incoming or Incoming("")
        tracer = tracing.tracer()
        self.span = None
        if tracer is not None:
            from opentelemetry.trace import SpanKind

            self.span = tracer.start_span(ROOT_SPAN, context=tracing.parent_context(incoming.context),
                                          kind=SpanKind.SERVER, attributes={
                                              "omnistage.door": incoming.door, "omnistage.pipeline": pipeline,
                                              "omnistage.request_id": request_id,
                                              "omnistage.client_request_id": client_request_id,
                                              "gen_ai.request.model": pipeline,
                                              "gen_ai.request.max_tokens": max_tokens})
        self.metadata = tracing.carried(self.span, incoming.context)

    def admitted(self, wait_s: float) -> None:
        if self.span is not None:
            self.span.set_attribute("omnistage.admission_wait_seconds", wait_s)

    def answered(self, final) -> None:
        """The request's Final: its usage and finish reason."""
        if self.span is not None:
            u = final.usage
            self.span.set_attributes({"gen_ai.usage.input_tokens": u.prompt_tokens,
                                      "gen_ai.usage.output_tokens": u.completion_tokens,
                                      "gen_ai.response.finish_reasons": (final.finish_reason,),
                                      "omnistage.audio_samples": u.audio_samples})

    def end(self, outcome: str, error: str = "") -> None:
        if self.span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        self.span.set_attribute("omnistage.outcome", outcome)
        if outcome not in NOT_ERRORS:
            self.span.set_status(Status(StatusCode.ERROR, error or outcome))
        self.span.end()
