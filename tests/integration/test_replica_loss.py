"""No request lost when a replica goes away (docs/faults.md): a replica that refuses connections is ejected
at once (by a call or by the load poller), its calls go to another replica without counting as attempts,
and it is probed back in; on the real Qwen3-Omni tiny pipeline with inputs by reference (UCX and shared
memory), a Talker replica stopped abruptly mid-request is replaced and the request completes, its inputs
fetched again from the Thinker that kept them; and a draining Thinker waits for its consumer to fetch what
it holds before closing its store."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc
import pytest
import torch

from omnistage.client import AsyncOmniClient
from omnistage.connector import ChunkReceiver, make_connector
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from orchestrator_service.routing import Router
from orchestrator_service.server import OrchestratorServer
from orchestrator_service.stage_call import StageCall

from ..harness import example, start_stage
from ..polling import wait_until
from .test_data_plane_pipeline import by_reference, for_the_talker
from .test_stage_call import SOURCE, STAGE, Replicas, ScriptedStage, chunk


class AnsweringStage(ScriptedStage):
    """The scripted stage, answering the router's GetLoad (its probe) too."""

    async def GetLoad(self, request, context):
        return stage_pb2.StageLoad(stage=STAGE, max_running=4, max_queued=4)


async def test_a_refused_connection_goes_to_another_replica_uncounted_and_the_replica_is_probed_back_in():
    script = AnsweringStage()
    async with Replicas(script) as replicas:
        down = replicas.pool.choose()  # the replica the call would go to first
        # Its port refuses connections from now on.
        await replicas.servers[list(replicas.pool.replicas).index(down.address)].stop(0)
        delivered, ended = [], asyncio.get_running_loop().create_future()

        async def deliver(c):
            delivered.append(c)
            return False

        async def on_end(error):
            ended.set_result(error)

        # One attempt allowed: a refused connection is not one.
        call = StageCall(STAGE, frozenset({SOURCE}), stage_pb2.StageRequestHeader(request_id="r1"),
                         router=replicas.router, deadline=None, deliver=deliver, ended=on_end,
                         max_attempts=1, max_replay_bytes=1 << 20)
        await call.open()
        assert call.tried == {down.address}
        for i in range(3):
            await call.forward(SOURCE, chunk(i, last=i == 2))
        assert await asyncio.wait_for(ended, 30) is None
        assert [c.chunk_id for c in delivered] == [0, 1, 2] and len(script.calls) == 1
        assert call.timing.attempts == 2 and call.timing.replica != down.address
        assert down.outlier.ejected and not down.ready and replicas.pool.candidates() != []
        assert replicas.router.retry_budget.retrying == 0

        # Back on the same port: the probe after its ejection time finds it and routing uses it again.
        server = grpc.aio.server()
        stage_pb2_grpc.add_StageServiceServicer_to_server(script, server)
        assert server.add_insecure_port(down.address) == int(down.address.rsplit(":", 1)[1])
        await server.start()
        replicas.servers.append(server)
        await wait_until(lambda: down.ready, 30, what="the ejected replica probed back in",
                         detail=lambda: down.outlier)
        # (Ejected once by the call, and maybe again by its load poller before the port came back: the
        # growth is reset only once it serves a call to the end.)
        assert not down.outlier.ejected and down.outlier.consecutive >= 1
        call.cancel()
        await call.stopped()


def two_talkers(doc):
    """Qwen3-Omni tiny, Thinker -> Talker over UCX and Talker -> Code2Wav over shared memory."""
    by_reference("ucx", "shm")(doc)
    doc["spec"]["deployment"]["stages"]["talker"]["replicas"] = 2


def hang_after(engine, steps: int) -> threading.Event:
    """Each step of the engine after its first `steps` waits for the event returned (a hung kernel)."""
    gate, real, taken = threading.Event(), engine.scheduler.step_fn, 0

    def step(states):
        nonlocal taken
        taken += 1
        if taken > steps:
            gate.wait(120)
        return real(states)

    engine.scheduler.step_fn = step
    return gate


@contextlib.asynccontextmanager
async def two_talkers_held(model_dir, steps: int):
    """Qwen3-Omni tiny with two Talker replicas (two_talkers) and an orchestrator over them, each Talker's
    steps after its first `steps` held until released: yields the stage servers by name (the second Talker
    as "talker-b"), the orchestrator and the Talkers' gates; all released and drained on the way out."""
    pipeline = example("qwen3-omni-tiny", two_talkers)
    stages, gates, orc = {}, [], None
    try:
        for name in ("thinker", "talker", "talker-b", "code2wav"):
            stages[name] = await start_stage(pipeline, name.removesuffix("-b"), model_dir)
        orc = OrchestratorServer(pipeline, {
            "thinker": [f"127.0.0.1:{stages['thinker'].port}"],
            "talker": [f"127.0.0.1:{stages[t].port}" for t in ("talker", "talker-b")],
            "code2wav": [f"127.0.0.1:{stages['code2wav'].port}"]})
        await orc.start(wait_for_stages=60)
        gates = [hang_after(stages[t].engine, steps) for t in ("talker", "talker-b")]
        yield stages, orc, gates
    finally:
        for gate in gates:
            gate.set()
        if orc is not None:
            await orc.drain()
            orc.close()
        for srv in stages.values():
            await srv.drain()
            srv.close()


async def test_a_talker_stopped_mid_request_is_replaced_and_refetches_its_inputs_by_reference(model_dir):
    # whichever Talker gets the request holds it
    async with two_talkers_held(model_dir, 0) as (stages, orc, gates), \
            AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        talkers = [stages["talker"], stages["talker-b"]]
        answer = asyncio.ensure_future(client.generate("Hello there", max_tokens=8, max_codec_frames=30,
                                                       return_trace=True, timeout=120))
        victim = await wait_until(lambda: next((t for t in talkers if t.servicer.inflight), None), 60,
                                  what="a Talker holding the request")
        # Its input came by reference and it fetched all of it: the Thinker keeps it for a retry.
        thinker = stages["thinker"]
        await wait_until(lambda: not thinker.servicer.inflight and not thinker.data_plane.unfetched_bytes, 60,
                         what="the Thinker done and its output fetched")
        assert thinker.data_plane.held_bytes > 0
        await victim.server.stop(0)  # gone abruptly: its calls end UNAVAILABLE
        for gate, t in zip(gates, talkers):
            if t is not victim:
                gate.set()
        result = await answer
        assert result.text and result.audio_chunks > 0 and result.final is not None
        talker = next(s for s in result.final.trace.stages if s.stage == "talker")
        assert talker.attempts == 2 and talker.replica != f"127.0.0.1:{victim.port}"
        # Once the request ended the orchestrator released what the producers kept for a retry.
        for name in ("thinker", "talker-b" if victim is stages["talker"] else "talker"):
            await wait_until(lambda: stages[name].data_plane.held_bytes == 0, 30, what=f"{name} holding nothing")


async def test_a_retried_talker_that_does_not_repeat_what_was_handed_on_fails_the_request_unspliced(model_dir):
    """The first Talker hands on its first chunk of codes and is lost; the other replica, whose weights differ
    (as a replica on another build can), generates other codes for that chunk: the request fails saying so,
    where the repeat used to be skipped unchecked and its continuation spliced onto the first generation."""
    # 30 frames: a first chunk of 15, then held
    async with two_talkers_held(model_dir, 20) as (stages, orc, gates), \
            AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        talkers = [stages["talker"], stages["talker-b"]]
        answer = asyncio.ensure_future(client.generate("Hello there", max_tokens=8, max_codec_frames=30,
                                                       outputs=["audio"], timeout=120))
        victim = await wait_until(lambda: next((t for t in talkers if t.servicer.inflight), None), 60,
                                  what="a Talker holding the request")
        chunks = victim.metrics.chunks.labels("talker")
        await wait_until(lambda: chunks._value.get() >= 1 and not victim.data_plane.unfetched_bytes, 60,
                         what="the Talker's first chunk handed on and fetched by Code2Wav")
        other = next(t for t in talkers if t is not victim)
        with torch.no_grad():
            head = other.engine.talker.model.codec_head.weight
            head.copy_(head.flip(0))
        await victim.server.stop(0)
        for gate in gates:
            gate.set()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await answer
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "did not reproduce chunk 0" in e.value.details()


async def test_a_draining_producer_keeps_unfetched_outputs_until_its_consumer_fetched_them(model_dir):
    pipeline = example("qwen3-omni-tiny", by_reference("ucx", "shm"))
    thinker = await start_stage(pipeline, "thinker", model_dir)
    consumer = await make_connector("talker", ("ucx",))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{thinker.port}") as ch:
            call = stage_pb2_grpc.StageServiceStub(ch).Process(iter([for_the_talker("drained-1", 8)]), timeout=60)
            chunks = [out.chunk async for out in call]
        refs = [t for c in chunks for t in c.tensors if t.WhichOneof("payload") == "ref"]
        assert refs and all(t.ref.backend == "ucx" for t in refs)
        assert thinker.data_plane.unfetched_bytes > 0
        drain = asyncio.ensure_future(thinker.drain())
        await wait_until(lambda: thinker.servicer.draining and not thinker.servicer.inflight, what="drain begun")
        assert not drain.done() and not thinker.stopped.is_set()  # waiting for the Talker, store open
        receiver = ChunkReceiver(consumer)
        fetched = [await receiver.fetch(c) for c in chunks]
        assert all(r.tensors[t.name].shape == tuple(t.shape) for r, c in zip(fetched, chunks) for t in c.tensors)
        await asyncio.wait_for(drain, 30)
        assert thinker.stopped.is_set()
    finally:
        await consumer.close()
        await thinker.drain()
        thinker.close()


async def test_the_poller_ejects_a_replica_that_refuses_its_load_poll_before_any_request_pays_for_it():
    script = AnsweringStage()
    async with Replicas(script) as replicas:
        router = Router(example("llm-tiny"), poll_interval=0.05)
        router.set_endpoints(STAGE, list(replicas.pool.replicas))
        router.start()
        try:
            gone, kept = list(router.pools[STAGE].replicas.values())
            await replicas.servers[0].stop(0)
            await wait_until(lambda: gone.outlier.ejected, 10, what="the refusing replica ejected")
            assert not gone.ready and kept.ready and router.pools[STAGE].choose() is kept
        finally:
            await router.close()
