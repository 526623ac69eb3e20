"""Optional OpenTelemetry export of request traces: one span per request, one child per stage.

Off unless configured: `configure_from_env()` turns it on when OTEL_EXPORTER_OTLP_ENDPOINT is set
(OTLP over gRPC), or a test passes its own exporter to `configure()`.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("omnistage.orchestrator")
_tracer = None


def configure(exporter=None, service_name: str = "omnistage-orchestrator") -> bool:
    """Install a tracer provider exporting to `exporter` (default: OTLP from the environment)."""
    global _tracer
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        log.warning("OpenTelemetry SDK not installed: traces are not exported as spans")
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _tracer = provider.get_tracer("omnistage")
    return True


def configure_from_env() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")) and configure()


def enabled() -> bool:
    return _tracer is not None


def emit(request_id: str, pipeline: str, trace, outcome: str, client_request_id: str = "") -> None:
    """Spans for a finished request from its RequestTrace (times are reconstructed from the trace)."""
    if _tracer is None:
        return
    end_ns = time.time_ns()
    start_ns = end_ns - int(trace.total_ms * 1e6)
    root = _tracer.start_span("omnistage.request", start_time=start_ns, attributes={
        "omnistage.request_id": request_id, "omnistage.client_request_id": client_request_id,
        "omnistage.pipeline": pipeline, "omnistage.outcome": outcome,
        "omnistage.admission_wait_ms": trace.admission_wait_ms, "omnistage.first_output_ms": trace.first_output_ms,
        "omnistage.media_decode_ms": trace.media_decode_ms})
    from opentelemetry import trace as otel_trace

    ctx = otel_trace.set_span_in_context(root)
    for st in trace.stages:
        s_start = start_ns + int(trace.admission_wait_ms * 1e6)
        span = _tracer.start_span(f"omnistage.stage.{st.stage}", context=ctx, start_time=s_start, attributes={
            "omnistage.stage": st.stage, "omnistage.replica": st.replica, "omnistage.queue_ms": st.queue_ms,
            "omnistage.compute_ms": st.compute_ms, "omnistage.transfer_ms": st.transfer_ms,
            "omnistage.transfer_path": st.transfer_path,
            "omnistage.encode_ms": st.encode_ms,
            "omnistage.first_chunk_ms": st.first_chunk_ms, "omnistage.contract.chunks": st.chunks,
            "omnistage.attempts": st.attempts, "omnistage.units": st.units, "omnistage.unit": st.unit})
        span.end(end_time=s_start + int(st.total_ms * 1e6))
    root.end(end_time=end_ns)
