"""Clients that never read, or read a trickle, must not pin what others need: a stage parks a request whose
reader stopped (its batch slot goes to the next request) and resumes it unchanged; each front door ends a
request whose client reads slower than the consumer pace (consumer_pace.py) and frees its admission slot;
one client holds at most its share of the orchestrator's places (client_cap.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading

import grpc
import httpx
import pytest

from omnistage.contract.request import build_request
from omnistage.v1 import orchestrator_pb2_grpc
from orchestrator_service import client_cap, consumer_pace
from orchestrator_service.http_api import responses
from orchestrator_service.server import OrchestratorServer
from stage_service.runtime.base import StageInputs
from stage_service.servicer import request_from_proto

from ..harness import call_stage, example, header, start_stage, token_ids
from ..polling import wait_until
from .test_stage_support import scheduler

OMNI = example("qwen3-omni-tiny")
MAX_BATCH = 2
LM = example("llm-tiny", lambda d: (d["spec"]["topology"]["stages"][0].update(engine="transformers"),
                                    scheduler("llm", max_batch=MAX_BATCH, max_queued=8)(d)))
# A long answer with audio: far more bytes than a connection's buffers hold.
LONG = dict(max_tokens=256, ignore_eos=True, max_codec_frames=2000)
# A gRPC client that never grows its receive window beyond HTTP/2's initial 64 KiB (as one that never reads
# can choose): the server's writes wait after tens of KB rather than megabytes.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0)]


# ------------------------------------------------------------------------ the stage

def lm_tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.tensors["token_ids"].tolist()]


async def test_a_stage_gives_the_batch_slots_of_unread_requests_to_others_and_resumes_them_unchanged(model_dir):
    srv = await start_stage(LM, "llm", model_dir)
    try:
        limits = srv.servicer.pipeline.limits

        def unread_header(i: int):
            return header(f"unread{i}", prompt=f"never read {i}", max_tokens=60, ignore_eos=True, seed=i,
                          temperature=0.9).header

        async def alone(i: int) -> list[int]:
            gen = srv.engine.generate(request_from_proto(unread_header(i), limits), StageInputs(()))
            async with contextlib.aclosing(gen):
                return lm_tokens([c async for c in gen])

        expected = [await alone(i) for i in range(MAX_BATCH)]
        probe = header("probe", prompt="The probe", max_tokens=20, ignore_eos=True, temperature=0.9, seed=5)
        probe_alone = token_ids(await call_stage(srv.port, probe))
        async with contextlib.AsyncExitStack() as stack:
            # maxBatch requests whose readers take the first chunk and then nothing
            unread = [await stack.enter_async_context(contextlib.aclosing(
                srv.engine.generate(request_from_proto(unread_header(i), limits), StageInputs(()))))
                for i in range(MAX_BATCH)]
            firsts = [await gen.__anext__() for gen in unread]
            probe_joined = token_ids(await call_stage(srv.port, probe, timeout=120))
            assert probe_joined == probe_alone
            # parked for the probe, which waited for a slot (all that stalled by then: one at least)
            assert 1 <= srv.engine.scheduler.parked <= MAX_BATCH
            for i, (gen, first) in enumerate(zip(unread, firsts)):
                assert lm_tokens([first] + [c async for c in gen]) == expected[i]
        assert srv.engine.scheduler.unfinished() == 0 and srv.engine.scheduler.held_bytes() == 0
    finally:
        await srv.drain()


# ------------------------------------------------------------------------ the doors

class Served:
    def __init__(self, orc: OrchestratorServer):
        self.orc = orc

    def cancelled(self) -> float:
        return self.orc.metrics.requests.labels("cancelled")._value.get()

    async def until_nothing_held(self) -> None:
        s = self.orc.servicer
        await wait_until(lambda: not s.runs and s.admission.inflight == 0 and not s.client_cap.held, 60,
                         what="the orchestrator holding nothing",
                         detail=lambda: (len(s.runs), s.admission.inflight, s.client_cap.held))


@pytest.fixture(scope="module")
async def omni(model_dir):
    stages = {n: await start_stage(OMNI, n, model_dir) for n in ("thinker", "talker", "code2wav")}
    orc = OrchestratorServer(OMNI, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()}, api_port=0)
    await orc.start(wait_for_stages=30)
    yield Served(orc)
    await orc.drain()
    for s in stages.values():
        await s.drain()


async def test_a_grpc_client_that_never_reads_is_cut_and_its_admission_slot_freed(omni, monkeypatch):
    monkeypatch.setattr(consumer_pace, "GRACE_S", 0.5)
    cancelled = omni.cancelled()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{omni.orc.port}", options=SMALL_WINDOW) as ch:
        call = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(build_request("a long answer", **LONG))
        await wait_until(lambda: omni.cancelled() == cancelled + 1, 120, what="the unread request cancelled",
                         detail=lambda: len(omni.orc.servicer.runs))
        await omni.until_nothing_held()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the client read" in e.value.details() and "bytes/s" in e.value.details()


def trickle(port: int, body: bytes, stop: threading.Event, got: list[int]) -> None:
    """A client that takes 2 KB of its answer every 2 s (1 KB/s): each send waits at most about 2 s."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        sock.settimeout(0.05)
        while not stop.wait(2.0):
            burst = 0
            with contextlib.suppress(TimeoutError):
                while burst < 2048:
                    data = sock.recv(2048 - burst)
                    if not data:
                        return
                    burst += len(data)
            got[0] += burst


async def test_an_http_client_reading_a_trickle_is_cut(omni, monkeypatch):
    """A text answer is small events, and the reader takes 2 KB every 2 s, so each send completes well
    within the grace: a bound on a single send never ends the request (it runs to its end at the reader's
    pace). The pace does: the client earns far less waiting than its sends take."""
    monkeypatch.setattr(responses, "SEND_STALL_S", 8.0)
    monkeypatch.setattr(consumer_pace, "MIN_READ_BPS", 1024 * 1024)
    cancelled = omni.cancelled()
    body = json.dumps({"model": OMNI.name, "messages": [{"role": "user", "content": "a long answer"}],
                       "stream": True, "max_tokens": 512, "ignore_eos": True, "modalities": ["text"]}).encode()
    stop, got = threading.Event(), [0]
    reader = asyncio.create_task(asyncio.to_thread(trickle, omni.orc.api_port, body, stop, got))
    try:
        # the server's side of the connection with small buffers (loopback's own, and uvicorn's 64 KiB before
        # a send waits, would hold whole answers)
        connections = omni.orc.api._server.server_state.connections
        served = await wait_until(lambda: list(connections), what="the connection accepted")
        served[0].transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        served[0].transport.set_write_buffer_limits(high=4096)
        await wait_until(lambda: omni.cancelled() == cancelled + 1, 120, what="the trickle reader cut",
                         detail=lambda: got[0])
        await omni.until_nothing_held()
        assert got[0] > 0  # it was reading, only too slowly
    finally:
        stop.set()
        await reader


async def test_one_client_holds_at_most_its_cap(omni, monkeypatch):
    monkeypatch.setattr(client_cap, "CAP_LOOPBACK", True)
    monkeypatch.setattr(omni.orc.servicer.client_cap, "limit", 1)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{omni.orc.port}") as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        first = stub.Generate(build_request("a long answer", **LONG))
        await first.__aiter__().__anext__()  # admitted and streaming
        second = stub.Generate(build_request("one more", max_tokens=2))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in second:
                pass
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "address 127.0.0.1 already has 1 requests in flight, the most one client may have" in e.value.details()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{omni.orc.api_port}", timeout=60) as http:
            r = await http.post("/v1/chat/completions", json={"model": OMNI.name, "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429
        err = r.json()["error"]
        assert "the most one client may have" in err["message"] and set(err) >= {"message", "type", "param", "code"}
        first.cancel()
    await omni.until_nothing_held()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{omni.orc.port}") as ch:  # its place is free again
        events = [ev async for ev in orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(
            build_request("again", max_tokens=2))]
    assert events[-1].HasField("final")
