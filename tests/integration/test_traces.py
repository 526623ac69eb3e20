"""Traces over a real orchestrator and real stage services (in-process, port 0) for Qwen3-Omni tiny, with
the SDK's in-memory exporter: one request is one trace, a root span at the orchestrator and queue, compute
and transfer spans at each stage, children of the root through the trace context sent with each stage call;
a client's `traceparent` (gRPC metadata, HTTP header) is the trace the request joins."""

from __future__ import annotations

import asyncio
import http.client
import json

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from omnistage import tracing
from omnistage.client import AsyncOmniClient
from omnistage.contract.request import build_request
from omnistage.v1 import stage_pb2_grpc
from orchestrator_service.server import OrchestratorServer

from ..harness import example, header, start_stage
from ..polling import wait_until

PIPELINE = example("qwen3-omni-tiny")
STAGES = ("thinker", "talker", "code2wav")
STAGE_SPANS = ("omnistage.stage.queue", "omnistage.stage.compute", "omnistage.stage.transfer")
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"  # the W3C specification's example ids
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture(scope="module")
async def traced(model_dir):
    exporter = InMemorySpanExporter()
    assert tracing.configure(exporter, "omnistage-test")
    stages = {n: await start_stage(PIPELINE, n, model_dir) for n in STAGES}
    orc = OrchestratorServer(PIPELINE, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()}, api_port=0)
    await orc.start(wait_for_stages=30)
    client = AsyncOmniClient(f"127.0.0.1:{orc.port}")
    try:
        yield client, orc, exporter
    finally:
        await client.close()
        await orc.drain()
        for s in stages.values():
            await s.drain()
        tracing.shutdown()


async def spans_of(exporter: InMemorySpanExporter, request_id: str) -> list:
    """The spans of the request `request_id` once all 1 + stages x 3 have ended (stages end theirs as the
    stream closes, which may be just after the client has its answer)."""
    def ended():
        roots = [s for s in exporter.get_finished_spans()
                 if s.name == "omnistage.request" and s.attributes["omnistage.request_id"] == request_id]
        if not roots:
            return None
        trace_id = roots[0].context.trace_id
        mine = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        return mine if len(mine) >= 1 + 3 * len(STAGES) else None

    return await wait_until(ended, 60, 0.02, what="the request's spans",
                            detail=lambda: [s.name for s in exporter.get_finished_spans()])


def check_tree(spans: list, request_id: str):
    """One root, and queue, compute, transfer at each stage, children of it; returns the root."""
    assert len({s.context.trace_id for s in spans}) == 1
    roots = [s for s in spans if s.name == "omnistage.request"]
    assert len(roots) == 1 and len(spans) == 1 + 3 * len(STAGES), [s.name for s in spans]
    root = roots[0]
    assert root.attributes["omnistage.request_id"] == request_id
    assert root.attributes["omnistage.pipeline"] == PIPELINE.name == root.attributes["gen_ai.request.model"]
    assert root.attributes["omnistage.outcome"] == "finished"
    by_stage = {(s.attributes["omnistage.stage"], s.name) for s in spans if s is not root}
    assert by_stage == {(st, name) for st in STAGES for name in STAGE_SPANS}
    for s in spans:
        if s is not root:
            assert s.parent is not None and s.parent.span_id == root.context.span_id, s.name
            assert s.attributes["omnistage.request_id"] == request_id
            assert root.start_time <= s.start_time <= s.end_time
    for st in STAGES:  # queue, then compute: one after the other
        mine = {s.name: s for s in spans if s.attributes.get("omnistage.stage") == st}
        assert mine["omnistage.stage.queue"].end_time <= mine["omnistage.stage.compute"].start_time
        assert mine["omnistage.stage.compute"].attributes["omnistage.chunks"] >= 1
        assert mine["omnistage.stage.transfer"].attributes["omnistage.chunks"] >= 1
    return root


async def test_one_request_is_one_trace_with_queue_compute_transfer_per_stage(traced):
    client, orc, exporter = traced
    exporter.clear()
    r = await client.generate("Hello", max_tokens=4, ignore_eos=True, max_codec_frames=10, timeout=120)
    root = check_tree(await spans_of(exporter, r.request_id), r.request_id)
    assert root.parent is None  # no trace context came: the orchestrator started the trace
    assert root.attributes["omnistage.door"] == "grpc"
    assert root.attributes["gen_ai.request.max_tokens"] == 4
    assert root.attributes["gen_ai.usage.output_tokens"] == len(r.token_ids) == 4
    assert root.attributes["gen_ai.usage.input_tokens"] == r.final.usage.prompt_tokens > 0


async def test_a_traceparent_in_grpc_metadata_is_the_trace_joined(traced):
    client, orc, exporter = traced
    exporter.clear()
    call = client.stub.Generate(build_request("Hello", max_tokens=3, max_codec_frames=10), timeout=120,
                                metadata=(("traceparent", TRACEPARENT), ("tracestate", "vendor=x")))
    events = [ev async for ev in call]
    rid = events[-1].request_id
    spans = await spans_of(exporter, rid)
    root = check_tree(spans, rid)
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE
    assert root.parent is not None and f"{root.parent.span_id:016x}" == CLIENT_SPAN and root.parent.is_remote
    assert root.context.trace_state.get("vendor") == "x"


async def test_a_traceparent_header_on_the_http_api_is_the_trace_joined(traced):
    client, orc, exporter = traced
    exporter.clear()

    def post() -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", orc.api_port, timeout=120)
        body = {"model": PIPELINE.name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3,
                "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json", "traceparent": TRACEPARENT})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return json.loads(resp.read())

    answer = await asyncio.to_thread(post)
    roots = await wait_until(lambda: [s for s in exporter.get_finished_spans() if s.name == "omnistage.request"],
                             60, 0.02, what="the root span")
    rid = roots[0].attributes["omnistage.request_id"]
    assert rid in answer["id"]
    root = check_tree(await spans_of(exporter, rid), rid)
    assert root.attributes["omnistage.door"] == "http"
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE and f"{root.parent.span_id:016x}" == CLIENT_SPAN


async def test_a_malformed_traceparent_starts_a_new_trace(traced):
    client, orc, exporter = traced
    exporter.clear()
    call = client.stub.Generate(build_request("Hello", max_tokens=2, max_codec_frames=10), timeout=120,
                                metadata=(("traceparent", "00-not-a-trace-01"),))
    events = [ev async for ev in call]
    root = check_tree(await spans_of(exporter, events[-1].request_id), events[-1].request_id)
    assert root.parent is None


async def test_a_stage_call_refused_ends_its_queue_span_as_an_error(traced):
    client, orc, exporter = traced
    exporter.clear()
    address = next(iter(orc.router.pools["thinker"].replicas))
    async with grpc.aio.insecure_channel(address) as channel:
        call = stage_pb2_grpc.StageServiceStub(channel).Process(
            iter([header("refused-1", max_tokens=10**9)]), timeout=60, metadata=(("traceparent", TRACEPARENT),))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [out async for out in call]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = await wait_until(lambda: exporter.get_finished_spans(), 60, 0.02, what="the call's span")
    (queue,) = spans  # it never reached the engine: no compute, nothing handed on
    assert queue.name == "omnistage.stage.queue" and queue.attributes["omnistage.request_id"] == "refused-1"
    assert f"{queue.context.trace_id:032x}" == CLIENT_TRACE and f"{queue.parent.span_id:016x}" == CLIENT_SPAN
    assert queue.status.status_code == StatusCode.ERROR
