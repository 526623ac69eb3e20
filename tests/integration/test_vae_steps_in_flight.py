"""The VAE stage with its decode in an engine process keeps a second decode in flight: the core decodes the
next batch while the stage process encodes this one's PNGs. Each image is the one the stage process makes,
whatever batch and step it went in; the child's death with decodes out fails their calls cleanly."""

from __future__ import annotations

import asyncio

import grpc
import psutil
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stage_service.server import EXIT_ENGINE_DEAD

from ..harness import call_stage, example, header, start_stage, tensor_of
from ..polling import wait_until
from .test_diffusion_stages import latents_chunk
from .test_stage_support import Call, assert_nothing_held, scheduler

# Latents of 32x32 take the tiny VAE about 10 ms a batch of two on one core, far longer than the stage
# process needs to send the next batch: the second decode goes out while the first runs.
SIDE = 32


def vae_in_engine_process(max_batch: int):
    """text-to-image-tiny with its VAE decode in an engine process, `max_batch` images a decode."""
    def edit(doc):
        doc["spec"]["deployment"]["stages"]["vae-decode"].setdefault("engineArgs", {})["engine_process"] = True
        scheduler("vae-decode", max_batch=max_batch)(doc)
    return example("text-to-image-tiny", edit)


async def test_two_decodes_in_flight_give_each_request_its_own_png(model_dir):
    inproc = await start_stage(example("text-to-image-tiny"), "vae-decode", model_dir)
    remote = await start_stage(vae_in_engine_process(max_batch=2), "vae-decode", model_dir)
    try:
        requests = [(header(f"r{i}"), [latents_chunk(200 + i, SIDE, SIDE)]) for i in range(24)]
        got = await asyncio.gather(*(call_stage(remote.port, *r) for r in requests))
        core = remote.engine.core
        assert core.peak_in_flight == 2 and core.steps_sent >= 12  # two batches were out at once, never three
        want = await asyncio.gather(*(call_stage(inproc.port, *r) for r in requests))
        for i, (w, g) in enumerate(zip(want, got)):
            assert torch.equal(tensor_of(g[0], "image"), tensor_of(w[0], "image")), f"request {i}"
        await assert_nothing_held(remote)
        assert core.in_flight == 0
        assert await remote.engine.scheduler.run_on_worker(core.stats) == (0, 0)
    finally:
        await remote.drain()
        await inproc.drain()


async def test_the_child_dying_with_two_decodes_out_fails_their_calls_and_ends_the_stage(model_dir):
    srv = await start_stage(vae_in_engine_process(max_batch=2), "vae-decode", model_dir)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            # 64x64 latents: about 80 ms a batch of two, so the burst keeps two decodes out for seconds
            calls = [Call(ch, header(f"d{i}"), [latents_chunk(300 + i, 64, 64)]) for i in range(24)]
            core = srv.engine.core
            await wait_until(lambda: core.in_flight == 2, 120, interval=0.005, what="two decodes in flight")
            psutil.Process(core._proc.pid).kill()
            codes = await asyncio.wait_for(asyncio.gather(*(c.outcome() for c in calls)), 120)
            failed = [c for code, c in zip(codes, calls) if code != grpc.StatusCode.OK]
            assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
            assert len(failed) >= 4  # at least the two batches that were out
            details = [await c.rpc.details() for c in failed]
            assert sum("the engine process exited" in d for d in details) >= 4, details
            assert (await asyncio.wait_for(watch.read(), 30)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.wait_for(srv.stopped.wait(), 60)
        assert srv.exit_code == EXIT_ENGINE_DEAD
    finally:
        await srv.drain()
