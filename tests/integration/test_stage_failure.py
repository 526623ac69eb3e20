"""Engine failure, injected into real engines (their steps start raising after N good ones): every
affected request ends with an error naming the stage, nothing hangs, and an engine that cannot
recover flips health to NOT_SERVING and stops the server with a non-zero exit code. A request whose
own sampling fails in a batched step fails alone: its neighbours get what they get without it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stage_service.engines.qwen3_omni import steps as qwen3_omni_steps
from stage_service.engines.transformers import lm_steps
from stage_service.runtime.faults import fail_steps
from stage_service.server import EXIT_ENGINE_DEAD

from ..harness import call_stage, example, header, start_stage, tensor_of, token_ids
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


# The one request whose sampling the tests below break; its neighbours use other seeds.
POISON_SEED = 666


def poison_sampling(monkeypatch, module) -> None:
    """Make sampling in `module` fail for real for the request seeded POISON_SEED: its settings get a NaN
    temperature, and torch.multinomial refuses the NaN probabilities. No valid request reaches this (a
    vanishing temperature is greedy, params.MIN_TEMPERATURE), so the test breaks the one request itself."""
    real = module.choose

    def choose(logits, settings, generator):
        if generator is not None and generator.initial_seed() == POISON_SEED:
            settings = dataclasses.replace(settings, temperature=float("nan"))
        return real(logits, settings, generator)

    monkeypatch.setattr(module, "choose", choose)


@contextlib.asynccontextmanager
async def lm_case(model_dir, monkeypatch):
    poison_sampling(monkeypatch, lm_steps)  # the next-token choice of every causal LM step
    srv = await start_stage(llm_transformers(), "llm", model_dir)
    try:
        def request(name, seed):
            return header(name, prompt=f"request {name}", max_tokens=200, ignore_eos=True, temperature=0.9,
                          seed=seed), ()
        yield srv, request, token_ids
    finally:
        await srv.drain()


@contextlib.asynccontextmanager
async def talker_code_predictor_case(model_dir, monkeypatch):
    poison_sampling(monkeypatch, qwen3_omni_steps)  # the residual codes of each frame, sampled as one batch
    pipeline = example("qwen3-omni-tiny")
    thinker = await start_stage(pipeline, "thinker", model_dir)
    srv = await start_stage(pipeline, "talker", model_dir)
    try:
        rows = await call_stage(thinker.port, header(max_tokens=6, ignore_eos=True))

        def request(name, seed):
            return header(name, max_codec_frames=300, temperature=0.9, seed=seed), rows
        yield srv, request, lambda chunks: torch.cat([tensor_of(c, "codes") for c in chunks], 1).tolist()
    finally:
        await srv.drain()
        await thinker.drain()


@pytest.mark.parametrize("case", [lm_case, talker_code_predictor_case], ids=["transformers-lm", "talker"])
async def test_a_request_whose_sampling_fails_fails_alone_and_its_batch_goes_on(model_dir, monkeypatch, case):
    async with case(model_dir, monkeypatch) as (srv, request, result):
        neighbours = [request(f"n{i}", seed=i + 1) for i in range(3)]
        alone = await asyncio.gather(*(call_stage(srv.port, *n, timeout=120) for n in neighbours))
        without = [result(r) for r in alone]
        calls = [asyncio.create_task(call_stage(srv.port, *n, timeout=120)) for n in neighbours]
        await wait_until(lambda: srv.engine.running == 3, 60, what="the 3 neighbours running")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call_stage(srv.port, *request("poison", seed=POISON_SEED), timeout=60)
        assert not any(c.done() for c in calls), "a neighbour ended before the poisoned request: it ran alone"
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not retried: any replica fails it the same
        assert f"stage {srv.stage.name}: this request failed in the engine" in failed.value.details()
        assert "probability tensor contains" in failed.value.details()
        assert [result(r) for r in await asyncio.gather(*calls)] == without
        assert srv.metrics.failed_steps.labels(srv.stage.name)._value.get() == 0
        assert srv.engine.failed is None and await health(srv.port) == health_pb2.HealthCheckResponse.SERVING
        await assert_nothing_held(srv)
