"""The orchestrator as the control plane: overload, retries on another replica, cancel and deadline
cleanup, several orchestrators over the same stages. Real stage services, real models."""

from __future__ import annotations

import asyncio

import grpc
import psutil
import pytest

from omnistage.client import AsyncOmniClient
from orchestrator_service.server import OrchestratorServer

from ..harness import StageProcess, example, start_stage, write_pipeline
from ..polling import wait_until


def llm_hf(doc):
    """The tiny LM on the transformers engine with small bounds everywhere, so overload is cheap to reach."""
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    doc["spec"]["topology"]["limits"] = {"defaultMaxTokens": 4, "maxTokens": 8}
    doc["spec"]["deployment"]["orchestrator"] = {"maxInflight": 4, "maxQueued": 4}
    doc["spec"]["deployment"]["stages"]["llm"]["scheduler"] = {"maxBatch": 1, "maxQueued": 2}


def metric(registry, name, labels=None) -> float:
    value = registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


async def start_orchestrator(pipeline, endpoints):
    orc = OrchestratorServer(pipeline, endpoints)
    await orc.start(wait_for_stages=60)
    return orc


# ----------------------------------------------------------------- overload

async def test_overload_at_three_times_capacity(model_dir):
    pipeline = example("llm-tiny", llm_hf)
    stage = await start_stage(pipeline, "llm", model_dir)
    orc = await start_orchestrator(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]})
    proc = psutil.Process()
    try:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            await client.generate("warm up", timeout=60)
            rss_before = proc.memory_info().rss
            holds = orc.servicer.admission.max_inflight + orc.servicer.admission.max_queued
            events = []

            async def one(i):
                try:
                    r = await client.generate(f"request {i}", max_tokens=8, ignore_eos=True, timeout=120)
                    events.append(("done", i))
                    return r
                except grpc.aio.AioRpcError as e:
                    events.append(("rejected", i))
                    return e

            results = await asyncio.gather(*(one(i) for i in range(3 * holds)))
        done = [r for r in results if not isinstance(r, grpc.aio.AioRpcError)]
        rejected = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert 1 <= len(done) <= holds and len(done) + len(rejected) == 3 * holds
        assert all(len(r.token_ids) == 8 for r in done)  # every admitted request completed in full
        for e in rejected:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in e.details()
            assert any(k == "retry-after" and float(v) > 0 for k, v in e.trailing_metadata())
        # Refusals are immediate: every one came back before the first admitted request finished.
        first_done = next(i for i, (kind, _) in enumerate(events) if kind == "done")
        assert all(kind == "rejected" for kind, _ in events[:len(rejected)]) and first_done == len(rejected)
        reg = orc.metrics.registry
        assert metric(reg, "omnistage_requests_ended_total", {"outcome": "rejected"}) == len(rejected)
        # The stage was never sent more than it can hold: it refused nothing itself.
        assert metric(stage.metrics.registry, "omnistage_stage_requests_total",
                      {"stage": "llm", "outcome": "rejected"}) == 0
        assert proc.memory_info().rss - rss_before < 200 << 20
    finally:
        await orc.drain()
        await stage.drain()


# ------------------------------------------------------------------ retries

@pytest.fixture(scope="module")
async def two_replicas(model_dir, tmp_path_factory):
    """Thinker in-process; Talker and Code2Wav as two real processes each, so one can be killed."""
    tmp = tmp_path_factory.mktemp("replicas")
    pipeline = example("qwen3-omni-tiny")
    path = write_pipeline(pipeline, tmp / "pipeline.yaml")
    procs = {f"{s}{i}": StageProcess(path, s, model_dir, tmp, f"{s}{i}") for s in ("talker", "code2wav")
             for i in (0, 1)}
    thinker = await start_stage(pipeline, "thinker", model_dir)
    for p in procs.values():
        await asyncio.to_thread(p.wait_ready, 180)
    yield pipeline, thinker, procs
    for p in procs.values():
        p.stop()
    await thinker.drain()


async def run_until_audio(client, kill, **kw):
    """Stream a request; call `kill()` when the first audio chunk arrives; collect everything."""
    audio, text, error = bytearray(), "", None
    killed = False
    try:
        async for ev in client.stream("Tell me a story", max_tokens=12, ignore_eos=True, max_codec_frames=150,
                                      return_trace=True, timeout=180, **kw):
            kind = ev.WhichOneof("event")
            if kind == "audio":
                audio.extend(ev.audio.pcm)
                if not killed:
                    killed = True
                    await kill()
            elif kind == "text":
                text += ev.text.text
            elif kind == "final":
                return bytes(audio), text, ev.final, None
    except grpc.aio.AioRpcError as e:
        error = e
    return bytes(audio), text, None, error


async def test_a_killed_talker_replica_is_replaced_without_duplicate_output(two_replicas):
    pipeline, thinker, procs = two_replicas
    endpoints = {"thinker": [f"127.0.0.1:{thinker.port}"],
                 "talker": [procs["talker0"].address, procs["talker1"].address],
                 "code2wav": [procs["code2wav0"].address]}
    orc = await start_orchestrator(pipeline, endpoints)
    try:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            async def nothing():
                pass
            ref_audio, ref_text, ref_final, err = await run_until_audio(client, nothing)
            assert err is None and len(ref_audio) > 0

            async def kill_busy_talker():
                busy = [r for r in orc.router.pools["talker"].replicas.values() if r.outstanding > 0]
                assert len(busy) == 1
                victim = next(p for p in procs.values() if p.address == busy[0].address)
                victim.kill()

            audio, text, final, err = await run_until_audio(client, kill_busy_talker)
        assert err is None, err
        # The retried Talker repeated its first chunk; it reached neither Code2Wav nor the client twice.
        assert audio == ref_audio and text == ref_text
        talker = next(s for s in final.trace.stages if s.stage == "talker")
        assert talker.attempts == 2
        assert metric(orc.metrics.registry, "omnistage_stage_retries_total", {"stage": "talker"}) == 1
    finally:
        await orc.drain()


async def test_an_output_stage_that_already_answered_the_client_fails_with_unavailable(two_replicas):
    pipeline, thinker, procs = two_replicas
    alive_talker = next(p for p in (procs["talker0"], procs["talker1"]) if p.proc.poll() is None)
    endpoints = {"thinker": [f"127.0.0.1:{thinker.port}"], "talker": [alive_talker.address],
                 "code2wav": [procs["code2wav0"].address, procs["code2wav1"].address]}
    orc = await start_orchestrator(pipeline, endpoints)
    try:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            async def kill_busy_decoder():
                busy = [r for r in orc.router.pools["code2wav"].replicas.values() if r.outstanding > 0]
                next(p for p in procs.values() if p.address == busy[0].address).kill()

            audio, text, final, err = await run_until_audio(client, kill_busy_decoder)
        assert final is None and err is not None
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "stage code2wav" in err.details()
        assert "its output already reached the client" in err.details()
        # The request's other stage calls were cancelled: nothing is left on them.
        await wait_until(lambda: thinker.servicer.inflight == 0, 30, what="thinker idle")
    finally:
        await orc.drain()


# ------------------------------------------------------- cancel and deadline

@pytest.fixture(scope="module")
async def omni(model_dir):
    pipeline = example("qwen3-omni-tiny")
    stages = {n: await start_stage(pipeline, n, model_dir) for n in ("thinker", "talker", "code2wav")}
    orc = await start_orchestrator(pipeline, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()})
    yield orc, stages
    await orc.drain()
    for s in stages.values():
        await s.drain()


def nothing_left(orc, stages) -> bool:
    return (all(s.servicer.inflight == 0 and s.engine.running == 0 and s.engine.queued == 0
                for s in stages.values())
            and orc.servicer.admission.inflight == 0 and not orc.servicer.runs
            and all(r.outstanding == 0 for p in orc.router.pools.values() for r in p.replicas.values()))


async def test_client_cancel_leaves_no_state_on_any_stage(omni):
    orc, stages = omni
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        call = client.stream("a long answer", max_tokens=64, max_codec_frames=2000, timeout=120)
        async for ev in call:
            if ev.WhichOneof("event") == "audio":
                break  # every stage is busy with this request now
        assert stages["talker"].servicer.inflight == 1
        call.cancel()
    await wait_until(lambda: nothing_left(orc, stages), 30, what="every stage idle after cancel")
    assert metric(orc.metrics.registry, "omnistage_requests_ended_total", {"outcome": "cancelled"}) >= 1


async def test_a_passed_deadline_leaves_no_state_on_any_stage(omni):
    orc, stages = omni
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate("a long answer", max_tokens=64, max_codec_frames=2000, timeout=2.0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until(lambda: nothing_left(orc, stages), 30, what="every stage idle after the deadline")


# ----------------------------------------------------- horizontal scale

async def test_two_orchestrators_share_the_same_stages(omni):
    orc, stages = omni
    second = await start_orchestrator(orc.pipeline, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()})
    try:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as a, AsyncOmniClient(f"127.0.0.1:{second.port}") as b:
            results = await asyncio.gather(*[c.generate("hi", max_tokens=4, ignore_eos=True, max_codec_frames=10,
                                                        timeout=120) for c in (a, b, a, b)])
        assert all(len(r.token_ids) == 4 and r.pcm for r in results)
        assert {r.request_id for r in results}.__len__() == 4
    finally:
        await second.drain()
    await wait_until(lambda: nothing_left(orc, stages), 30, what="idle")


async def test_a_draining_replica_gets_no_new_work(model_dir):
    pipeline = example("llm-tiny", llm_hf)
    a = await start_stage(pipeline, "llm", model_dir)
    b = await start_stage(pipeline, "llm", model_dir)
    orc = await start_orchestrator(pipeline, {"llm": [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]})
    try:
        a.servicer.draining = True  # what SIGTERM does first: GetLoad reports it, health flips
        replica_a = orc.router.pools["llm"].replicas[f"127.0.0.1:{a.port}"]
        await wait_until(lambda: replica_a.draining, 10, what="orchestrator sees the drain")
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            for _ in range(4):
                r = await client.generate("hi", max_tokens=2, return_trace=True, timeout=60)
                assert r.final.trace.stages[0].replica == f"127.0.0.1:{b.port}"
    finally:
        await orc.drain()
        await a.drain()
        await b.drain()


async def test_a_stage_whose_every_replica_is_unreachable_is_unavailable_at_once(model_dir):
    """A crashed stage process at a fixed address (local serve, static endpoints): a new request is told
    UNAVAILABLE naming the stage instead of waiting in admission for a replica that may never return."""
    pipeline = example("llm-tiny", llm_hf)
    a = await start_stage(pipeline, "llm", model_dir)
    orc = await start_orchestrator(pipeline, {"llm": [f"127.0.0.1:{a.port}"]})
    try:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            assert (await client.generate("hi", max_tokens=2, timeout=60)).text is not None
            await a.drain()  # the only replica is gone; its address stays in the static endpoints
            replica = orc.router.pools["llm"].replicas[f"127.0.0.1:{a.port}"]
            await wait_until(lambda: not replica.ready, 30, what="orchestrator sees the replica gone")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.generate("hi", max_tokens=2, timeout=60)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert e.value.details() == "stage llm has no ready replica (1 unreachable or draining)"
            assert orc.servicer.admission.inflight == 0 and orc.servicer.admission.queued == 0
    finally:
        await orc.drain()
        await a.drain()  # once: a second call waits for the first
