"""Server-owned request ids, client labels, API keys on the gRPC front door and the priority ceiling, on a real
tiny LM stage behind a real orchestrator: the server assigns the id every stage keys on, the client's id is a
label (echoed, bounded, unique while in flight), and priority above the ceiling needs a key that allows it.
A draining orchestrator refuses new requests with a retry hint."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import pytest

from omnistage.client import AsyncOmniClient, build_request
from omnistage.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator_service.server import OrchestratorServer

from ..harness import small_lm, start_stage

KEYS = ["plain-key", "ops-key:7"]


LM_LIMITS, LM_ORCHESTRATOR = {"defaultMaxTokens": 4, "maxTokens": 64}, {"maxPriority": 2}


@pytest.fixture(scope="module")
async def rig(model_dir):
    pipeline = small_lm(LM_LIMITS, LM_ORCHESTRATOR)
    stage = await start_stage(pipeline, "llm", model_dir)
    open_orc = OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]}, api_port=0)
    keyed_orc = OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]}, api_keys=KEYS)
    try:
        await open_orc.start(wait_for_stages=60)
        await keyed_orc.start(wait_for_stages=60)
        yield open_orc, keyed_orc
    finally:
        for orc in (open_orc, keyed_orc):
            await orc.drain()
            orc.close()
        await stage.drain()
        stage.close()


async def collect(port: int, request, metadata=()) -> list:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return [ev async for ev in orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(request, metadata=metadata,
                                                                                        timeout=60)]


async def drained(call):
    """The last message of a call read with read() so far."""
    last = None
    while (ev := await call.read()) is not grpc.aio.EOF:
        last = ev
    return last


async def test_the_server_assigns_the_id_and_echoes_the_label(rig):
    orc, _ = rig
    events = await collect(orc.port, build_request("Hello", request_id="my-label/1"))
    ids = {ev.request_id for ev in events}
    assert len(ids) == 1 and len(ids.pop()) == 32  # one server id, not the client's
    assert all(ev.client_request_id == "my-label/1" for ev in events)
    assert events[-1].HasField("final")
    unlabeled = await collect(orc.port, build_request("Hello"))
    assert all(ev.client_request_id == "" for ev in unlabeled)
    assert unlabeled[0].request_id != events[0].request_id


async def test_a_label_in_flight_is_refused_then_free_again(rig):
    orc, _ = rig
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        first = stub.Generate(build_request("Tell me a long story", request_id="dup", max_tokens=64,
                                            ignore_eos=True), timeout=60)
        await first.read()  # it is in flight
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(orc.port, build_request("Hello", request_id="dup"))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "'dup'" in e.value.details()
        assert (await drained(first)).final.usage.completion_tokens == 64  # not disturbed
    again = await collect(orc.port, build_request("Hello", request_id="dup"))
    assert again[-1].HasField("final")


@pytest.mark.parametrize("label", ["has space", "x" * 129, "tab\there"])
async def test_bad_labels_are_refused_naming_request_id(rig, label):
    orc, _ = rig
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await collect(orc.port, build_request("Hello", request_id=label))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("request_id: ")


async def test_priority_above_the_ceiling_is_refused_without_a_key(rig):
    orc, _ = rig
    assert (await collect(orc.port, build_request("Hello", priority=2)))[-1].HasField("final")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await collect(orc.port, build_request("Hello", priority=3))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "priority 3 is above 2" in e.value.details()


@pytest.mark.parametrize("key,priority,code", [
    (None, 0, grpc.StatusCode.UNAUTHENTICATED),
    ("wrong", 0, grpc.StatusCode.UNAUTHENTICATED),
    ("plain-key", 0, None),
    ("plain-key", 3, grpc.StatusCode.PERMISSION_DENIED),
    ("ops-key", 7, None),
    ("ops-key", 8, grpc.StatusCode.PERMISSION_DENIED),
])
async def test_keys_on_the_grpc_front_door(rig, key, priority, code):
    _, orc = rig
    metadata = () if key is None else (("authorization", f"Bearer {key}"),)
    if code is None:
        assert (await collect(orc.port, build_request("Hello", priority=priority), metadata))[-1].HasField("final")
        return
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await collect(orc.port, build_request("Hello", priority=priority), metadata)
    assert e.value.code() == code
    assert key is None or key not in e.value.details()  # a key never appears in an answer


def post_chat(port: int, label: str, max_tokens: int) -> tuple[int, dict, dict]:
    body = json.dumps({"model": "llm-tiny", "messages": [{"role": "user", "content": "Hello"}],
                       "max_tokens": max_tokens, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, method="POST",
                                 headers={"Content-Type": "application/json", "X-Client-Request-Id": label})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


async def test_the_http_label_header_is_checked_the_same_way(rig):
    orc, _ = rig
    status, headers, body = await asyncio.to_thread(post_chat, orc.api_port, "http-label", 4)
    assert status == 200 and headers["x-request-id"] != "http-label" and body["id"].endswith(headers["x-request-id"])
    status, _, body = await asyncio.to_thread(post_chat, orc.api_port, "bad label", 4)
    assert status == 400 and body["error"]["param"] == "X-Client-Request-Id"
    # the same label twice at once: one of them is refused with 409
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as ch:
        held = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(
            build_request("Tell me a long story", request_id="busy", max_tokens=64, ignore_eos=True), timeout=60)
        await held.read()
        status, _, body = await asyncio.to_thread(post_chat, orc.api_port, "busy", 4)
        assert status == 409 and body["error"]["code"] == "duplicate_request_id"
        assert (await drained(held)).HasField("final")


async def test_a_draining_orchestrator_refuses_with_a_retry_hint(model_dir):
    pipeline = small_lm(LM_LIMITS, LM_ORCHESTRATOR)
    stage = await start_stage(pipeline, "llm", model_dir)
    orc = OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]})
    try:
        await orc.start(wait_for_stages=60)
        orc.servicer.draining = True  # what a drain does first; the port still answers meanwhile
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as ch:
            call = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(build_request("Hello"), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
            assert dict(await call.trailing_metadata())["retry-after"] == "1.0"
    finally:
        orc.servicer.draining = False
        await orc.drain()
        orc.close()
        await stage.drain()
        stage.close()


async def test_the_client_sends_its_key_and_reads_back_its_label(rig):
    _, orc = rig
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}", api_key="ops-key") as client:
        result = await client.generate("Hello", priority=7, request_id="from-the-sdk", timeout=60)
    assert result.client_request_id == "from-the-sdk" and len(result.request_id) == 32 and result.final is not None
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate("Hello", timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_describe_pipeline_needs_a_key_too(rig):
    _, orc = rig
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.DescribePipeline(orchestrator_pb2.DescribePipelineRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = await stub.DescribePipeline(orchestrator_pb2.DescribePipelineRequest(), timeout=10,
                                           metadata=(("authorization", "Bearer plain-key"),))
        assert info.name == "llm-tiny"
