"""Clients that never read, on the tiny Qwen3-Omni pipeline served in-process (three stage servers and an
orchestrator with both doors, on 127.0.0.1; every stage maxBatch 2): 4 x maxBatch streams whose clients read
nothing are opened on EACH door at once, and short probes (gRPC: text and 40 codec frames; HTTP: text only, as
its body has no codec-frame field) go through both doors in turn, one at a time. In one run:

- baseline: probes alone;
- beside readers: probes while the same 16 requests come from clients that read (the control);
- beside non-readers: probes while the non-readers' requests are being made (their legitimate work);
- held: probes once the stages have made (or parked) everything of theirs and the non-readers still hold
  their doors, their answers waiting in buffers. `non_reading.probe_latency_over_baseline` is the worse
  door's median here over its baseline, `...max_over_baseline` the worse door's slowest probe.

`during_work_over_readers` compares the probe's median beside the non-readers' work with that beside the same
work for readers: not reading must cost the others nothing more than reading does. `jobs_parked_at_stages`
is the most jobs parked at the stages at once (scheduler counters, read in-process).

Why no stage parks here, measured on this pipeline (256-token, 2000-frame answers, default transport): a
non-reader's whole answer fits the bounded buffers between the stages and its door, so each stage makes all
of it, as for a client that reads. The Thinker's 64 chunks (256 tokens) fit the Talker's input queue (64
chunks per edge, taken before the Talker admits the request); the Talker's 81 chunks of codes (2000 frames)
fit Code2Wav's input queue (64 chunks of 25 frames) and the HTTP/2 window of the orchestrator's Code2Wav stream;
Code2Wav decodes one-step states, which hold no batch slot while its output waits. Back-pressure would reach
the Talker's scheduler only after Code2Wav's 16 chunks taken and 64 queued (~2000 frames) plus the windows
and the Talker's own 16 pending results: more than the 2048 frames a request may ask. With 1-frame chunks
the stage streams' windows (grown by gRPC's bandwidth-delay probing to MiBs on loopback) took all 2000, and
with them fixed at 64 KiB the Talker parked its non-readers after ~870 frames each. So the non-readers here
ask 200 frames (16 s of audio, 768 KB of PCM, far more than a door's buffers hold): longer answers stall at
the stages no sooner and only make the run longer (16 answers of 2000 frames are ~160 s of Talker work).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import yaml
from common import figure

ROOT = Path(__file__).resolve().parent.parent
OMNI = ROOT / "examples" / "qwen3-omni-tiny.yaml"
MAX_BATCH = 2
NON_READERS = 4 * MAX_BATCH  # per door
# 200 frames: 16 s of audio, 768 KB of PCM in 9 chunks. A gRPC stream backs up to its door (the client's 64 KiB
# window takes the first 15-frame chunk); an HTTP one fits the door's 16 buffered events (http_api/call.py),
# so its request ends while the door holds its connection. Little enough that the stages' work for 16 of them
# fits the run twice (on 2 busy cores the Talker makes about 200 frames/s at maxBatch 2). Longer answers would
# not stall at the stages either (see the module's docstring): they only take longer.
LONG = dict(max_tokens=16, ignore_eos=True, max_codec_frames=200)
SETTLE_S = 60.0  # the most the run waits for the stages to finish (or park) the non-readers' work


def pipeline():
    from omnistage.api import parse_pipeline

    doc = yaml.safe_load(OMNI.read_text())
    # The HTTP body has no codec-frame field: HTTP non-readers get the long audio as the default.
    doc["spec"]["topology"]["limits"]["defaultCodecFrames"] = LONG["max_codec_frames"]
    for stage in doc["spec"]["deployment"]["stages"].values():
        stage["scheduler"] = {"maxBatch": MAX_BATCH, "maxQueued": 64}
    doc["spec"]["deployment"]["orchestrator"].update(maxInflight=64, maxQueued=64)
    return parse_pipeline(doc)


async def grpc_probe(orc, i: int) -> float:
    """Seconds of one short request with text and audio through the gRPC door."""
    from omnistage.client import AsyncOmniClient

    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        t0 = time.perf_counter()
        async for _ in client.stream(f"probe {i}", max_tokens=8, ignore_eos=True, max_codec_frames=40, timeout=300):
            pass
        return time.perf_counter() - t0


async def http_probe(orc, i: int) -> float:
    """Seconds of one short streamed text request through the HTTP door."""
    import httpx

    body = {"model": orc.pipeline.name, "messages": [{"role": "user", "content": f"probe {i}"}], "stream": True,
            "max_tokens": 8, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{orc.api_port}", timeout=300) as http:
        t0 = time.perf_counter()
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP probe answered {r.status_code}: {(await r.aread())[:200]!r}")
            async for _ in r.aiter_bytes():
                pass
        return time.perf_counter() - t0


async def probe(orc, n: int) -> dict[str, list[float]]:
    """Seconds of `n` probes on each door, one after another, the doors in turn."""
    took: dict[str, list[float]] = {"grpc": [], "http": []}
    for i in range(n):
        took["grpc"].append(await grpc_probe(orc, i))
        took["http"].append(await http_probe(orc, i))
    return took


async def grpc_non_readers(orc, stack: contextlib.AsyncExitStack) -> None:
    import grpc

    from omnistage.contract.request import build_request
    from omnistage.v1 import orchestrator_pb2_grpc

    ch = await stack.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}",
                                                                   options=[("grpc.http2.bdp_probe", 0)]))
    stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
    for i in range(NON_READERS):
        call = stub.Generate(build_request(f"a long answer {i}", **LONG))
        stack.callback(call.cancel)


def long_chat(orc) -> dict:
    """The non-readers' HTTP request: a long streamed answer with audio."""
    return {"model": orc.pipeline.name, "messages": [{"role": "user", "content": "a long answer"}], "stream": True,
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
            "max_tokens": LONG["max_tokens"], "ignore_eos": True}


async def readers(orc) -> None:
    """The non-readers' requests (NON_READERS on each door) from clients that read every byte: the control."""
    import httpx

    from omnistage.client import AsyncOmniClient

    async def grpc_one(i: int) -> None:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            async for _ in client.stream(f"a long answer {i}", **LONG, timeout=300):
                pass

    async def http_one(http) -> None:
        async with http.stream("POST", "/v1/chat/completions", json=long_chat(orc)) as r:
            async for _ in r.aiter_bytes():
                pass

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{orc.api_port}", timeout=300) as http:
        await asyncio.gather(*(grpc_one(i) for i in range(NON_READERS)), *(http_one(http) for _ in range(NON_READERS)))


async def http_non_readers(orc, stack: contextlib.AsyncExitStack) -> set:
    """Open the HTTP non-readers; their addresses."""
    body = json.dumps(long_chat(orc)).encode()
    connections = orc.api._server.server_state.connections
    addresses = set()
    for _ in range(NON_READERS):
        sock = socket.socket()
        stack.callback(sock.close)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", orc.api_port))
        mine = sock.getsockname()
        addresses.add(mine)
        for _ in range(1000):
            served = [c for c in connections if c.transport.get_extra_info("peername") == mine]
            if served:
                break
            await asyncio.sleep(0.01)
        served[0].transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        served[0].transport.set_write_buffer_limits(high=4096)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return addresses


async def most_parked(stages, seen: list[int]) -> None:
    """Keep in `seen[0]` the most jobs parked at the stages at once (sampled every 50 ms until cancelled)."""
    while True:
        seen[0] = max(seen[0], sum(s.engine.scheduler.parked for s in stages.values()))
        await asyncio.sleep(0.05)


async def admitted(orc, n: int) -> None:
    """Until `n` requests are in flight (at most SETTLE_S)."""
    t0 = time.perf_counter()
    while len(orc.servicer.runs) < n:
        if time.perf_counter() - t0 > SETTLE_S:
            raise RuntimeError(f"non-readers not admitted: {len(orc.servicer.runs)} runs of {n}")
        await asyncio.sleep(0.01)


async def settled(orc, stages) -> float:
    """Seconds until the stages hold nothing but parked jobs (every non-reader's work made or parked, what it
    made waiting in buffers for its client, or taken by its door and the request over), at most SETTLE_S."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < SETTLE_S:
        busy = sum(s.engine.scheduler.running + s.engine.scheduler.queued for s in stages.values())
        if not busy and all(r.first_output is not None for r in orc.servicer.runs.values()):
            break
        await asyncio.sleep(0.05)
    return time.perf_counter() - t0


def backed_up(orc) -> int:
    """Requests whose events wait for their door's send (the client is not taking them)."""
    return sum(r._events.qsize() > 0 for r in orc.servicer.runs.values())


async def run(quick: bool) -> dict[str, float]:
    from omnistage.contract import launch
    from orchestrator_service.server import OrchestratorServer
    from stage_service.server import StageServer

    for key, value in launch.service_env(ROOT / "models", same_host=True).items():
        os.environ.setdefault(key, value)
    p, n = pipeline(), 3 if quick else 10
    t0 = time.perf_counter()

    def mark(what: str) -> None:
        print(f"abuse_non_reading: {what} at {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    stages = {}
    orc = None
    try:
        for name in ("thinker", "talker", "code2wav"):
            stages[name] = StageServer(p, name, "127.0.0.1", 0, model_root=str(launch.model_root()))
            await stages[name].start()
        orc = OrchestratorServer(p, {k: [f"127.0.0.1:{s.port}"] for k, s in stages.items()}, api_port=0)
        await orc.start(wait_for_stages=60)
        mark("servers up")
        await probe(orc, 1)  # warm up
        mark("warm")
        out: dict = {"baseline": await probe(orc, n)}
        mark("baseline")
        control = asyncio.create_task(readers(orc))
        await asyncio.sleep(0.5)  # their requests admitted
        out["beside_readers"] = await probe(orc, n)
        await control
        mark("beside readers")
        parked = [0]
        async with contextlib.AsyncExitStack() as stack:
            sampler = asyncio.create_task(most_parked(stages, parked))
            await grpc_non_readers(orc, stack)
            http_clients = await http_non_readers(orc, stack)
            opened = time.perf_counter()
            await admitted(orc, 2 * NON_READERS)
            mark("non-readers opened on both doors")
            out["beside_non_readers"] = await probe(orc, n)
            mark("beside non-readers' work")
            await settled(orc, stages)
            out["settle_s"] = time.perf_counter() - opened
            out["stalled"] = backed_up(orc)
            mark("stalled; stages (running, parked, queued): " + ", ".join(
                f"{k} {s.engine.scheduler.running, s.engine.scheduler.parked, s.engine.scheduler.queued}"
                for k, s in stages.items()))
            out["with"] = await probe(orc, n)
            sampler.cancel()
            mark("probed")
            out["held"] = len(orc.servicer.runs)  # the non-readers' requests still in flight
            out["connections"] = sum(c.transport.get_extra_info("peername") in http_clients  # held by the door
                                     for c in orc.api._server.server_state.connections)
        out["parked"] = parked[0]
        for _ in range(600):  # their requests gone (cancelled when the connections closed)
            if not orc.servicer.runs:
                break
            await asyncio.sleep(0.05)
        out["baseline_after"] = await probe(orc, n)
        mark("done")
        return out
    finally:
        if orc is not None:
            await orc.drain()
        for s in stages.values():
            await s.drain()


def measure(quick: bool) -> list[dict]:
    t = asyncio.run(run(quick))
    doors = ("grpc", "http")
    base = {d: statistics.median(t["baseline"][d]) for d in doors}
    med = {d: statistics.median(t["with"][d]) / base[d] for d in doors}
    top = {d: max(t["with"][d]) / base[d] for d in doors}
    return [figure("non_reading.probe_latency_over_baseline", max(med.values()), "x"),
            figure("non_reading.probe_latency_max_over_baseline", max(top.values()), "x"),
            *(figure(f"non_reading.{d}.probe_latency_over_baseline", med[d], "x") for d in doors),
            *(figure(f"non_reading.{d}.probe_latency_max_over_baseline", top[d], "x") for d in doors),
            *(figure(f"non_reading.{d}.baseline_probe_ms", base[d] * 1e3, "ms") for d in doors),
            *(figure(f"non_reading.{d}.baseline_after_probe_ms", statistics.median(t["baseline_after"][d]) * 1e3,
                     "ms") for d in doors),
            # while the non-readers' requests are being made, over the same requests from clients that read
            *(figure(f"non_reading.{d}.during_work_over_readers",
                     statistics.median(t["beside_non_readers"][d]) / statistics.median(t["beside_readers"][d]), "x")
              for d in doors),
            *(figure(f"non_reading.{d}.during_work_max_over_readers",
                     max(t["beside_non_readers"][d]) / max(t["beside_readers"][d]), "x") for d in doors),
            *(figure(f"non_reading.{d}.during_work_probe_ms", statistics.median(t["beside_non_readers"][d]) * 1e3,
                     "ms") for d in doors),
            *(figure(f"non_reading.{d}.during_work_slowest_probe_ms", max(t["beside_non_readers"][d]) * 1e3, "ms")
              for d in doors),
            figure("non_reading.streams_per_door", NON_READERS, "streams"),
            figure("non_reading.requests_backed_up_to_door", t["stalled"], "requests"),
            figure("non_reading.non_readers_stage_work_s", t["settle_s"], "s"),
            figure("non_reading.jobs_parked_at_stages", t["parked"], "jobs"),
            figure("non_reading.requests_held_after_probes", t["held"], "requests"),
            figure("non_reading.http.connections_held_after_probes", t["connections"], "connections")]


if __name__ == "__main__":
    for f in measure(quick="--quick" in sys.argv):
        print(f)
