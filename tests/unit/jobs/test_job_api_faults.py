"""The job API and runner where things go wrong between two steps, on a real SQLite store: a store call that fails
unexpectedly (the runner keeps claiming and renewing), a list cursor deleted between its check and the page, a
video deleted while it is watched (the SSE stream ends with an error event), watchers of one job sharing its
reads and capped per replica, and a Submit whose label or media the pipeline cannot take."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import yaml

from omnistage.api import parse_pipeline
from omnistage.contract.request import build_request
from omnistage.v1 import common_pb2, orchestrator_pb2
from orchestrator_service.http_api import videos
from orchestrator_service.jobs import api as job_api
from orchestrator_service.jobs.api import JobApi, JobSettings
from orchestrator_service.jobs.content import ContentStore
from orchestrator_service.jobs.runner import JobRunner
from orchestrator_service.jobs.sqlite_store import SqliteJobStore
from orchestrator_service.jobs.store import JobStatus
from orchestrator_service.metrics import OrchestratorMetrics
from orchestrator_service.servicer import Refused

from ...conftest import EXAMPLES
from ...polling import wait_until

BOUND_S = 60.0  # a safety bound on the runner reaching a state, never a timing


def wan():
    return parse_pipeline(yaml.safe_load((EXAMPLES / "wan-t2v-tiny.yaml").read_text()))


class FaultyStore(SqliteJobStore):
    """A real store whose named calls raise an unexpected error the first `faults[name]` times; `on_get` runs after
    each get (to change the store between two steps of a caller); counts its calls."""

    def __init__(self, path: Path, pipeline: str):
        super().__init__(path, pipeline)
        self.faults: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.on_get = None
        self.gate: asyncio.Event | None = None  # set: gets wait on it (counted in `waiting`)
        self.waiting = 0

    def _fault(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.faults.get(name, 0) > 0:
            self.faults[name] -= 1
            raise RuntimeError(f"unexpected {name} failure")

    async def claim(self, *args, **kw):
        self._fault("claim")
        return await super().claim(*args, **kw)

    async def renew(self, *args, **kw):
        self._fault("renew")
        return await super().renew(*args, **kw)

    async def get(self, job_id: str, owner: str):
        self._fault("get")
        if self.gate is not None:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        job = await super().get(job_id, owner)
        if self.on_get is not None:
            await self.on_get(job_id, owner)
        return job


@pytest.fixture
async def api(tmp_path):
    store = FaultyStore(tmp_path / "jobs.db", "wan-t2v-tiny")
    await store.open()
    yield JobApi(wan(), store, ContentStore(tmp_path / "content"), JobSettings(lease_s=10.0))
    await store.close()


def ask(**kw):
    return build_request("a cat", outputs=["video"], width=48, height=32, num_frames=9, fps=12, **kw)


async def refusing_generate(request):
    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "refused by this test's request path")
    yield  # an async generator, as the servicer's generate


async def test_an_unexpected_claim_error_does_not_stop_the_runner_claiming(api, tmp_path):
    api.store.faults["claim"] = 1
    runner = JobRunner(api, refusing_generate, OrchestratorMetrics(), tmp_path / "scratch")
    runner.start()
    try:
        await wait_until(lambda: api.store.calls.get("claim", 0) >= 1, BOUND_S, 0.02, what="the faulty claim")
        job = await api.create(ask(), "")

        async def ran():
            return (await api.store.get(job.id, "")).status == JobStatus.FAILED
        await wait_until(ran, BOUND_S, 0.05, what="the job claimed and run after the fault")
        assert (await api.store.get(job.id, "")).error_code == "invalid_request"
    finally:
        await runner.stop()


async def test_an_unexpected_renew_error_does_not_stop_the_lease_being_kept(api, tmp_path):
    api.store.faults["renew"] = 1
    release = asyncio.Event()

    async def held_generate(request):
        await release.wait()
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "released by this test")
        yield

    runner = JobRunner(api, held_generate, OrchestratorMetrics(), tmp_path / "scratch")
    runner.start()
    try:
        await api.create(ask(), "")
        await wait_until(lambda: api.store.calls.get("renew", 0) >= 2, BOUND_S, 0.05,
                         what="a renewal after the faulty one")
    finally:
        release.set()
        await runner.stop()


async def test_a_list_cursor_deleted_between_its_check_and_the_page_is_an_unknown_cursor(api):
    first = await api.create(ask(), "")

    async def delete_it(job_id, owner):
        api.store.on_get = None
        await api.store.delete(job_id, owner)
    api.store.on_get = delete_it
    with pytest.raises(Refused) as e:
        await api.list("", first.id, None, None)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.param == "after"


async def test_a_video_deleted_while_watched_ends_its_event_stream_with_an_error_event(api, monkeypatch):
    monkeypatch.setattr(job_api, "WATCH_POLL_S", 0.0)
    job = await api.create(ask(), "")
    watch = api.watch(job.id, "")
    first = await anext(watch)
    events = videos._sse(first, watch)
    assert json.loads((await anext(events)).decode().removeprefix("data: "))["type"] == "video.queued"
    await api.delete(job.id, "")
    rest = [e.decode() async for e in events]  # ends, no exception
    assert len(rest) == 1 and "[DONE]" not in rest[0], rest
    error = json.loads(rest[0].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["code"] == "video_not_found"


async def test_watchers_of_one_job_share_its_reads(api, monkeypatch):
    """Five watchers of one job: between two snapshots, one read of the store, not five."""
    monkeypatch.setattr(job_api, "WATCH_POLL_S", 0.0)
    job = await api.create(ask(), "")
    watches = [api.watch(job.id, "") for _ in range(5)]
    for w in watches:
        assert (await anext(w)).id == job.id
    nexts = [asyncio.ensure_future(anext(w)) for w in watches]
    api.store.gate = asyncio.Event()
    for _ in range(200):  # every watcher's poll reaches the store (no clock: each sleep is 0 s)
        await asyncio.sleep(0)
    assert api.store.waiting == 1
    claimed = await api.store.claim("test-worker", 60.0, api.clock())
    assert claimed is not None and claimed.id == job.id
    api.store.gate.set()
    seen = await asyncio.gather(*nexts)
    assert [j.status for j in seen] == [JobStatus.IN_PROGRESS] * 5
    for w in watches:
        await w.aclose()
    assert not api.watches.feeds and api.watches.watchers == 0


async def test_watchers_past_the_replicas_cap_are_refused(api, monkeypatch):
    api.watches.most = 2
    job = await api.create(ask(), "")
    held = [api.watch(job.id, "") for _ in range(2)]
    for w in held:
        await anext(w)
    with pytest.raises(Refused) as e:
        await anext(api.watch(job.id, ""))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.retry_after_s
    await held[0].aclose()
    again = api.watch(job.id, "")
    assert (await anext(again)).id == job.id  # a place once one closed
    await again.aclose()
    await held[1].aclose()


async def test_a_submit_with_a_bad_label_or_media_for_a_text_to_video_pipeline_is_refused_naming_the_field(api):
    with pytest.raises(Refused) as e:
        await api.create(ask(request_id="has space"), "")
    assert (e.value.code, e.value.param) == (grpc.StatusCode.INVALID_ARGUMENT, "request_id")
    with_image = ask()
    with_image.params.parts.append(common_pb2.ContentPart(image=common_pb2.ImagePart(data=b"\x89PNG")))
    with pytest.raises(Refused) as e:
        await api.create(with_image, "")
    assert (e.value.code, e.value.param) == (grpc.StatusCode.INVALID_ARGUMENT, "params.parts")
    assert "text-to-video" in e.value.message
    job = await api.create(ask(request_id="my-label"), "")
    assert orchestrator_pb2.GenerateRequest.FromString(job.request).request_id == job.id  # the run's label
