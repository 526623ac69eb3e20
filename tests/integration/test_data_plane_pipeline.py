"""The data plane inside real stage services: Qwen3-Omni tiny served by `omnistage serve` (every stage
its own process) with hidden states going Thinker -> Talker over UCX and codec codes Talker -> Code2Wav
over shared memory: the same answers as inline, nothing left behind after cancels and after 1,000
requests; and async chunk streaming that has audio at the client before the Thinker has finished.

What a stage holds is read as the orchestrator reads it (`GetLoad.buffered_bytes`); UCX endpoints are
the stage processes' TCP connections (UCX_TLS=tcp)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import psutil
import pytest
import yaml

from omnistage.api import parse_pipeline
from omnistage.client import AsyncOmniClient
from omnistage.connector.shm import SEGMENT_PREFIX
from omnistage.local.serve import LocalPipeline
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from orchestrator_service.server import OrchestratorServer

from ..conftest import EXAMPLES
from ..harness import example, header, start_stage
from ..polling import wait_until

STAGES = ("thinker", "talker", "code2wav")


def by_reference(thinker_talker: str = "ucx", talker_code2wav: str = "shm", talker_chunk: int | None = None):
    def edit(doc):
        stages = {s["name"]: s for s in doc["spec"]["topology"]["stages"]}
        stages["talker"]["inputs"][0]["transport"] = thinker_talker
        stages["code2wav"]["inputs"][0]["transport"] = talker_code2wav
        if talker_chunk is not None:  # every chunk this size, the first too
            stages["talker"]["chunkSize"] = talker_chunk
            stages["talker"].pop("initialChunkSize", None)
    return edit


def segments(served: "Served") -> set[str]:
    """The shared-memory segments of the pipeline's own processes: a segment's name carries its producer's pid
    (after the pid namespace), and other processes on the machine make and remove theirs meanwhile."""
    pids = {str(p.popen.pid) for p in served.local.all_procs()}
    return {p.name for p in Path("/dev/shm").glob(f"{SEGMENT_PREFIX}*")
            if (p.name.removeprefix(SEGMENT_PREFIX).split("-") + ["", ""])[1] in pids}


class Served:
    """`omnistage serve` of the edited example: the orchestrator endpoint and each stage's address."""

    def __init__(self, local: LocalPipeline):
        self.local = local
        self.endpoint = local.endpoint
        self.stages = {p.stage: p for p in local.stages}

    def address(self, stage: str) -> str:
        return f"127.0.0.1:{self.stages[stage].port}"

    async def loads(self) -> dict[str, stage_pb2.StageLoad]:
        out = {}
        for name in STAGES:
            async with grpc.aio.insecure_channel(self.address(name)) as ch:
                out[name] = await stage_pb2_grpc.StageServiceStub(ch).GetLoad(stage_pb2.GetLoadRequest(), timeout=10)
        return out

    async def nothing_held(self) -> bool:
        return all(ld.buffered_bytes == 0 and ld.running == 0 and ld.queued == 0
                   for ld in (await self.loads()).values())

    def connections(self, stage: str) -> int:
        """Established TCP connections of a stage process: gRPC's (a fixed few) plus its UCX endpoints."""
        proc = psutil.Process(self.stages[stage].popen.pid)
        return len([c for c in proc.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED])


async def until_nothing_held(served: Served, timeout: float = 15.0) -> None:
    await wait_until(served.nothing_held, timeout, 0.05, what="nothing held", detail=served.loads)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    doc = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())
    by_reference()(doc)
    path = tmp_path_factory.mktemp("data-plane") / "pipeline.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    # tls=False: the tests call the stages directly (GetLoad, Process, Release) as a plaintext orchestrator
    local = LocalPipeline(path, parse_pipeline(doc), model_dir, log_dir=path.parent / "logs", progress=lambda m: None,
                          tls=False)
    try:
        local.start(timeout=300)
        yield Served(local)
    finally:
        local.stop()


async def in_process(pipeline, model_dir):
    stages = {n: await start_stage(pipeline, n, model_dir) for n in STAGES}
    orc = OrchestratorServer(pipeline, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()})
    await orc.start(wait_for_stages=30)
    return orc, stages


async def stop(orc, stages):
    await orc.drain()
    for s in stages.values():
        await s.drain()


async def test_by_reference_gives_the_same_answer_as_inline_and_holds_nothing_after(served, model_dir):
    kw = dict(max_tokens=12, ignore_eos=True, max_codec_frames=40, seed=7, timeout=120)
    async with AsyncOmniClient(served.endpoint) as client:
        referenced = await client.generate("Hello there", **kw)
    logs = {n: p.log_path.read_text() for n, p in served.stages.items()}
    assert "data plane: inline, shm, ucx" in logs["thinker"] and "data plane: inline, shm, ucx" in logs["talker"]
    assert "data plane: inline, shm (" in logs["code2wav"]  # its only edge is shared memory: no UCX started
    await until_nothing_held(served)

    orc, stages = await in_process(example("qwen3-omni-tiny", by_reference("inline", "inline")), model_dir)
    try:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            inline = await client.generate("Hello there", **kw)
        assert all(s.data_plane.held_bytes == 0 for s in stages.values())
    finally:
        await stop(orc, stages)
    assert referenced.token_ids == inline.token_ids and referenced.text == inline.text
    assert referenced.pcm == inline.pcm and len(referenced.pcm) > 0


async def test_client_cancel_mid_stream_frees_every_buffer_on_every_stage(served):
    async with AsyncOmniClient(served.endpoint) as client:
        call = client.stream("a long answer", max_tokens=64, max_codec_frames=2000, timeout=120)
        async for ev in call:
            if ev.WhichOneof("event") == "audio":
                break  # chunks are moving on both edges now
        call.cancel()
    await until_nothing_held(served)


def for_the_talker(request_id: str, max_tokens: int) -> stage_pb2.StageInput:
    """A Thinker call whose output is meant for the Talker (held until it fetches, which it never does here)."""
    first = header(request_id, max_tokens=max_tokens, ignore_eos=True)
    first.header.consumers.append("talker")
    return first


async def test_a_stage_call_cancelled_with_unfetched_output_frees_it(served):
    """The Thinker's output is held for a Talker that never fetches it; cancelling the call frees it."""
    async with grpc.aio.insecure_channel(served.address("thinker")) as ch:
        call = stage_pb2_grpc.StageServiceStub(ch).Process(iter([for_the_talker("held-1", 64)]), timeout=60)
        got = [await call.read() for _ in range(2)]
        assert all(any(t.WhichOneof("payload") == "ref" and t.ref.backend == "ucx" for t in out.chunk.tensors)
                   for out in got)
        assert (await served.loads())["thinker"].buffered_bytes > 0
        call.cancel()
    await until_nothing_held(served)


async def test_release_frees_a_finished_requests_unfetched_output(served):
    async with grpc.aio.insecure_channel(served.address("thinker")) as ch:
        stub = stage_pb2_grpc.StageServiceStub(ch)
        outs = [o async for o in stub.Process(iter([for_the_talker("held-2", 6)]), timeout=60)]
        assert outs[-1].chunk.end_of_stream
        held = (await stub.GetLoad(stage_pb2.GetLoadRequest())).buffered_bytes
        assert held > 0
        freed = await stub.Release(stage_pb2.ReleaseRequest(request_id="held-2"))
        assert freed.bytes_freed == held
        assert (await stub.GetLoad(stage_pb2.GetLoadRequest())).buffered_bytes == 0


async def test_a_thousand_requests_leave_no_buffer_segment_or_endpoint_behind(served):
    async with AsyncOmniClient(served.endpoint) as client:
        sem = asyncio.Semaphore(16)

        async def one(i: int):
            async with sem:
                r = await client.generate(f"hi {i}", max_tokens=2, ignore_eos=True, max_codec_frames=2, timeout=120)
                assert len(r.token_ids) == 2 and len(r.pcm) > 0

        await asyncio.gather(*(one(i) for i in range(16)))  # every connection the pipeline keeps is open now
        await until_nothing_held(served)
        before = {"segments": segments(served), **{n: served.connections(n) for n in ("thinker", "talker")}}
        await asyncio.gather(*(one(i) for i in range(16, 1000)))
    await until_nothing_held(served)
    left = segments(served) - before["segments"]
    assert not left, f"segments left: {sorted(left)}"
    # UCX endpoints are TCP connections here: as many as before the 984 requests, not one more per request.
    for name in ("thinker", "talker"):
        assert served.connections(name) <= before[name], name


async def test_async_chunk_first_audio_reaches_the_client_before_the_thinker_finishes(model_dir):
    orc, stages = await in_process(example("qwen3-omni-tiny", by_reference("shm", "shm", talker_chunk=5)), model_dir)
    try:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            r = await client.generate("Tell me a long story", max_tokens=200, ignore_eos=True, max_codec_frames=60,
                                      timeout=300)
    finally:
        await stop(orc, stages)
    assert len(r.token_ids) == 200 and r.audio_chunks >= 2
    last_text = len(r.events) - 1 - r.events[::-1].index("text")
    assert r.events.index("audio") < last_text, r.events
