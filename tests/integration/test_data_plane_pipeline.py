"""The data plane inside real stage services: Qwen3-Omni tiny with its hidden states and codec codes
moving by reference (UCX from Thinker to Talker, shared memory from Talker to Code2Wav), the same
answers as inline, nothing left behind after cancels and after 1,000 requests, and async chunk
streaming that has audio at the client before the Thinker has finished."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest

from omnistage.client import AsyncOmniClient
from omnistage.connector.shm import SEGMENT_PREFIX
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from orchestrator_service.server import OrchestratorServer

from ..harness import example, header, start_stage, wait_until

STAGES = ("thinker", "talker", "code2wav")


def by_reference(thinker_talker: str = "ucx", talker_code2wav: str = "shm", talker_chunk: int | None = None):
    def edit(doc):
        stages = {s["name"]: s for s in doc["spec"]["topology"]["stages"]}
        stages["talker"]["inputs"][0]["transport"] = thinker_talker
        stages["code2wav"]["inputs"][0]["transport"] = talker_code2wav
        if talker_chunk is not None:
            stages["talker"]["chunkSize"] = talker_chunk
    return edit


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"{SEGMENT_PREFIX}*")}


def metric(registry, name, labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def nothing_held(stages) -> bool:
    return all(s.data_plane.held_bytes == 0 and s.data_plane.connector.held_tensors == 0 for s in stages.values())


async def serve(pipeline, model_dir):
    stages = {n: await start_stage(pipeline, n, model_dir) for n in STAGES}
    orc = OrchestratorServer(pipeline, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()})
    await orc.start(wait_for_stages=30)
    return orc, stages


async def stop(orc, stages):
    await orc.drain()
    for s in stages.values():
        await s.drain()


@pytest.fixture(scope="module")
async def by_ref(model_dir):
    orc, stages = await serve(example("qwen3-omni-tiny", by_reference()), model_dir)
    yield orc, stages
    await stop(orc, stages)


async def test_stages_enable_what_their_edges_ask_for(by_ref):
    _, stages = by_ref
    assert stages["thinker"].data_plane.transports == ("shm", "ucx")  # its edge to the Talker is UCX
    assert stages["code2wav"].data_plane.transports == ("shm",)      # its only edge is shared memory


async def test_by_reference_gives_the_same_answer_as_inline_and_holds_nothing_after(by_ref, model_dir):
    orc, stages = by_ref
    kw = dict(max_tokens=12, ignore_eos=True, max_codec_frames=40, seed=7, timeout=120)
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        referenced = await client.generate("Hello there", **kw)
    edge = {"edge": "thinker->talker", "transport": "ucx", "direction": "in"}
    assert metric(stages["talker"].metrics.registry, "omnistage_transfer_bytes_total", edge) > 0
    edge = {"edge": "talker->code2wav", "transport": "shm", "direction": "in"}
    assert metric(stages["code2wav"].metrics.registry, "omnistage_transfer_bytes_total", edge) > 0
    await wait_until(lambda: nothing_held(stages), 10, what="every chunk freed once fetched")

    inline_orc, inline_stages = await serve(example("qwen3-omni-tiny", by_reference("inline", "inline")), model_dir)
    try:
        async with AsyncOmniClient(f"127.0.0.1:{inline_orc.port}") as client:
            inline = await client.generate("Hello there", **kw)
    finally:
        await stop(inline_orc, inline_stages)
    assert referenced.token_ids == inline.token_ids and referenced.text == inline.text
    assert referenced.pcm == inline.pcm and len(referenced.pcm) > 0


async def test_client_cancel_mid_stream_frees_every_buffer_on_every_stage(by_ref):
    orc, stages = by_ref
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        call = client.stream("a long answer", max_tokens=64, max_codec_frames=2000, timeout=120)
        async for ev in call:
            if ev.WhichOneof("event") == "audio":
                break  # chunks are moving on both edges now
        call.cancel()
    await wait_until(lambda: all(s.servicer.inflight == 0 for s in stages.values()), 30, what="stages idle")
    await wait_until(lambda: nothing_held(stages), 10, what="held bytes back to 0 on every stage")


async def test_a_stage_call_cancelled_with_unfetched_output_frees_it(by_ref):
    """The Thinker's output is held for a Talker that never fetches it; cancelling the call frees it."""
    orc, stages = by_ref
    thinker = stages["thinker"]
    first = header("held-1", max_tokens=64, ignore_eos=True)
    first.header.consumers.append("talker")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{thinker.port}") as ch:
        call = stage_pb2_grpc.StageServiceStub(ch).Process(iter([first]), timeout=60)
        got = [await call.read() for _ in range(2)]
        assert all(any(t.WhichOneof("payload") == "ref" for t in out.chunk.tensors) for out in got)
        assert thinker.data_plane.held_bytes > 0
        call.cancel()
    await wait_until(lambda: thinker.servicer.inflight == 0, 30, what="thinker idle")
    assert thinker.data_plane.held_bytes == 0


async def test_release_frees_a_finished_requests_unfetched_output(by_ref):
    orc, stages = by_ref
    thinker = stages["thinker"]
    first = header("held-2", max_tokens=6, ignore_eos=True)
    first.header.consumers.append("talker")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{thinker.port}") as ch:
        stub = stage_pb2_grpc.StageServiceStub(ch)
        outs = [o async for o in stub.Process(iter([first]), timeout=60)]
        assert outs[-1].chunk.end_of_stream and thinker.data_plane.held_bytes > 0
        load = await stub.GetLoad(stage_pb2.GetLoadRequest())
        assert load.buffered_bytes == thinker.data_plane.held_bytes
        freed = await stub.Release(stage_pb2.ReleaseRequest(request_id="held-2"))
    assert freed.bytes_freed > 0 and thinker.data_plane.held_bytes == 0


async def test_a_thousand_requests_leave_no_buffer_segment_or_endpoint_behind(by_ref):
    orc, stages = by_ref
    before = segments()
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        sem = asyncio.Semaphore(16)

        async def one(i: int):
            async with sem:
                r = await client.generate(f"hi {i}", max_tokens=2, ignore_eos=True, max_codec_frames=2, timeout=120)
                assert len(r.token_ids) == 2 and len(r.pcm) > 0

        await asyncio.gather(*(one(i) for i in range(1000)))
    await wait_until(lambda: nothing_held(stages), 10, what="nothing held after 1,000 requests")
    assert segments() <= before, f"segments left: {sorted(segments() - before)}"
    shm_in = {"edge": "talker->code2wav", "transport": "shm", "direction": "in"}
    assert metric(stages["code2wav"].metrics.registry, "omnistage_transfer_chunks_total",
                  {"edge": "talker->code2wav", "direction": "in"}) >= 1000
    assert metric(stages["code2wav"].metrics.registry, "omnistage_transfer_bytes_total", shm_in) > 0
    # UCX endpoints: one per producer on the consumer side and one per consumer on the producer side,
    # reused by every request, not one per request.
    assert stages["talker"].data_plane.connector.endpoints <= 1
    assert stages["thinker"].data_plane.connector.endpoints <= 1


async def test_async_chunk_first_audio_reaches_the_client_before_the_thinker_finishes(model_dir):
    orc, stages = await serve(example("qwen3-omni-tiny", by_reference(talker_chunk=5)), model_dir)
    try:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            r = await client.generate("Tell me a long story", max_tokens=200, ignore_eos=True, max_codec_frames=60,
                                      timeout=300)
    finally:
        await stop(orc, stages)
    assert len(r.token_ids) == 200 and r.audio_chunks >= 2
    last_text = len(r.events) - 1 - r.events[::-1].index("text")
    assert r.events.index("audio") < last_text, r.events
