"""The job runner stopping (a drain, then the replica closing), on a real SQLite store: a claim in flight when it
stops, a job waiting out refusals while it drains, and stop() called twice at once. In each the job ends queued
again, held by nobody, for another replica to claim at once."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest

from omnistage.contract.request import build_request
from orchestrator_service.jobs.api import JobApi, JobSettings
from orchestrator_service.jobs.content import ContentStore
from orchestrator_service.jobs.runner import JobRunner
from orchestrator_service.jobs.sqlite_store import SqliteJobStore
from orchestrator_service.jobs.store import JobStatus
from orchestrator_service.metrics import OrchestratorMetrics
from orchestrator_service.servicer import Refused

from ...polling import wait_until
from .test_job_api_faults import wan

BOUND_S = 60.0  # a safety bound on the runner reaching a state, never a timing


class HeldClaimStore(SqliteJobStore):
    """A real store whose claim transactions, while `hold` is set, wait in the store's thread until `go` is set
    (a slow database): the claim commits after its caller may have stopped waiting for it."""

    def __init__(self, path: Path, pipeline: str):
        super().__init__(path, pipeline)
        self.hold = False
        self.holding = threading.Event()  # a claim is waiting in the store's thread
        self.go = threading.Event()
        self._claiming = False

    async def claim(self, *args, **kw):
        self._claiming = self.hold
        return await super().claim(*args, **kw)

    def _transaction(self, fn, write):
        if self._claiming:
            self._claiming = False
            self.holding.set()
            self.go.wait(BOUND_S)
        return super()._transaction(fn, write)


@pytest.fixture
async def api(tmp_path):
    store = HeldClaimStore(tmp_path / "jobs.db", "wan-t2v-tiny")
    await store.open()
    yield JobApi(wan(), store, ContentStore(tmp_path / "content"), JobSettings(lease_s=3600.0))
    await store.close()


def ask():
    return build_request("a cat", outputs=["video"], width=48, height=32, num_frames=9, fps=12)


def ended(runner: JobRunner, outcome: str) -> float | None:
    return runner.metrics.registry.get_sample_value("omnistage_jobs_ended_total", {"outcome": outcome})


async def test_a_claim_in_flight_when_the_runner_stops_is_released(api, tmp_path):
    """The runner stops while its claim waits on the store; the claim commits after: the job it leased is handed
    back, not left leased to a replica that runs nothing (until its lease ran out)."""
    async def never_called(request):
        raise AssertionError("a job claimed while the runner stops is never run")
        yield

    job = await api.create(ask(), "")
    api.store.hold = True
    runner = JobRunner(api, never_called, OrchestratorMetrics(), tmp_path / "scratch")
    runner.start()
    await wait_until(api.store.holding.is_set, BOUND_S, 0.02, what="the claim waiting on the store")
    stopping = asyncio.create_task(runner.stop())
    await wait_until(lambda: runner._loop is not None and runner._loop.cancelling(), BOUND_S, 0.01,
                     what="the claim loop cancelled")
    api.store.go.set()  # the claim commits after the runner stopped waiting for it
    await asyncio.wait_for(stopping, BOUND_S)
    row = await api.store.get(job.id, "")  # after the claim: the store runs one statement at a time
    assert (row.status, row.lease_owner) == (JobStatus.QUEUED, "")
    assert not runner.runs


async def test_a_job_waiting_out_refusals_is_released_as_soon_as_its_replica_drains(api, tmp_path):
    """A job whose stages have no ready replica waits, retrying; once its replica drains it stops waiting (the
    drain's request path refuses it anyway): the run ends and the job is queued for another replica, without
    holding the drain for its whole bound."""
    tries = 0

    async def unready(request):
        nonlocal tries
        tries += 1
        raise Refused(grpc.StatusCode.UNAVAILABLE, "stage denoise has no ready replica")
        yield

    runner = JobRunner(api, unready, OrchestratorMetrics(), tmp_path / "scratch")
    runner.start()
    try:
        job = await api.create(ask(), "")
        await wait_until(lambda: tries >= 1, BOUND_S, 0.02, what="the job's first try refused")
        runner.stop_claiming()
        await runner.wait_idle(BOUND_S)  # a safety bound: the run ends on its own once the drain began
        assert not runner.runs, "the run still waits out refusals after the drain began"
        row = await api.store.get(job.id, "")
        assert (row.status, row.lease_owner, row.error_code) == (JobStatus.QUEUED, "", "")
        assert "drained" in row.restarted_reason
        assert ended(runner, "taken_over") == 1
    finally:
        await runner.stop()


async def test_stop_called_again_while_the_first_cleans_up_stops_and_releases_each_job_once(api, tmp_path):
    """The drain and then the replica's close both stop the runner: the second call waits on the first's work
    instead of interrupting its cleanup (the run's partial MP4 removed, the run forgotten, the outcome counted)."""
    started = asyncio.Event()

    async def held(request):
        started.set()
        await asyncio.Event().wait()  # runs until stopped
        yield

    runner = JobRunner(api, held, OrchestratorMetrics(), tmp_path / "scratch")
    runner.start()
    job = await api.create(ask(), "")
    await asyncio.wait_for(started.wait(), BOUND_S)
    run = runner.runs[job.id]
    aborting, go = threading.Event(), threading.Event()
    abort = run.mux.abort

    def held_abort():  # the run's cleanup, held on its files thread until the second stop() came
        aborting.set()
        go.wait(BOUND_S)
        abort()
    run.mux.abort = held_abort  # type: ignore[method-assign]
    first = asyncio.create_task(runner.stop())
    await wait_until(aborting.is_set, BOUND_S, 0.01, what="the run's cleanup begun")
    second = asyncio.create_task(runner.stop())
    for _ in range(100):  # loop turns for the second stop() to act (it must not cancel the run again)
        if run.task.cancelling() > 1:
            break
        await asyncio.sleep(0)
    go.set()
    await asyncio.wait_for(asyncio.gather(first, second), BOUND_S)
    assert not runner.runs  # the run's cleanup finished
    assert ended(runner, "taken_over") == 1
    row = await api.store.get(job.id, "")
    assert (row.status, row.lease_owner) == (JobStatus.QUEUED, "")
