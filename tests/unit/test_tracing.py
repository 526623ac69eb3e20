"""The W3C trace context as the doors read it, and tracing set up from the standard OTEL_* variables."""

from __future__ import annotations

import pytest

from omnistage import tracing
from orchestrator_service import otel

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("pairs, expected", [
    ([("traceparent", PARENT)], {"traceparent": PARENT}),
    ([("Traceparent", f" {PARENT} "), ("tracestate", "a=1,b=2")], {"traceparent": PARENT, "tracestate": "a=1,b=2"}),
    ([("tracestate", "a=1")], {}),                                      # a state alone continues nothing
    ([("traceparent", "00-not-a-trace-01")], {}),                       # malformed: a new trace
    ([("traceparent", PARENT.upper())], {}),                            # hex is lower-case
    ([("traceparent", "ff" + PARENT[2:])], {}),                         # version ff is invalid
    ([("traceparent", f"00-{'0' * 32}-00f067aa0ba902b7-01")], {}),      # the all-zero trace id
    ([("traceparent", f"00-4bf92f3577b34da6a3ce929d0e0e4736-{'0' * 16}-01")], {}),  # the all-zero parent
    ([("traceparent", PARENT + "-more")], {}),                          # version 00 has exactly four fields
    # a later version may append fields: read, and carried on, as version 00 (what it appended stays here)
    ([("traceparent", "01" + PARENT[2:] + "-more" * 5000)], {"traceparent": PARENT}),
    # a tracestate gRPC metadata cannot carry, or one beyond W3C's 32 members: dropped, the trace kept
    ([("traceparent", PARENT), ("tracestate", "a=b\tc")], {"traceparent": PARENT}),
    ([("traceparent", PARENT), ("tracestate", "a=\u00e9")], {"traceparent": PARENT}),
    ([("traceparent", PARENT), ("tracestate", ",".join(f"k{i}=v" for i in range(33)))], {"traceparent": PARENT}),
    ([("traceparent", PARENT), ("tracestate", "congo=t61rcWkgMzE, rojo@x=00f067aa0ba902b7")],
     {"traceparent": PARENT, "tracestate": "congo=t61rcWkgMzE,rojo@x=00f067aa0ba902b7"}),
    ([("traceparent", PARENT), ("tracestate", "x" * (tracing.MAX_TRACESTATE + 1))], {"traceparent": PARENT}),
    ([("traceparent", b"bytes")], {}),                                  # binary metadata is not a trace context
    ([("authorization", "Bearer k")], {}),
])
def test_the_trace_context_a_request_came_with(pairs, expected):
    assert tracing.trace_context(pairs) == expected


@pytest.mark.parametrize("env", [
    {},
    {"OTEL_SERVICE_NAME": "x"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_EXPORTER": "none"},
])
def test_without_an_endpoint_tracing_stays_off(env):
    assert not tracing.configure_from_env("omnistage-test", env)
    assert tracing.tracer() is None
    # off, a request makes no span and passes the client's trace context to the stages as it came
    span = otel.RequestSpan(otel.Incoming.of("grpc", [("traceparent", PARENT)]), "p", "rid", "", 8)
    assert span.span is None and span.metadata == (("traceparent", PARENT),)
    span.end("finished")
    assert otel.RequestSpan(None, "p", "rid", "", 8).metadata == ()


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc", ""])
def test_an_endpoint_turns_export_on_with_the_protocol_named(protocol):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
    try:
        assert tracing.configure_from_env("omnistage-test", env)
        assert tracing.tracer() is not None
        span = otel.RequestSpan(otel.Incoming.of("http", [("traceparent", PARENT)]), "p", "rid", "", 8)
        # on, the stages get the request's own span as their parent, in the client's trace
        (key, value), = span.metadata
        assert key == "traceparent" and value.split("-")[1] == PARENT.split("-")[1]
        assert value.split("-")[2] == f"{span.span.get_span_context().span_id:016x}"
    finally:
        tracing.shutdown()  # nothing was ended: nothing is sent
    assert tracing.tracer() is None


def test_an_unknown_protocol_is_named():
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json'"):
        tracing.configure_from_env("omnistage-test", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
                                                      "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
