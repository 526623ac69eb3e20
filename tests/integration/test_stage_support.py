"""Helpers the stage runtime tests share (no tests here): calls that can be cancelled mid-stream,
load and health probes, and the leak check after a run."""

from __future__ import annotations

import asyncio
import gc

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnistage.v1 import stage_pb2, stage_pb2_grpc
from stage_service.server import EXIT_ENGINE_DEAD

from ..harness import call_stage, example, header, start_stage, tensor_of
from ..polling import wait_until


def scheduler(edit_stage: str, max_batch: int = 16, max_queued: int = 128, max_wait_ms: float | None = None):
    """A pipeline edit that sets one stage's scheduler settings."""
    def edit(doc):
        s = {"maxBatch": max_batch, "maxQueued": max_queued}
        if max_wait_ms is not None:
            s["maxWaitMs"] = max_wait_ms
        doc["spec"]["deployment"]["stages"][edit_stage]["scheduler"] = s
    return edit


class Call:
    """One Process call running as a task: its chunks so far, and whether its first chunk arrived."""

    def __init__(self, channel: grpc.aio.Channel, first: stage_pb2.StageInput, chunks=(), timeout: float = 300,
                 hold_open: asyncio.Event | None = None):
        """`chunks` are sent after the header; with `hold_open`, the input stream stays open (no half-close)
        until that event is set, as while an upstream stage is still producing."""
        self.chunks: list[stage_pb2.Chunk] = []
        self.started = asyncio.Event()
        stub = stage_pb2_grpc.StageServiceStub(channel)

        async def requests():
            yield first
            for c in chunks:
                yield stage_pb2.StageInput(chunk=c)
            if hold_open is not None:
                await hold_open.wait()

        self.rpc = stub.Process(requests(), timeout=timeout)
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> list[stage_pb2.Chunk]:
        async for out in self.rpc:
            if out.HasField("chunk"):  # a StageFailure comes just before the call's error status
                self.chunks.append(out.chunk)
            self.started.set()
        return self.chunks

    def cancel(self) -> None:
        self.rpc.cancel()

    async def outcome(self) -> grpc.StatusCode:
        try:
            await self.task
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        return await self.rpc.code()


async def health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


async def load(port: int) -> stage_pb2.StageLoad:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return await stage_pb2_grpc.StageServiceStub(ch).GetLoad(stage_pb2.GetLoadRequest(), timeout=5)


async def assert_nothing_held(srv, timeout: float = 30.0) -> None:
    """After a run: no request in flight, none unfinished in the engine, no request state alive, no work units
    tallied for a request (every call's end took or dropped them)."""
    engine = srv.engine
    await wait_until(lambda: srv.servicer.inflight == 0, timeout, what="no call in flight")
    await wait_until(lambda: engine.unfinished() == 0, timeout, what="no unfinished engine request")
    assert engine.held_bytes() == 0 and len(engine.tally) == 0
    sched = getattr(engine, "scheduler", None)
    if sched is not None:
        # A step still running in the engine's thread holds its batch's states (cancelled ones included)
        # until it returns: wait for it, then nothing may be left.
        def none_alive() -> bool:
            gc.collect()
            return sched.live_states() == 0

        await wait_until(none_alive, timeout, interval=0.1, what="no request state alive",
                         detail=lambda: f"{sched.live_states()} request states still alive")
        assert (sched.running, sched.queued) == (0, 0)
    else:  # vLLM: its KV cache is free again
        await wait_until(lambda: engine.kv_cache_usage == 0.0, timeout, what="vLLM KV cache free")


async def assert_engine_death_ends_the_stage(srv, kill, failed: str) -> None:
    """`kill()` ends the engine for good while four long calls run: every call fails UNAVAILABLE with `failed`
    in its details, health flips to NOT_SERVING, and the server stops with EXIT_ENGINE_DEAD."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        calls = [Call(ch, header(f"d{i}", max_tokens=250, ignore_eos=True)) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(c.started.wait() for c in calls)), 60)
        kill()
        codes = await asyncio.wait_for(asyncio.gather(*(c.outcome() for c in calls)), 60)
        assert set(codes) == {grpc.StatusCode.UNAVAILABLE}
        details = [await c.rpc.details() for c in calls]
        assert all(failed in d for d in details), details
        assert (await asyncio.wait_for(watch.read(), 30)).status == health_pb2.HealthCheckResponse.NOT_SERVING
    await asyncio.wait_for(srv.stopped.wait(), 60)
    assert srv.exit_code == EXIT_ENGINE_DEAD


async def assert_denoise_steps_shared(model_dir, model: str, long: dict, short: dict, what: str,
                                      encoders: tuple[str, ...] = ("text-encoder",), edit=None, check=None) -> None:
    """A long and a short diffusion request (`header()` keyword arguments; the short one unguided: one text row
    beside the long one's two) on one denoise stage fed by the `encoders` stages (the example, with `edit` when
    given): the short one joins the long one's steps (batched steps counted), and each ends with the latents it
    gets alone, bit for bit; nothing is held after. `check(stage server)`, when given, runs at the end."""
    from .test_stage_batching import batched_steps
    from .test_stage_cancel import chunk_every_step

    def edited(doc):
        chunk_every_step("denoise")(doc)  # latents after every step show how far it is
        if edit is not None:
            edit(doc)

    pipeline = example(model, edited)
    encs = [await start_stage(pipeline, name, model_dir) for name in encoders]
    den = await start_stage(pipeline, "denoise", model_dir)
    try:
        long_h, short_h = header("long", **long), header("short", **short)

        async def encoded(h):
            return [c for enc in encs for c in await call_stage(enc.port, h)]
        long_emb, short_emb = await encoded(long_h), await encoded(short_h)

        def final(chunks):
            return tensor_of(chunks[-1], "latents")

        long_alone = final(await call_stage(den.port, long_h, long_emb))
        short_alone = final(await call_stage(den.port, short_h, short_emb))
        shared_before = batched_steps(den)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{den.port}") as ch:
            running = Call(ch, long_h, long_emb)
            await wait_until(lambda: len(running.chunks) >= 3, 60, what=f"the long {what} at step 3")
            short_joined = final(await call_stage(den.port, short_h, short_emb))
            assert not running.task.done(), f"the long {what} ended before the short one: they never shared a step"
            long_joined = final(await asyncio.wait_for(running.task, 120))
        assert batched_steps(den) > shared_before
        assert torch.equal(short_joined, short_alone) and torch.equal(long_joined, long_alone)
        await assert_nothing_held(den)
        if check is not None:
            check(den)
    finally:
        for enc in encs:
            await enc.drain()
        await den.drain()
