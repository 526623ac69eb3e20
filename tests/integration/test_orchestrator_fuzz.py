"""Fuzz the client API: any field values, sizes, enums, missing fields. Every call ends OK or
INVALID_ARGUMENT, the service stays healthy, and memory stays flat."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnistage.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator_service.server import OrchestratorServer

from ..fuzz_memory import second_pass_growth
from ..harness import small_lm, start_stage

MAX_PRIORITY = 1000
LM_LIMITS = {"defaultMaxTokens": 2, "maxTokens": 4, "maxPromptChars": 256, "maxInferenceSteps": 4, "maxImageSide": 64,
             "maxCodecFrames": 8, "defaultCodecFrames": 4, "defaultInferenceSteps": 2, "defaultImageSide": 32}
LM_ORCHESTRATOR = {"maxPriority": MAX_PRIORITY}


u32 = st.one_of(st.just(0), st.integers(0, 8), st.integers(0, 2 ** 32 - 1))
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
text = st.text(max_size=300)

requests = st.builds(
    lambda prompt, ids, seed, max_tokens, temp, top_p, top_k, frames, speaker, w, h, steps, guide, neg, outs, trace,
    prio, rid: orchestrator_pb2.GenerateRequest(
        request_id=rid, priority=prio, return_trace=trace, outputs=outs,
        params=common_pb2.GenerationParams(
            prompt=prompt, prompt_token_ids=ids, **({"seed": seed} if seed is not None else {}),
            text=common_pb2.TextParams(max_tokens=max_tokens, **({"temperature": temp} if temp is not None else {}),
                                       **({"top_p": top_p} if top_p is not None else {}),
                                       **({"top_k": top_k} if top_k is not None else {})),
            audio=common_pb2.AudioParams(max_codec_frames=frames, speaker=speaker),
            image=common_pb2.ImageParams(width=w, height=h, num_inference_steps=steps, negative_prompt=neg,
                                         **({"guidance_scale": guide} if guide is not None else {})))),
    text, st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), max_size=8), st.none() | st.integers(0, 2 ** 64 - 1),
    u32, st.none() | floats, st.none() | floats, st.none() | u32, u32, st.text(max_size=80), u32, u32, u32,
    st.none() | floats, st.text(max_size=20), st.lists(st.integers(0, 6), max_size=4), st.booleans(),
    st.integers(-2 ** 31, 2 ** 31 - 1), st.text(max_size=200))


@pytest.fixture(scope="module")
async def service(model_dir):
    pipeline = small_lm(LM_LIMITS, LM_ORCHESTRATOR)
    stage = await start_stage(pipeline, "llm", model_dir)
    orc = OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]})
    await orc.start(wait_for_stages=30)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}")
    yield orchestrator_pb2_grpc.OrchestratorStub(channel), channel
    await channel.close()
    await orc.drain()
    await stage.drain()


async def test_fuzzed_requests_end_ok_or_invalid_argument(service):
    stub, channel = service
    loop = asyncio.get_running_loop()
    outcomes = {"ok": 0, "invalid": 0}

    async def call(req):
        try:
            events = [ev async for ev in stub.Generate(req, timeout=60)]
            assert events[-1].WhichOneof("event") == "final"
            outcomes["ok"] += 1
        except grpc.aio.AioRpcError as e:
            if req.priority > MAX_PRIORITY:  # checked first, at the front door
                assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "priority" in e.details(), (e, req)
            else:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), req)
                assert e.details() and ":" in e.details()  # names the field
            outcomes["invalid"] += 1

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests)
    def run(req):
        asyncio.run_coroutine_threadsafe(call(req), loop).result(120)

    growth = await second_pass_growth(run)
    assert outcomes["ok"] > 0 and outcomes["invalid"] > 0
    assert growth < 64 << 20, f"memory grew {growth >> 20} MiB over the second fuzz pass"
    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
