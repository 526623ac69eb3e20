"""The job API's doors on a real orchestrator (its gRPC server and HTTP API, a real SQLite store; stages pointing
nowhere: no job runs here, concurrency 0): the gRPC Jobs service behind the same door as Generate (the key read
before the message, Submit's bytes budgeted, the priority checked against the key), its health served, watches
capped per replica, and content swept between its lookup and its answer told as expired content."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnistage.client import build_request
from omnistage.v1 import jobs_pb2, jobs_pb2_grpc, orchestrator_pb2
from orchestrator_service.byte_budget import ByteBudget
from orchestrator_service.jobs.api import JobSettings, owner_of
from orchestrator_service.server import OrchestratorServer

from ..harness import example

PIPELINE = example("wan-t2v-tiny")
KEYS = ("first-key", "second-key:3")
FIRST, SECOND = ((("authorization", "Bearer first-key"),), (("authorization", "Bearer second-key"),))
ASK = dict(prompt="a cat walks on grass", width=48, height=32, num_frames=9, fps=12, outputs=["video"])
CALL_BOUND_S = 60  # a safety bound on one call, never a timing


@contextlib.asynccontextmanager
async def orchestrator(tmp_path):
    orc = OrchestratorServer(PIPELINE, {s.name: ["127.0.0.1:1"] for s in PIPELINE.stages}, api_port=0,
                             api_keys=KEYS, jobs_store=f"sqlite:///{tmp_path}/jobs.db",
                             jobs_settings=JobSettings(concurrency=0))
    await orc.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as channel:
            yield orc, channel
    finally:
        await orc.drain()
        orc.close()


@pytest.fixture
async def served(tmp_path):
    async with orchestrator(tmp_path) as served:
        yield served


async def test_jobs_health_is_served_with_the_orchestrators(served):
    _, channel = served
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("omnistage.v1.Orchestrator", "omnistage.v1.Jobs"):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_BOUND_S)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_a_keyless_submit_is_refused_before_its_message_is_read(served):
    _, channel = served
    submit = channel.unary_unary("/omnistage.v1.Jobs/Submit", request_serializer=lambda b: b,
                                 response_deserializer=jobs_pb2.Job.FromString)
    not_a_message = b"\xff\xff\xff\xff"  # parsed, this fails: the door answers before it would be
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await submit(not_a_message, timeout=CALL_BOUND_S)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:  # with a key the message is read (and found not one)
        await submit(not_a_message, metadata=FIRST, timeout=CALL_BOUND_S)
    assert e.value.code() != grpc.StatusCode.UNAUTHENTICATED


async def test_submit_takes_its_bytes_from_the_requests_budget(served):
    orc, channel = served
    jobs = jobs_pb2_grpc.JobsStub(channel)
    orc.door.budget = ByteBudget(256)  # less than one request with a long prompt holds
    long = jobs_pb2.SubmitJobRequest(request=build_request(**{**ASK, "prompt": "a cat " * 100}))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await jobs.Submit(long, metadata=FIRST, timeout=CALL_BOUND_S)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "request bytes" in e.value.details()
    assert dict(e.value.trailing_metadata())["retry-after"]
    short = await jobs.Submit(jobs_pb2.SubmitJobRequest(request=build_request(**{**ASK, "prompt": "a cat"})),
                              metadata=FIRST, timeout=CALL_BOUND_S)  # within the budget
    assert short.status == jobs_pb2.JOB_QUEUED and orc.door.budget.held == 0  # given back once answered


async def test_submit_checks_the_priority_against_the_key_and_the_job_keeps_it(served):
    orc, channel = served
    jobs = jobs_pb2_grpc.JobsStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await jobs.Submit(jobs_pb2.SubmitJobRequest(request=build_request(**ASK, priority=5)), metadata=FIRST,
                          timeout=CALL_BOUND_S)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "priority 5" in e.value.details()
    assert (await jobs.List(jobs_pb2.ListJobsRequest(), metadata=FIRST, timeout=CALL_BOUND_S)).jobs == []
    job = await jobs.Submit(jobs_pb2.SubmitJobRequest(request=build_request(**ASK, priority=3)), metadata=SECOND,
                            timeout=CALL_BOUND_S)
    assert await orc.jobs.store.get(job.id, owner_of(orc.servicer.api_keys, "Bearer second-key")) is not None
    stored = await orc.jobs.store.claim("a-runner", 10.0, time.time())  # reads leave the request: a claim takes it
    assert stored is not None and stored.id == job.id
    assert orchestrator_pb2.GenerateRequest.FromString(stored.request).priority == 3


async def test_watches_past_the_replicas_cap_are_refused_on_both_doors(served):
    orc, channel = served
    jobs = jobs_pb2_grpc.JobsStub(channel)
    job = await jobs.Submit(jobs_pb2.SubmitJobRequest(request=build_request(**ASK)), metadata=FIRST,
                            timeout=CALL_BOUND_S)
    orc.jobs.api.watches.most = 0
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{orc.api_port}", timeout=CALL_BOUND_S) as http:
        answer = await http.get(f"/v1/videos/{job.id}/events", headers={"Authorization": "Bearer first-key"})
    assert answer.status_code == 429 and answer.headers["retry-after"]
    assert answer.json()["error"]["code"] == "too_many_watches"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in jobs.Watch(jobs_pb2.JobRef(id=job.id), metadata=FIRST, timeout=CALL_BOUND_S):
            pass
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_content_swept_after_it_was_found_is_told_as_expired(served):
    orc, _ = served
    api = orc.jobs.api
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{orc.api_port}", timeout=CALL_BOUND_S,
                                 headers={"Authorization": "Bearer first-key"}) as http:
        created = (await http.post("/v1/videos", json={"prompt": "x", "size": "48x32", "num_frames": 9})).json()
        claimed = await api.store.claim("test-worker", 60.0, time.time())
        assert claimed is not None and claimed.id == created["id"]
        size = await asyncio.to_thread(api.content.put, claimed.id, "video", b"not really an mp4")
        assert await api.store.finish(claimed.id, "test-worker", time.time(), 3600.0, {"video": size})
        found = api.content_of

        async def swept_after_found(*args):  # the TTL sweeper deletes it between the lookup and the answer
            path, media_type = await found(*args)
            await asyncio.to_thread(api.content.delete, claimed.id)
            return path, media_type
        api.content_of = swept_after_found
        answer = await http.get(f"/v1/videos/{claimed.id}/content")
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "video_not_found", answer.text
        api.content_of = found
        assert (await http.get(f"/v1/videos/{claimed.id}/content")).status_code == 404  # as when already gone
