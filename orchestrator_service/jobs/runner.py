"""Runs jobs on this replica: claims them from the store (at most `concurrency` at once), runs each down the
orchestrator's own request path (`OrchestratorServicer.generate`: the same validation, admission and stage walk
as a Generate call), muxes its frames into the MP4 as they arrive, keeps its lease (with its progress) renewed,
and puts the content and finishes the job.

A job whose lease this replica loses (taken over after a stall, cancelled, deleted) is stopped at the next
renewal. A replica that dies stops renewing: once its leases run out another replica's claim takes its jobs and
runs them again from the start. A replica that drains hands the jobs it stops back to the store (`release`), so
another replica claims them at once instead of once their leases run out. With the store unreachable a run goes
on; its finish is retried until the store is back (the content is in the content folder by then). Finished jobs
past their TTL are swept here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncGenerator, Callable, TypeVar

import grpc
import numpy as np

from omnistage.v1 import orchestrator_pb2

from ..metrics import OrchestratorMetrics
from ..servicer import Refused
from .api import JobApi
from .mux import VideoMux
from .store import FINISHED, Job, JobStatus, StoreUnavailable

log = logging.getLogger("omnistage.orchestrator.jobs")

CLAIM_POLL_S = 1.0  # idle: how often the store is asked for work (jobs queued on other replicas, expired leases)
RENEW_S = 1.0       # a running job's lease and progress are written this often (the lease lasts --jobs-lease-s)
SWEEP_S = 60.0      # how often finished jobs past their TTL are deleted, with their content
SWEEP_BATCH = 100   # expired jobs deleted per sweep: a backlog goes over several sweeps
# How long a drain waits for the store to take back the jobs it stopped: each release is one short statement; a
# store that cannot answer in this long is down, and those jobs' leases run out instead (--jobs-lease-s).
RELEASE_BOUND_S = 5.0
STORE_RETRY_S = 1.0  # a finish (or fail) the store could not take is tried again this often until it can
# Refusals a job waits out rather than fails on: the pipeline full (admission), a stage without a ready replica
# (restarting). Retried while no frame came yet, until the pipeline's requestTimeoutSeconds has passed.
RETRIED = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
RETRY_S = 1.0
DEFAULT_PATIENCE_S = 600.0  # how long refusals are waited out where the pipeline sets no request timeout
# The share of a job's progress its denoise steps stand for; the decoded frames are the rest.
DENOISE_SHARE = 90
# A job's error codes, by the refusal that ended it.
ERROR_CODES = {grpc.StatusCode.INVALID_ARGUMENT: "invalid_request", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
               grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded", grpc.StatusCode.UNAVAILABLE: "unavailable"}

T = TypeVar("T")


class _Drained(Exception):
    """A job waiting out refusals when its replica began to drain: it stops waiting, to be released at once (the
    draining replica's request path refuses it anyway)."""
Generate = Callable[[orchestrator_pb2.GenerateRequest], AsyncGenerator[orchestrator_pb2.GenerateResponse, None]]


def worker_name() -> str:
    """This replica's name in leases: its host (the pod's name on a cluster), process and a random tail."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def percent(steps_done: int, steps_total: int, frames: int, total_frames: int) -> int:
    """A running job's progress (pure): its denoise steps are DENOISE_SHARE of it, its decoded frames the rest;
    99 at most until it is finished."""
    steps = DENOISE_SHARE * steps_done / steps_total if steps_total else 0.0
    decoded = (100 - DENOISE_SHARE) * frames / total_frames if total_frames else 0.0
    return max(0, min(99, int(steps + decoded)))


@dataclass
class _Run:
    """One job's run on this replica. Its file work (muxing, putting content, removing it) goes through one
    thread of its own, in order: a step cancelled on the loop still finishes on that thread before the next one
    (the removal of the partial MP4 never runs under the encoder)."""

    job: Job
    mux: VideoMux
    files: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "job-files"), repr=False)
    steps: tuple[int, int] = (0, 0)
    frames: int = 0
    lost: str = ""  # why it was stopped from outside: its lease lost, cancelled or deleted
    task: asyncio.Task | None = field(default=None, repr=False)      # the whole run
    produce: asyncio.Task | None = field(default=None, repr=False)   # its request and muxing

    @property
    def progress(self) -> int:
        return percent(*self.steps, self.frames, int(self.job.meta.get("num_frames", 0)))

    async def io(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.files, fn, *args)


class JobRunner:
    def __init__(self, api: JobApi, generate: Generate, metrics: OrchestratorMetrics, scratch: Path,
                 worker: str | None = None, patience_s: float | None = None):
        """`generate`: the request path (the servicer's `generate`); `scratch`: a folder on this host where MP4s
        grow (copied into the content folder once whole); `patience_s`: how long refusals are waited out
        (RETRIED)."""
        assert api.store is not None and api.content is not None
        self.api, self.store, self.content = api, api.store, api.content
        self.generate, self.metrics, self.scratch = generate, metrics, scratch
        self.worker = worker or worker_name()
        self.patience_s = patience_s or DEFAULT_PATIENCE_S
        self.runs: dict[str, _Run] = {}
        self._wake = asyncio.Event()
        self._draining = asyncio.Event()  # claiming stopped: runs waiting out refusals give up their jobs
        self._loop: asyncio.Task | None = None
        self._stopping: asyncio.Task | None = None  # stop()'s work, shared by every caller
        api.on_created = self._wake.set
        api.on_stopped = self.stop_job

    def start(self) -> None:
        self.scratch.mkdir(parents=True, exist_ok=True)
        self._loop = asyncio.create_task(self._claim_loop(), name="jobs-runner")

    def stop_claiming(self) -> None:
        self._draining.set()
        if self._loop is not None:
            self._loop.cancel()

    async def wait_idle(self, bound: float) -> None:
        """Until no job runs here, at most `bound` seconds."""
        tasks = [r.task for r in self.runs.values() if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=bound)

    async def stop(self) -> None:
        """No more claims; the jobs running here are stopped and released: queued again, for another replica (or
        this one restarted) to claim at once. One the store does not take back (down, or no longer this
        replica's) is left to its lease running out. Called again (a drain, then the replica closing), it waits on
        the first call's work: a caller cancelled leaves that work going."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop(), name="jobs-runner-stop")
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        self._draining.set()
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.wait([self._loop])
        stopping = list(self.runs.values())
        tasks = [r.task for r in stopping if r.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if not stopping:
            return
        try:  # only once every run has stopped: a released job may be claimed elsewhere at once
            released = await asyncio.wait_for(asyncio.gather(*(self._release(r.job) for r in stopping)),
                                              RELEASE_BOUND_S)
        except TimeoutError:
            log.warning("jobs: the store took no release in %.0fs; the stopped jobs' leases run out", RELEASE_BOUND_S)
            return
        log.info("jobs: %d of %d stopped jobs released for another replica", sum(released), len(stopping))

    async def _release(self, job: Job) -> bool:
        try:
            return await self.store.release(job.id, self.worker, self.api.clock())
        except StoreUnavailable as e:
            log.warning("jobs: %s not released, the store is unreachable (%s); its lease runs out", job.id, e)
            return False

    def stop_job(self, job_id: str, why: str = "cancelled or deleted") -> None:
        """Stop this replica's run of a job (no-op when it runs elsewhere)."""
        run = self.runs.get(job_id)
        if run is not None and run.produce is not None and not run.lost:
            run.lost = why
            run.produce.cancel()

    # ------------------------------------------------------------------ claiming
    async def _claim_loop(self) -> None:
        next_sweep = 0.0
        while True:
            claimed = None
            try:
                # A claim never takes this replica's own leases, even lapsed (the store unreachable for longer
                # than a lease): those runs go on and renew them.
                if len(self.runs) < self.api.settings.concurrency:
                    claimed = await self._claim()
                if claimed is not None:
                    self._start(claimed)
                    continue  # more may be waiting
                counts = await self.store.counts()
                self.metrics.jobs_queued.set(counts.get("queued", 0))
                if self.api.clock() >= next_sweep:
                    await self.sweep()
                    next_sweep = self.api.clock() + SWEEP_S
            except StoreUnavailable as e:
                log.warning("jobs: the store is unreachable (%s); trying again in %.0fs", e, CLAIM_POLL_S)
            except Exception:  # any other fault (a store bug, a bad row): logged, and this replica keeps claiming
                log.exception("jobs: claiming failed; trying again in %.0fs", CLAIM_POLL_S)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLAIM_POLL_S):
                    await self._wake.wait()

    async def _claim(self) -> Job | None:
        """A claim that, cancelled (the runner stops) while the store's thread runs it, still ends: a job it
        leased is released, never left leased to a replica that runs nothing."""
        claim = asyncio.ensure_future(self.store.claim(self.worker, self.api.settings.lease_s, self.api.clock()))
        try:
            return await asyncio.shield(claim)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                job = await claim
                if job is not None:
                    await self._release(job)
            raise

    async def _renew(self, run: _Run) -> bool:
        return await self.store.renew(run.job.id, self.worker, self.api.settings.lease_s, self.api.clock(),
                                      run.progress)

    def _start(self, job: Job) -> None:
        if job.attempts > 1:
            log.info("jobs: %s claimed again (attempt %d): %s", job.id, job.attempts, job.restarted_reason)
        fps = int(job.meta.get("fps", 0)) or 1
        run = _Run(job, VideoMux(self.scratch / f"{job.id}.{self.worker}.mp4", fps, int(job.meta.get("num_frames", 0))))
        run.task = asyncio.create_task(self._job(run), name=f"job-{job.id}")
        self.runs[job.id] = run
        self.metrics.jobs_running.set(len(self.runs))

    async def sweep(self) -> None:
        """Delete finished jobs past their TTL, with their content (SWEEP_BATCH at a time)."""
        for job in await self.store.expired(self.api.clock(), SWEEP_BATCH):
            await asyncio.to_thread(self.content.delete, job.id)
            await self.store.delete(job.id, job.owner)

    # ------------------------------------------------------------------- running
    async def _job(self, run: _Run) -> None:
        job = run.job
        produce = run.produce = asyncio.create_task(self._produce(run), name=f"job-run-{job.id}")
        keep = asyncio.create_task(self._keep_lease(run, produce), name=f"job-lease-{job.id}")
        outcome = "failed"
        try:
            try:
                content = await produce
            except asyncio.CancelledError:
                if not run.lost or asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    outcome = "taken_over"  # the runner stops: the lease runs out and another replica takes it
                    raise
                outcome = await self._lost_outcome(run)
                return
            except _Drained:  # handed back at once, for another replica: its run never began
                keep.cancel()
                outcome = "taken_over"
                if await self._release(job):
                    log.info("jobs: %s released: waiting out refusals when this replica began to drain", job.id)
                return
            except Exception as e:  # any fault ends the job failed, not this replica's runner
                if isinstance(e, Refused):
                    code, message = ERROR_CODES.get(e.code, "generation_failed"), e.message
                else:
                    log.error("jobs: %s failed", job.id, exc_info=e)
                    code, message = "internal", "internal error (see the orchestrator's log)"
                if await self._settle(self.store.fail, job.id, self.worker, self.api.clock(), self.api.settings.ttl_s,
                                      code, message):
                    await run.io(self.content.delete, job.id)  # whatever it put before failing
                else:
                    outcome = await self._lost_outcome(run)
                return
            keep.cancel()
            if await self._settle(self.store.finish, job.id, self.worker, self.api.clock(), self.api.settings.ttl_s,
                                  content):
                outcome = "completed"
            else:  # lost between the last frame and the finish: another replica runs it, or it is gone
                outcome = await self._lost_outcome(run)
        finally:
            keep.cancel()
            produce.cancel()
            await asyncio.wait([keep, produce])
            await run.io(run.mux.abort)  # the partial MP4, if it is still in the scratch folder
            run.files.shutdown(wait=False)
            self.runs.pop(job.id, None)
            self.metrics.jobs_running.set(len(self.runs))
            self.metrics.jobs.labels(outcome).inc()

    async def _produce(self, run: _Run) -> dict[str, int]:
        """The job's request down the request path, its frames into the MP4; the content put: variant -> bytes."""
        request = orchestrator_pb2.GenerateRequest.FromString(run.job.request)
        give_up = self.api.clock() + self.patience_s
        while True:
            try:
                async with contextlib.aclosing(self.generate(request)) as events:
                    async for ev in events:
                        kind = ev.WhichOneof("event")
                        if kind == "progress":
                            run.steps = (ev.progress.done, ev.progress.total)
                        elif kind == "video":
                            v = ev.video
                            frames = np.frombuffer(v.rgb, np.uint8).reshape(v.count, v.height, v.width, 3)
                            await run.io(run.mux.add, frames)
                            run.frames += v.count
                break
            except Refused as e:
                if e.code not in RETRIED or run.frames or self.api.clock() + RETRY_S > give_up:
                    raise
                if self._draining.is_set():
                    raise _Drained(e.message) from e
                with contextlib.suppress(TimeoutError):  # the wait ends early when this replica begins to drain
                    async with asyncio.timeout(e.retry_after_s or RETRY_S):
                        await self._draining.wait()
        job_id = run.job.id
        await run.io(run.mux.close)
        thumbnail, spritesheet, preview = await run.io(
            lambda: (run.mux.thumbnail(), run.mux.spritesheet(), run.mux.preview()))
        return {"video": await run.io(self.content.put, job_id, "video", run.mux.path),
                "thumbnail": await run.io(self.content.put, job_id, "thumbnail", thumbnail),
                "spritesheet": await run.io(self.content.put, job_id, "spritesheet", spritesheet),
                "preview": await run.io(self.content.put, job_id, "preview", preview)}

    async def _keep_lease(self, run: _Run, produce: asyncio.Task) -> None:
        """Renew the lease with the progress every RENEW_S; a lease no longer ours stops the run."""
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                ours = await self._renew(run)
            except StoreUnavailable as e:
                log.warning("jobs: %s: lease not renewed, the store is unreachable (%s)", run.job.id, e)
                continue
            except Exception:  # any other fault: logged and tried again; a keeper that stopped would lose the lease
                log.exception("jobs: %s: renewing its lease failed", run.job.id)
                continue
            if not ours:
                run.lost = run.lost or "its lease is no longer this replica's"
                produce.cancel()
                return

    async def _lost_outcome(self, run: _Run) -> str:
        """A run stopped from outside: "taken_over" when the job still runs (elsewhere), else "failed"."""
        with contextlib.suppress(StoreUnavailable):
            job = await self.store.get(run.job.id, run.job.owner)
            if job is not None and job.status not in FINISHED:
                log.info("jobs: %s: %s; another replica runs it", run.job.id, run.lost)
                return "taken_over"
            if job is None or job.status != JobStatus.COMPLETED:  # deleted or cancelled: nothing of it is kept
                await run.io(self.content.delete, run.job.id)
        return "failed"

    async def _settle(self, call, *args) -> bool:
        """A finish or fail, tried until the store takes it (its answer: whether the job was still ours)."""
        while True:
            try:
                return await call(*args)
            except StoreUnavailable as e:
                log.warning("jobs: %s: the store is unreachable (%s); trying again in %.0fs", args[0], e,
                            STORE_RETRY_S)
                await asyncio.sleep(STORE_RETRY_S)
