"""Traces across processes: each stage a real process (`python -m stage_service`) and the orchestrator,
all set up only by the standard OTEL_* variables, export over OTLP/HTTP to a receiver this test runs
(a real HTTP server on 127.0.0.1 decoding ExportTraceServiceRequest). One request is one trace: the
orchestrator's root span and, from each stage's own process, its queue, compute and transfer spans under it."""

from __future__ import annotations

import asyncio
import http.server
import threading

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from omnistage import tracing
from omnistage.client import AsyncOmniClient
from orchestrator_service import otel
from orchestrator_service.server import OrchestratorServer
from stage_service.tracing import SERVICE_PREFIX

from ..harness import StageProcess, example, write_pipeline
from ..polling import wait_until

PIPELINE = example("qwen3-omni-tiny")
STAGES = ("thinker", "talker", "code2wav")


class OtlpReceiver:
    """An OTLP/HTTP trace receiver: every span it is sent, as (service, name, trace id, span id, parent id,
    attributes)."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    for rs in request.resource_spans:
                        resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                receiver.spans.append({
                                    "service": resource.get("service.name"), "name": s.name,
                                    "trace": s.trace_id.hex(), "span": s.span_id.hex(),
                                    "parent": s.parent_span_id.hex(),
                                    "attributes": {a.key: a.value for a in s.attributes}})
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def of_trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


async def test_one_request_is_one_trace_across_the_stage_processes(receiver, model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: the batch goes out soon after each span ends
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    path = write_pipeline(PIPELINE, tmp_path / "pipeline.yaml")
    procs = {s: StageProcess(path, s, model_dir, tmp_path) for s in STAGES}  # they inherit the environment
    orc = None
    try:
        for p in procs.values():
            await asyncio.to_thread(p.wait_ready, 180)
        assert otel.configure_from_env()  # as `omnistage orchestrator` does at start
        orc = OrchestratorServer(PIPELINE, {s: [p.address] for s, p in procs.items()})
        await orc.start(wait_for_stages=30)
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            r = await client.generate("Hello", max_tokens=3, max_codec_frames=10, timeout=120)
        roots = await wait_until(lambda: [s for s in receiver.spans if s["name"] == otel.ROOT_SPAN and
                                          s["attributes"]["omnistage.request_id"].string_value == r.request_id],
                                 60, 0.05, what="the request's root span")
        root = roots[0]
        spans = await wait_until(lambda: (lambda got: got if len(got) >= 1 + 3 * len(STAGES) else None)(
            receiver.of_trace(root["trace"])), 60, 0.05, what="the stages' spans",
            detail=lambda: [(s["service"], s["name"]) for s in receiver.spans])
    finally:
        if orc is not None:
            await orc.drain()
        tracing.shutdown()
        for p in procs.values():
            p.stop()
    assert len(spans) == 1 + 3 * len(STAGES) and root["service"] == otel.SERVICE_NAME and root["parent"] == ""
    stage_spans = {(s["service"], s["name"]) for s in spans if s is not root}
    assert stage_spans == {(SERVICE_PREFIX + st, f"omnistage.stage.{kind}") for st in STAGES
                           for kind in ("queue", "compute", "transfer")}
    assert all(s["parent"] == root["span"] for s in spans if s is not root)
    assert len({s["trace"] for s in receiver.spans}) == 1  # nothing else was traced: one request, one trace
