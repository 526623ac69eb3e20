"""Engine failure, injected into real engines (their steps start raising after N good ones): every
affected request ends with an error naming the stage, nothing hangs, and an engine that cannot
recover flips health to NOT_SERVING and stops the server with a non-zero exit code."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stage_service.engines.faults import fail_steps
from stage_service.server import EXIT_ENGINE_DEAD

from ..harness import call_stage, example, header, start_stage
from ..polling import wait_until
from .test_stage_cancel import embeddings_chunk, llm_transformers
from .test_stage_support import assert_nothing_held, health, scheduler


def small_batches(pipeline_name: str, stage: str):
    return example(pipeline_name, scheduler(stage, max_batch=4, max_queued=64))


def lm_stage():
    def edit(doc):
        doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
        scheduler("llm", max_batch=4, max_queued=64)(doc)
    return example("llm-tiny", edit), "llm", {"max_tokens": 60, "ignore_eos": True}, ()


def denoise_stage():
    return (small_batches("text-to-image-tiny", "denoise"), "denoise",
            {"num_inference_steps": 30, "width": 32, "height": 32}, (embeddings_chunk(),))


@pytest.mark.parametrize("case", [lm_stage, denoise_stage], ids=["transformers-lm", "denoise"])
async def test_a_broken_engine_fails_every_request_flips_health_and_stops(model_dir, case):
    pipeline, stage, params, chunks = case()
    srv = await start_stage(pipeline, stage, model_dir)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            calls = [asyncio.create_task(call_stage(srv.port, header(f"r{i}", **params), chunks, timeout=60))
                     for i in range(16)]
            await wait_until(lambda: srv.engine.unfinished() == 16, 30, what="16 requests admitted")  # 4 run, 12 wait
            fail_steps(srv.engine, after=2)  # from the third step on, every step raises: a device that broke
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)
            assert all(isinstance(r, grpc.aio.AioRpcError) for r in results), results
            assert {r.code() for r in results} <= {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}
            assert all(f"stage {stage}" in r.details() for r in results)
            # 3 failed steps fail the 3 batches in them (INTERNAL); then the engine is dead, the rest UNAVAILABLE
            dead = [r for r in results if "engine failed for good" in r.details()]
            assert len(dead) == 4 and {r.code() for r in dead} == {grpc.StatusCode.UNAVAILABLE}
            assert (await asyncio.wait_for(watch.read(), 10)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.wait_for(srv.stopped.wait(), 30)
        assert srv.exit_code == EXIT_ENGINE_DEAD and srv.engine.failed is not None
        assert srv.engine.unfinished() == 0 and srv.engine.held_bytes() == 0
    finally:
        await srv.drain()


async def test_one_failed_step_fails_its_batch_and_the_engine_serves_on(model_dir):
    srv = await start_stage(llm_transformers(), "llm", model_dir)
    try:
        batch = [asyncio.create_task(call_stage(srv.port, header(f"r{i}", max_tokens=250, ignore_eos=True), timeout=60))
                 for i in range(4)]
        await wait_until(lambda: srv.engine.running == 4, 30, what="4 requests running")
        fail_steps(srv.engine, after=0, count=1)  # the next step, which all 4 share, raises once
        results = await asyncio.wait_for(asyncio.gather(*batch, return_exceptions=True), 60)
        assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.INTERNAL for r in results)
        assert all("stage llm: engine failed (step failed: InjectedFault" in r.details() for r in results)
        out = await call_stage(srv.port, header("after", max_tokens=5, ignore_eos=True))
        assert out[-1].end_of_stream and out[-1].finish_reason == "length"
        assert await health(srv.port) == health_pb2.HealthCheckResponse.SERVING and srv.engine.failed is None
        assert srv.metrics.failed_steps.labels("llm")._value.get() == 1
        await assert_nothing_held(srv)
    finally:
        await srv.drain()
