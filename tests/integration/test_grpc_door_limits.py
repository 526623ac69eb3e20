"""The orchestrator's gRPC front door under hostile traffic, on real grpc.aio servers: a call without a key is
refused before its message is read (no handler runs, the message is never parsed, and large keyless messages
leave the process's memory flat), calls past the concurrency cap are refused RESOURCE_EXHAUSTED, and the
bytes that admitted requests hold are budgeted; callers with a key are served as before."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from omnistage import serving
from omnistage.client import build_request
from omnistage.contract import launch
from omnistage.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator_service.server import (
    CLIENT_STREAM_WINDOW_BYTES,
    MAX_STREAMS_PER_CONNECTION,
    RPC_SLACK,
    OrchestratorServer,
)

from ..harness import EXAMPLES, small_lm, start_stage

GENERATE = "/omnistage.v1.Orchestrator/Generate"
KEYS = ["door-key", "ops-key:7"]
WITH_KEY = (("authorization", "Bearer door-key"),)
LM_LIMITS, LM_ORCHESTRATOR = {"defaultMaxTokens": 2, "maxTokens": 8}, {"maxPriority": 2, "maxInflight": 1,
                                                                       "maxQueued": 1}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
async def keyed(model_dir):
    pipeline = small_lm(LM_LIMITS, LM_ORCHESTRATOR)
    stage = await start_stage(pipeline, "llm", model_dir)
    orc = OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]}, api_keys=KEYS)
    try:
        await orc.start(wait_for_stages=60)
        yield orc
    finally:
        await orc.drain()
        orc.close()
        await stage.drain()
        stage.close()


def rejected(orc: OrchestratorServer, outcome: str = "rejected") -> float:
    return orc.metrics.requests.labels(outcome)._value.get()


async def generate(port: int, request, metadata=()) -> list:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        return [ev async for ev in stub.Generate(request, metadata=metadata, timeout=60)]


async def raw_generate(port: int, body: bytes, metadata=()) -> grpc.StatusCode:
    """A Generate call carrying `body` as it is (no serializer), as a hostile client can send it."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]) as ch:
        try:
            async for _ in ch.unary_stream(GENERATE)(body, metadata=metadata, timeout=120):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def test_a_call_without_a_key_is_refused_before_its_message_is_read(keyed):
    before, full = rejected(keyed, "unauthenticated"), rejected(keyed)
    # Not a GenerateRequest at all: had the message been read, parsing it would have failed first (INTERNAL).
    assert await raw_generate(keyed.port, b"\xff" * 64) == grpc.StatusCode.UNAUTHENTICATED
    assert await raw_generate(keyed.port, b"\xff" * 64, (("authorization", "Bearer nope"),)) == \
        grpc.StatusCode.UNAUTHENTICATED
    # counted once each, as the handler counts its refusals; a key is not a full queue (the saturation alert)
    assert rejected(keyed, "unauthenticated") == before + 2 and rejected(keyed) == full
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(keyed.port, build_request("hi"))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "missing API key" in e.value.details()
    assert keyed.door.budget.held == 0  # nothing was admitted to the budget either


async def test_a_key_is_still_served_and_its_priority_checked(keyed):
    events = await generate(keyed.port, build_request("hi", max_tokens=2), WITH_KEY)
    assert events[-1].HasField("final")
    events = await generate(keyed.port, build_request("hi", max_tokens=2, priority=7),
                            (("authorization", "Bearer ops-key"),))
    assert events[-1].HasField("final")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(keyed.port, build_request("hi", priority=7), WITH_KEY)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "priority 7 is above 2" in e.value.details()
    assert keyed.door.budget.held == 0  # given back when each request ended


async def test_the_byte_budget_refuses_when_full_and_frees_when_requests_end(keyed):
    budget = keyed.door.budget
    request = build_request("hi", max_tokens=2)
    capacity = budget.capacity
    budget.capacity = 4 * request.ByteSize()
    try:
        before = rejected(keyed)
        with budget.holding() as take:  # requests already held fill the budget but for less than one request
            take(budget.capacity - request.ByteSize() + 1)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{keyed.port}") as ch:
                call = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(request, metadata=WITH_KEY, timeout=60)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    [ev async for ev in call]
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in e.value.details()
            assert dict(e.value.trailing_metadata())["retry-after"] == "1.0"
            assert rejected(keyed) == before + 1
        assert budget.held == 0
        assert (await generate(keyed.port, request, WITH_KEY))[-1].HasField("final")  # room again: served
        assert budget.held == 0
    finally:
        budget.capacity = capacity


async def test_reflection_needs_a_key_and_health_does_not(keyed):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{keyed.port}") as ch:
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [r async for r in stub.ServerReflectionInfo(iter([ask]), timeout=30)]
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answers = [r async for r in stub.ServerReflectionInfo(iter([ask]), metadata=WITH_KEY, timeout=30)]
        assert "omnistage.v1.Orchestrator" in {s.name for s in answers[0].list_services_response.service}


async def test_calls_past_the_concurrency_cap_are_refused():
    """maxInflight + maxQueued + RPC_SLACK calls open at once (health watches here, which stay open); one more
    is refused RESOURCE_EXHAUSTED, and taken again once some have closed. No stage is needed for that."""
    pipeline = small_lm(LM_LIMITS, LM_ORCHESTRATOR)
    orc = OrchestratorServer(pipeline, {"llm": ["127.0.0.1:9"]})
    await orc.start()
    cap = 1 + 1 + RPC_SLACK
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=120) for _ in range(cap)]
            for w in watches:  # each has its first answer: open on the server
                assert (await w.read()).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for w in watches[:2]:
                w.cancel()
            deadline = time.monotonic() + 60  # a safety bound: the server sees the cancels soon after
            while True:
                try:
                    await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                    break
                except grpc.aio.AioRpcError as again:
                    assert again.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                    await asyncio.sleep(0.05)
            for w in watches[2:]:
                w.cancel()
    finally:
        await orc.drain()
        orc.close()


def test_the_client_port_bounds_calls_per_connection_and_each_call_s_window():
    options = dict(serving.grpc_server_options(1 << 20, 1 << 20, 60, MAX_STREAMS_PER_CONNECTION,
                                               CLIENT_STREAM_WINDOW_BYTES))
    assert options["grpc.max_concurrent_streams"] == MAX_STREAMS_PER_CONNECTION
    assert options["grpc.http2.bdp_probe"] == 0  # a fixed window: the peer's sending speed cannot grow it
    assert options["grpc.http2.lookahead_bytes"] == CLIENT_STREAM_WINDOW_BYTES
    assert "grpc.max_concurrent_streams" not in dict(serving.grpc_server_options(1 << 20, 1 << 20, 60))


def _peak_rss_growth(pid: int, burst) -> int:
    """Growth of process `pid`'s peak RSS over its RSS before `burst()` (Linux: clear_refs 5 resets the peak)."""
    def status(field: str) -> int:
        return next(int(line.split()[1]) << 10 for line in open(f"/proc/{pid}/status") if line.startswith(field))
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    burst()
    return status("VmHWM:") - before


def test_large_keyless_messages_leave_the_process_memory_flat(tmp_path):
    """Keyless 120 MiB requests, under the receive limit (the defaults': 257 MiB), 4 at once on their own
    connections, to an orchestrator process with a key configured (through the environment): its peak RSS grows
    by far less than one of them."""
    doc = yaml.safe_load((EXAMPLES / "llm-tiny.yaml").read_text())
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    doc["spec"]["topology"].pop("limits", None)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(doc))
    ready = tmp_path / "orc.ready"
    argv = launch.orchestrator_command(tmp_path / "p.yaml", python=sys.executable, port=0, ready_file=ready,
                                       log_level="WARNING", stage_endpoints={"llm": ["127.0.0.1:9"]})
    log = tmp_path / "orc.log"
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **launch.service_env(), launch.ENV_API_KEYS: "k"},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 120  # a safety bound on start-up
        while (ports := launch.read_ready(ready)) is None:
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.05)
        body = orchestrator_pb2.GenerateRequest(params={"prompt": "x" * (120 << 20)}).SerializeToString()

        async def burst() -> list[grpc.StatusCode]:
            return list(await asyncio.gather(*(raw_generate(ports.grpc, body) for _ in range(4))))
        codes: list[grpc.StatusCode] = []
        growth = _peak_rss_growth(proc.pid, lambda: codes.extend(asyncio.run(burst())))
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
        assert growth < 32 << 20, f"peak RSS grew {growth >> 20} MiB"  # was 1 GiB: every message read whole
    finally:
        proc.terminate()
        proc.wait(30)
