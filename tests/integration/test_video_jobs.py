"""Durable video jobs on the tiny Wan pipeline: real text-encoder, denoise and video VAE stages, real orchestrators
with a real SQLite job store, the HTTP API driven by the openai SDK (its `videos` resource) and the gRPC Jobs
service. A job's video is the video Generate makes for the same request (its thumbnail bit for bit, its MP4 as
H.264 decodes it); a job is its key's alone; refusals name what is wrong; and a replica killed with -9 while it
runs jobs loses none: the other replica takes them over and completes them."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import subprocess
import threading
from pathlib import Path

import av
import grpc
import httpx
import numpy as np
import openai
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image

from omnistage.client import build_request
from omnistage.contract import launch
from omnistage.local.process_group import kill_group, stop_group
from omnistage.v1 import jobs_pb2, jobs_pb2_grpc, orchestrator_pb2_grpc
from orchestrator_service.jobs import open_store
from orchestrator_service.jobs.api import JobSettings
from orchestrator_service.jobs.store import JobStatus
from orchestrator_service.server import OrchestratorServer

from ..conftest import REPO
from ..harness import example, stage_servers_fixture, write_pipeline
from ..polling import wait_until
from ..postgres_server import PostgresServer

MODEL = "wan-t2v-tiny"
PIPELINE = example(MODEL)
KEYS = ("first-key", "second-key")
# A small, quick video: 9 frames (3 latent frames) of 48x32 in 3 denoise steps.
ASK = dict(prompt="a cat walks on grass", size="48x32",
           extra_body={"seed": 11, "num_frames": 9, "fps": 12, "num_inference_steps": 3, "negative_prompt": "blurry"})
GENERATE_ASK = dict(prompt="a cat walks on grass", negative_prompt="blurry", width=48, height=32, num_frames=9,
                    num_inference_steps=3, seed=11, fps=12)
# H.264 at its default quality on the tiny model's frames: a decoded pixel within this many levels on average.
MEAN_ERROR_LEVELS = 12.0
JOB_BOUND_S = 300  # a safety bound on a job of the tiny model completing on a loaded machine, never a timing

servers = stage_servers_fixture(PIPELINE)
# The openai SDK marks its videos resource deprecated (OpenAI's own service ends); its shape is what is served here.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def endpoints(stages) -> dict[str, list[str]]:
    return {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()}


@contextlib.asynccontextmanager
async def orchestrator(stages, tmp_path: Path, pipeline=PIPELINE, **kw):
    orc = OrchestratorServer(pipeline, endpoints(stages), api_port=0, **kw)
    await orc.start(wait_for_stages=60)
    try:
        yield orc
    finally:
        await orc.drain()
        orc.close()


def client(orc, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{orc.api_port}/v1", api_key=key, max_retries=0)


def decode_mp4(data: bytes) -> tuple[np.ndarray, float]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)]), float(stream.average_rate)


async def generated_frames(orc) -> np.ndarray:
    """The frames a Generate call makes for the same request."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        parts = []
        async for ev in stub.Generate(build_request(outputs=["video"], **GENERATE_ASK), timeout=JOB_BOUND_S,
                                      metadata=(("authorization", f"Bearer {KEYS[0]}"),)):
            if ev.WhichOneof("event") == "video":
                v = ev.video
                parts.append(np.frombuffer(v.rgb, np.uint8).reshape(v.count, v.height, v.width, 3))
    return np.concatenate(parts)


def sse_events(orc, key: str, video_id: str) -> list:
    """GET /v1/videos/{id}/events to its end: each event's JSON, and "[DONE]"."""
    out: list = []
    with httpx.stream("GET", f"http://127.0.0.1:{orc.api_port}/v1/videos/{video_id}/events",
                      headers={"Authorization": f"Bearer {key}"}, timeout=JOB_BOUND_S) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def completed(sdk: openai.OpenAI, video_id: str):
    async def done():
        video = await asyncio.to_thread(sdk.videos.retrieve, video_id)
        assert video.status != "failed", video.error
        return video if video.status == "completed" else None
    return await wait_until(done, JOB_BOUND_S, 0.2, what=f"{video_id} completed")


async def test_a_video_job_over_http_is_the_video_generate_makes_and_its_keys_alone(servers, tmp_path):
    store = f"sqlite:///{tmp_path}/jobs.db"
    async with orchestrator(servers, tmp_path, api_keys=KEYS, jobs_store=store) as orc:
        expected = await generated_frames(orc)
        sdk, other = client(orc, KEYS[0]), client(orc, KEYS[1])
        created = await asyncio.to_thread(sdk.videos.create, model=MODEL, **ASK)
        assert created.object == "video" and created.id.startswith("video_") and created.status == "queued"
        assert (created.size, created.model) == ("48x32", MODEL)
        events = await asyncio.to_thread(sse_events, orc, KEYS[0], created.id)
        assert events[-1] == "[DONE]" and events[-2]["type"] == "video.completed"
        assert events[-2]["video"]["progress"] == 100
        kinds = [e["type"] for e in events[:-1]]
        assert set(kinds) <= {"video.queued", "video.in_progress", "video.progress", "video.completed"}, kinds
        progress = [e["video"]["progress"] for e in events[:-1]]
        assert progress == sorted(progress)  # never backwards
        video = await completed(sdk, created.id)
        assert video.progress == 100 and video.completed_at and video.expires_at > video.completed_at
        assert video.seconds == "0.75"  # 9 frames at 12 fps

        mp4 = (await asyncio.to_thread(sdk.videos.download_content, created.id)).read()
        frames, fps = decode_mp4(mp4)
        assert fps == 12 and frames.shape == expected.shape
        assert np.abs(frames.astype(int) - expected.astype(int)).mean() < MEAN_ERROR_LEVELS
        thumb = (await asyncio.to_thread(sdk.videos.download_content, created.id, variant="thumbnail")).read()
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(thumb))), expected[0])  # PNG: exactly frame 0
        sheet = (await asyncio.to_thread(sdk.videos.download_content, created.id, variant="spritesheet")).read()
        assert Image.open(io.BytesIO(sheet)).format == "JPEG"
        preview = await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{orc.api_port}/v1/videos/{created.id}/content",
                                          params={"variant": "preview"},
                                          headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30)
        assert preview.status_code == 200 and preview.headers["content-type"] == "image/webp"
        animated = Image.open(io.BytesIO(preview.content))
        assert animated.is_animated and animated.n_frames == 9 and animated.size == (48, 32)

        listed = await asyncio.to_thread(sdk.videos.list)
        assert [v.id for v in listed.data] == [created.id]
        # Another key sees nothing of it: not in its list, 404 to read, fetch or delete.
        assert (await asyncio.to_thread(other.videos.list)).data == []
        for call in (lambda: other.videos.retrieve(created.id), lambda: other.videos.download_content(created.id),
                     lambda: other.videos.delete(created.id)):
            with pytest.raises(openai.NotFoundError) as e:
                await asyncio.to_thread(call)
            assert e.value.body["code"] == "video_not_found"

        async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as channel:  # the same jobs over gRPC
            jobs = jobs_pb2_grpc.JobsStub(channel)
            got = await jobs.Get(jobs_pb2.JobRef(id=created.id), metadata=(("authorization", f"Bearer {KEYS[0]}"),))
            assert got.status == jobs_pb2.JOB_COMPLETED and got.num_frames == 9
            for metadata, code in (((("authorization", f"Bearer {KEYS[1]}"),), grpc.StatusCode.NOT_FOUND),
                                   ((), grpc.StatusCode.UNAUTHENTICATED)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await jobs.Get(jobs_pb2.JobRef(id=created.id), metadata=metadata)
                assert e.value.code() == code

        deleted = await asyncio.to_thread(sdk.videos.delete, created.id)
        assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "video.deleted")
        with pytest.raises(openai.NotFoundError):
            await asyncio.to_thread(sdk.videos.retrieve, created.id)
        assert not (tmp_path / "content" / created.id).exists()  # its content went with it
        text = orc.metrics.registry.get_sample_value("omnistage_jobs_ended_total", {"outcome": "completed"})
        assert text == 1


async def test_refusals_name_what_is_wrong(servers, tmp_path):
    async with orchestrator(servers, tmp_path) as no_store:
        sdk = client(no_store)
        with pytest.raises(openai.APIStatusError) as e:
            await asyncio.to_thread(sdk.videos.create, model=MODEL, **ASK)
        assert e.value.status_code == 503 and "--jobs-store" in e.value.body["message"]
    # concurrency 0: jobs stay queued (nothing claims them)
    async with orchestrator(servers, tmp_path, jobs_store=f"sqlite:///{tmp_path}/jobs.db",
                            jobs_settings=JobSettings(concurrency=0, max_queued_per_key=2)) as orc:
        sdk = client(orc)
        cases = [
            (dict(prompt="x", seconds="12"), "seconds", "at most 81 frames"),
            (dict(prompt="x", extra_body={"num_frames": 10}), "num_frames", "9 or 13"),
            (dict(prompt="x", seconds="0.7", extra_body={"fps": 100}), "fps", "60"),
            (dict(prompt="x", size="47x32"), "size", None),
            (dict(prompt="x", input_reference=("ref.png", b"\x89PNG", "image/png")), "input_reference",
             "image-to-video"),
            (dict(prompt="x", model="sora-2"), "model", "sora-2"),
        ]
        for kw, param, words in cases:
            with pytest.raises(openai.BadRequestError if param != "model" else openai.NotFoundError) as e:
                await asyncio.to_thread(sdk.videos.create, **kw)
            assert e.value.body["param"] == param, e.value.body
            assert words is None or words in e.value.body["message"], e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            await asyncio.to_thread(sdk.videos.list, after="video_" + "0" * 32)
        assert e.value.body["param"] == "after"
        with pytest.raises(openai.BadRequestError) as e:
            await asyncio.to_thread(sdk.videos.remix, "video_x", prompt="again")
        assert "remix" in e.value.body["message"]

        first = await asyncio.to_thread(sdk.videos.create, **ASK)
        await asyncio.to_thread(sdk.videos.create, **ASK)
        with pytest.raises(openai.RateLimitError) as e:  # the key's queue is full
            await asyncio.to_thread(sdk.videos.create, **ASK)
        assert e.value.response.headers["retry-after"]
        with pytest.raises(openai.ConflictError) as e:  # not finished: no content yet
            await asyncio.to_thread(sdk.videos.download_content, first.id)
        assert "queued" in e.value.body["message"]
        cancelled = await asyncio.to_thread(sdk.post, f"/videos/{first.id}/cancel", cast_to=openai.types.Video)
        assert cancelled.status == "failed" and cancelled.error.code == "cancelled"
        await asyncio.to_thread(sdk.videos.create, **ASK)  # a place in the key's queue again


async def test_grpc_jobs_submit_watch_fetch_list_and_delete(servers, tmp_path):
    async with orchestrator(servers, tmp_path, jobs_store=f"sqlite:///{tmp_path}/jobs.db") as orc:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as channel:
            jobs = jobs_pb2_grpc.JobsStub(channel)
            job = await jobs.Submit(jobs_pb2.SubmitJobRequest(request=build_request(**GENERATE_ASK)))
            assert job.status == jobs_pb2.JOB_QUEUED and (job.width, job.height, job.num_frames) == (48, 32, 9)
            seen = [j async for j in jobs.Watch(jobs_pb2.JobRef(id=job.id), timeout=JOB_BOUND_S)]
            assert seen[-1].status == jobs_pb2.JOB_COMPLETED and seen[-1].progress == 100
            assert [j.progress for j in seen] == sorted(j.progress for j in seen)  # never backwards
            assert sorted(seen[-1].variants) == ["preview", "spritesheet", "thumbnail", "video"]
            chunks = [c async for c in jobs.Fetch(jobs_pb2.FetchRequest(id=job.id))]
            mp4 = b"".join(c.data for c in chunks)
            assert chunks[0].media_type == "video/mp4" and chunks[0].total_bytes == len(mp4)
            assert len(decode_mp4(mp4)[0]) == 9
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await jobs.Submit(jobs_pb2.SubmitJobRequest(request=build_request("x", num_frames=10)))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "9 or 13" in e.value.details()
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            answers = [r async for r in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([ask]), timeout=30)]
            assert "omnistage.v1.Jobs" in {s.name for s in answers[0].list_services_response.service}
            listed = await jobs.List(jobs_pb2.ListJobsRequest())
            assert [j.id for j in listed.jobs] == [job.id] and not listed.has_more
            await jobs.Delete(jobs_pb2.JobRef(id=job.id))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await jobs.Get(jobs_pb2.JobRef(id=job.id))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_cancelling_a_running_job_stops_its_run_and_keeps_no_content(servers, tmp_path):
    released = threading.Event()
    async with orchestrator(servers, tmp_path, jobs_store=f"sqlite:///{tmp_path}/jobs.db") as orc:
        sdk = client(orc)
        with gated_steps(servers["denoise"].engine, released):
            created = await asyncio.to_thread(sdk.videos.create, **ASK)
            await wait_until(lambda: orc.jobs.runner.runs, 120, 0.05, what="the job running")
            cancelled = await asyncio.to_thread(sdk.post, f"/videos/{created.id}/cancel", cast_to=openai.types.Video)
            assert cancelled.status == "failed" and cancelled.error.code == "cancelled"
        await wait_until(lambda: not orc.jobs.runner.runs, 120, 0.05, what="the run stopped")
        assert orc.metrics.registry.get_sample_value("omnistage_jobs_ended_total", {"outcome": "failed"}) == 1
        await wait_until(lambda: not orc.servicer.runs and not servers["denoise"].servicer.inflight, 120, 0.05,
                         what="the request cancelled in every stage")
        assert not (tmp_path / "content" / created.id).exists()
        assert (await asyncio.to_thread(sdk.videos.retrieve, created.id)).status == "failed"


async def test_a_job_the_pipeline_cannot_serve_fails_naming_why(servers, tmp_path):
    impatient = example(MODEL, lambda d: d["spec"]["topology"]["limits"].update(requestTimeoutSeconds=2))
    async with orchestrator(servers, tmp_path, impatient, jobs_store=f"sqlite:///{tmp_path}/jobs.db") as orc:
        orc.router.set_endpoints("vae-decode", [])  # its replicas gone, as a Service without endpoints
        sdk = client(orc)
        created = await asyncio.to_thread(sdk.videos.create, **ASK)

        async def failed():
            video = await asyncio.to_thread(sdk.videos.retrieve, created.id)
            return video if video.status == "failed" else None
        video = await wait_until(failed, 120, 0.2, what="the job failed")  # after 2 s of waiting it out
        assert video.error.code == "unavailable" and "vae-decode has no replicas" in video.error.message
        assert orc.metrics.registry.get_sample_value("omnistage_jobs_ended_total", {"outcome": "failed"}) == 1
        assert not (tmp_path / "content" / created.id).exists()


async def test_a_finished_job_past_its_ttl_is_swept_with_its_content(servers, tmp_path):
    async with orchestrator(servers, tmp_path, jobs_store=f"sqlite:///{tmp_path}/jobs.db",
                            jobs_settings=JobSettings(ttl_s=0.0)) as orc:
        sdk = client(orc)
        created = await asyncio.to_thread(sdk.videos.create, **ASK)
        await completed(sdk, created.id)
        assert (tmp_path / "content" / created.id / "video").exists()
        await orc.jobs.runner.sweep()
        assert not (tmp_path / "content" / created.id).exists()
        with pytest.raises(openai.NotFoundError):
            await asyncio.to_thread(sdk.videos.retrieve, created.id)


async def test_a_draining_replica_hands_its_running_job_back_and_the_next_replica_completes_it(servers, tmp_path):
    """A replica drained while it runs a job stops the run and releases the job: queued again at once, saying why,
    and the next replica claims and completes it. Its lease lasts an hour here: a job left to its lease running out
    would not run again within the test."""
    url = f"sqlite:///{tmp_path}/jobs.db"
    settings = JobSettings(lease_s=3600.0)
    released = threading.Event()
    store = open_store(url, pipeline=PIPELINE.name)
    try:
        async with orchestrator(servers, tmp_path, jobs_store=url, jobs_settings=settings, drain_seconds=0.0) as first:
            with gated_steps(servers["denoise"].engine, released):
                created = await asyncio.to_thread(client(first).videos.create, **ASK)
                await wait_until(lambda: first.jobs.runner.runs, 120, 0.05, what="the job running")
                worker = first.jobs.runner.worker
                await first.drain()  # its bound (0 s) passes with the job mid-denoise: stopped
                job = await store.get(created.id, "")
                assert (job.status, job.lease_owner, job.attempts) == (JobStatus.QUEUED, "", 0)  # not an attempt
                assert f"orchestrator {worker} drained" in job.restarted_reason
                assert first.metrics.registry.get_sample_value("omnistage_jobs_ended_total",
                                                               {"outcome": "taken_over"}) == 1
        async with orchestrator(servers, tmp_path, jobs_store=url, jobs_settings=settings) as second:
            video = await completed(client(second), created.id)
            assert video.progress == 100
            done = await store.get(created.id, "")
            assert (done.attempts, done.restarted_reason) == (1, job.restarted_reason)
            assert done.lease_owner == second.jobs.runner.worker and done.content["video"] > 0
    finally:
        released.set()
        await store.close()


# ------------------------------------------------------------------ the store unreachable

async def test_store_down_refuses_creation_with_retry_after_and_a_running_job_finishes_once_it_is_back(
        servers, tmp_path):
    postgres = PostgresServer()
    released = threading.Event()
    try:
        await asyncio.to_thread(postgres.start)
        url = await asyncio.to_thread(postgres.create_database)
        async with orchestrator(servers, tmp_path, jobs_store=url, jobs_content=str(tmp_path / "videos"),
                                jobs_settings=JobSettings(lease_s=2.0)) as orc:
            sdk = client(orc)
            with gated_steps(servers["denoise"].engine, released):
                created = await asyncio.to_thread(sdk.videos.create, **ASK)

                async def running():
                    return (await asyncio.to_thread(sdk.videos.retrieve, created.id)).status == "in_progress"
                await wait_until(running, 120, 0.1, what="the job running")
                await asyncio.to_thread(postgres.stop)
                leased_until = orc.jobs.api.clock() + 2.0  # at most: renewed at most now, for lease_s
                for call in (lambda: sdk.videos.create(**ASK), lambda: sdk.videos.retrieve(created.id)):
                    with pytest.raises(openai.APIStatusError) as e:
                        await asyncio.to_thread(call)
                    assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
                    assert "job store is unreachable" in e.value.body["message"]
            # The run goes on without the store: its content is put, its finish waits for the store.
            video_file = tmp_path / "videos" / created.id / "video"
            await wait_until(video_file.exists, JOB_BOUND_S, 0.1, what="the video put while the store is down")
            # The outage outlasts the lease: back, the replica renews its own lease before it claims anything, so
            # it never takes its own running job for a dead replica's.
            await wait_until(lambda: orc.jobs.api.clock() > leased_until, 60, 0.1, what="the lease lapsed")
            await asyncio.to_thread(postgres.start)
            video = await completed(sdk, created.id)
            assert video.progress == 100 and video.attempts == 1  # not restarted: finished by its own run
            mp4 = (await asyncio.to_thread(sdk.videos.download_content, created.id)).read()
            assert mp4 == video_file.read_bytes()
    finally:
        released.set()
        await asyncio.to_thread(postgres.remove)


# ------------------------------------------------------------------ flags

def test_a_postgresql_store_without_a_content_folder_refuses_to_start_naming_the_flag(tmp_path):
    argv = launch.orchestrator_command(write_pipeline(PIPELINE, tmp_path / f"{MODEL}.yaml"), port=0,
                                       stage_endpoints={s.name: ["127.0.0.1:1"] for s in PIPELINE.stages},
                                       jobs_store="postgresql://jobs:secret@127.0.0.1:1/jobs")
    done = subprocess.run(argv, cwd=REPO, env={**os.environ, **launch.service_env()}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "orchestrator: --jobs-content is needed" in done.stderr, done.stderr
    assert "secret" not in done.stderr


# ------------------------------------------------------------------ two replicas, one killed

@contextlib.contextmanager
def gated_steps(engine, released: threading.Event):
    """Within the scope, the stage's steps wait until `released` is set (a safety bound only)."""
    step = engine.scheduler.step_fn

    def gated(batch):
        released.wait(timeout=JOB_BOUND_S)
        return step(batch)
    engine.scheduler.step_fn = gated
    try:
        yield
    finally:
        released.set()
        engine.scheduler.step_fn = step


class OrchestratorProcess:
    """An orchestrator replica as a real process (`python -m orchestrator_service`), for a test that kills it."""

    def __init__(self, tmp_path: Path, tag: str, stages, **flags):
        pipeline_file = write_pipeline(PIPELINE, tmp_path / f"{MODEL}.yaml")
        self.ready_file, self.log = tmp_path / f"{tag}.ready", tmp_path / f"{tag}.log"
        argv = launch.orchestrator_command(pipeline_file, port=0, ready_file=self.ready_file,
                                           stage_endpoints=endpoints(stages), **flags)
        self.proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **launch.service_env()},
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    async def ready(self) -> launch.ReadyPorts:
        """Its ports once it serves (polled: the stages it waits for answer on this test's event loop)."""
        def ready():
            assert self.proc.poll() is None, self.log.read_text()
            return launch.read_ready(self.ready_file)
        return await wait_until(ready, 120, 0.05, what="orchestrator ready", detail=self.log.read_text)

    def kill(self) -> None:
        kill_group(self.proc)

    def stop(self) -> None:
        stop_group(self.proc)


async def test_a_replica_killed_while_running_jobs_loses_none(servers, tmp_path):
    url = f"sqlite:///{tmp_path}/jobs.db"
    store = open_store(url, pipeline=PIPELINE.name)
    await store.open()
    released = threading.Event()
    # 10 s leases: the takeover waits one out (~10 s), and a replica's renewals (every second) stalled on busy
    # cores would have to miss ten in a row for a live run to be taken over (attempt 3: restarted_too_often).
    flags = dict(jobs_store=url, jobs_lease_s=10.0, jobs_concurrency=2, wait_for_stages=60)
    first = OrchestratorProcess(tmp_path, "first", servers, **flags)
    second = None
    try:
        with gated_steps(servers["denoise"].engine, released):
            ports = await first.ready()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
                jobs = jobs_pb2_grpc.JobsStub(channel)
                ids = [(await jobs.Submit(jobs_pb2.SubmitJobRequest(request=build_request(**GENERATE_ASK)))).id
                       for _ in range(2)]

            async def both_running_on_first():
                held = [await store.get(i, "") for i in ids]
                return held if all(j.status == JobStatus.IN_PROGRESS for j in held) else None
            held = await wait_until(both_running_on_first, 120, 0.1, what="the first replica running both jobs")
            victim = held[0].lease_owner
            assert victim and {j.lease_owner for j in held} == {victim}

            second = OrchestratorProcess(tmp_path, "second", servers, **flags)
            await second.ready()
            first.kill()  # kill -9: no drain, no goodbye; its leases just stop being renewed
            released.set()

            async def all_finished():
                done = [await store.get(i, "") for i in ids]
                return done if all(j.status in (JobStatus.COMPLETED, JobStatus.FAILED) for j in done) else None
            done = await wait_until(all_finished, JOB_BOUND_S, 0.2, what="both jobs finished on the second replica")
            why = [(j.error_code, j.error_message) for j in done]
            assert [j.status for j in done] == [JobStatus.COMPLETED] * 2, why
            for j in done:  # lost = 0: each restarted once, from the start, saying whose lease ran out
                assert j.attempts == 2 and j.lease_owner != victim
                assert victim in j.restarted_reason and "restarted from the start" in j.restarted_reason
                assert j.content["video"] > 0
    finally:
        first.kill()
        if second is not None:
            await asyncio.to_thread(second.stop)
        await store.close()
