"""OpenTelemetry traces, for the orchestrator and the stages alike: the tracer (set up from the standard
`OTEL_*` variables, or with a given exporter), and the W3C trace context (`traceparent`, `tracestate`) as it
comes in on a request and goes out on the calls made for it.

Off unless set up: with no OTLP endpoint in the environment and no exporter given, `tracer()` is None, no
span is made, and the OpenTelemetry packages (the `otel` extra) are not even imported. The trace context
still passes through then, unchanged but checked, so a stage that traces links its spans to the client's.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Iterable, Mapping

log = logging.getLogger("omnistage.tracing")

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
TRACE_KEYS = (TRACEPARENT, TRACESTATE)
# W3C Trace Context, version 00: version-traceid-parentid-flags, lower-case hex. A later version may append
# fields after another dash; the first four are read as these.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?")
# The W3C limit on a tracestate a vendor must propagate (32 members of up to 256 bytes is the upper bound; 512
# is what every implementation keeps): anything longer is dropped rather than carried to every stage.
MAX_TRACESTATE = 512
# A tracestate member as W3C writes it (key=value; the value printable ASCII without "," or "="): anything else
# (control characters, bytes above 0x7f) would fail as gRPC metadata on the stage calls it is carried to.
_VALUE_CHAR = r"\x21-\x2b\x2d-\x3c\x3e-\x7e"   # printable ASCII but space, "," and "="
_TRACESTATE_MEMBER = re.compile(rf"[a-z0-9][a-z0-9_\-*/@]{{0,255}}=[ {_VALUE_CHAR}]{{0,255}}[{_VALUE_CHAR}]")
MAX_TRACESTATE_MEMBERS = 32
# The variables that turn export on (the traces-only one wins, as in the SDK).
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
DEFAULT_PROTOCOL = "http/protobuf"  # the OpenTelemetry specification's default for OTLP exporters

Carrier = Mapping[str, str]
_tracer: Any = None
_provider: Any = None


def trace_context(pairs: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """The W3C trace context among a request's headers or gRPC metadata (pure): `traceparent` when it is well
    formed (as version 00), and `tracestate` with it when its members are well formed and within MAX_TRACESTATE;
    {} otherwise (the request starts a trace)."""
    found = {}
    for key, value in pairs:
        key = key.lower()
        if key in TRACE_KEYS and isinstance(value, str):
            found[key] = value.strip()
    parent = found.get(TRACEPARENT, "")
    if not _TRACEPARENT.fullmatch(parent) or parent.startswith("ff") or (parent.startswith("00") and len(parent) > 55) \
            or parent[3:35] == "0" * 32 or parent[36:52] == "0" * 16:
        return {}
    # carried on as version 00 (a later version's first four fields are version 00's): nothing the client
    # appended reaches the stages
    out = {TRACEPARENT: "00" + parent[2:55]}
    state = found.get(TRACESTATE)
    if state and len(state) <= MAX_TRACESTATE:
        members = [m.strip() for m in state.split(",") if m.strip()]
        if len(members) <= MAX_TRACESTATE_MEMBERS and all(_TRACESTATE_MEMBER.fullmatch(m) for m in members):
            out[TRACESTATE] = ",".join(members)
    return out


def configure(exporter, service_name: str) -> bool:
    """Export spans to `exporter` as each ends (tests, benchmarks); False when the SDK is not installed."""
    try:
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    except ImportError:
        log.warning("OpenTelemetry SDK not installed (the `otel` extra): no spans are made")
        return False
    return _install(SimpleSpanProcessor(exporter), service_name)


def configure_from_env(service_name: str, env: Mapping[str, str] = os.environ) -> bool:
    """Export over OTLP when the environment names an endpoint (OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT), with
    the protocol OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL names (http/protobuf or grpc); the exporter, the batch
    processor (OTEL_BSP_*), the sampler (OTEL_TRACES_SAMPLER[_ARG]) and the resource (OTEL_SERVICE_NAME,
    OTEL_RESOURCE_ATTRIBUTES) read the rest of the standard variables themselves. `service_name` is the
    service's name when OTEL_SERVICE_NAME leaves it out. False (tracing off) when no endpoint is set,
    OTEL_SDK_DISABLED is true or OTEL_TRACES_EXPORTER is none."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or \
            env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    if not any(env.get(v) for v in ENDPOINT_VARS):
        return False
    protocol = next((env[v] for v in PROTOCOL_VARS if env.get(v)), DEFAULT_PROTOCOL).strip().lower()
    try:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        else:
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not one of http/protobuf, grpc")
    except ImportError as e:
        log.warning("an OTLP endpoint is set but %s is not installed (the `otel` extra): no spans are made", e.name)
        return False
    return _install(BatchSpanProcessor(OTLPSpanExporter()), service_name if not env.get("OTEL_SERVICE_NAME") else "")


def _install(processor, service_name: str) -> bool:
    global _tracer, _provider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    shutdown()
    # TracerProvider reads OTEL_TRACES_SAMPLER; Resource.create reads OTEL_SERVICE_NAME and
    # OTEL_RESOURCE_ATTRIBUTES, which a name given here would override: it is given only when they leave it out.
    provider = TracerProvider(resource=Resource.create({"service.name": service_name} if service_name else {}))
    provider.add_span_processor(processor)
    _provider, _tracer = provider, provider.get_tracer("omnistage")
    return True


def shutdown() -> None:
    """Export what is still batched and stop tracing (a process exiting does this by itself)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def tracer():
    """The tracer; None when tracing is off."""
    return _tracer


def parent_context(carrier: Carrier | None):
    """The OpenTelemetry context `carrier` (a checked trace context) continues; None starts a trace."""
    if not carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def carried(span, incoming: Carrier | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata for the calls made within `span`: its context; with no span (tracing off), the trace
    context the request came with, as it came."""
    if span is None:
        return tuple((incoming or {}).items())
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    out: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(out, context=set_span_in_context(span))
    return tuple(out.items())
