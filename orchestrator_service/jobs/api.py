"""The job operations, whichever door asks (HTTP /v1/videos, gRPC Jobs): create (validated against the pipeline
and its limits, within the owner's quota), get, list, delete, cancel, watch, and where a finished job's content
is. Failures are `Refused` (servicer.py), as for Generate: each door shapes them its own way.

An owner is who holds the API key a request came with (`owner_of`): a job is seen only with the key that made it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncGenerator, Awaitable, Callable, TypeVar

import grpc

from omnistage.api import Pipeline, accepted_inputs
from omnistage.contract.params import InvalidRequest, fill_resolved, has_media, resolve
from omnistage.v1 import orchestrator_pb2

from ..admission import Overloaded
from ..api_keys import ApiKeys
from ..media_check import MediaCheck, check_needed_parts
from ..servicer import Refused, checked_label, requested_outputs
from .content import ContentStore
from .mux import MEDIA_TYPES, VARIANTS
from .store import FINISHED, MAX_ATTEMPTS, Job, JobStatus, JobStore, QuotaExceeded, StoreUnavailable, new_job_id
from .watch import Watches

T = TypeVar("T")
KIND = "video"
# A client told the store is unreachable retries after this: a database restart or failover takes seconds.
STORE_RETRY_AFTER_S = 5.0
# How often a watch reads the job again: progress moves about once a second (the runner's renewals).
WATCH_POLL_S = 0.5
LIST_DEFAULT, LIST_MOST = 20, 100  # a page of jobs, as OpenAI's list endpoints
NO_STORE = "this orchestrator has no job store (--jobs-store)"
CANCELLED = "cancelled"  # the error code of a job its owner cancelled


@dataclass(frozen=True)
class JobSettings:
    """The job flags (launch.ORCHESTRATOR_FLAGS jobs_*)."""

    ttl_s: float = 86400.0
    concurrency: int = 2
    max_queued_per_key: int = 16
    lease_s: float = 10.0
    max_attempts: int = MAX_ATTEMPTS


def owner_of(keys: ApiKeys, authorization: str | None) -> str:
    """The owner a request's key names: a digest of the key (the key itself is never stored); "" without keys."""
    key = keys.match(authorization)
    return "" if key is None else "key-" + hashlib.sha256(key.secret).hexdigest()[:24]


class QuotaRefused(Refused):
    """The owner's queue of jobs is full (its quota): told apart from the server's own overload."""


def not_found(job_id: str) -> Refused:
    return Refused(grpc.StatusCode.NOT_FOUND, f"no video {job_id!r} (none by that id for this API key)",
                   param="video_id")


def content_gone(job_id: str, variant: str) -> Refused:
    """A completed job's content not there (swept past its TTL, or never kept)."""
    return Refused(grpc.StatusCode.NOT_FOUND, f"video {job_id!r} has no {variant} (its content expired or was not "
                   "kept)", param="variant")


def unavailable(e: StoreUnavailable) -> Refused:
    # The same words whatever the cause: the cause (the store's server, its driver's error) is for the log only,
    # where the store writes it once per outage.
    return Refused(grpc.StatusCode.UNAVAILABLE, f"the job store is unreachable; retry after "
                   f"{STORE_RETRY_AFTER_S:.0f} s", retry_after_s=STORE_RETRY_AFTER_S)


async def stored(call: Awaitable[T]) -> T:
    """A store call's answer; the store unreachable is the refusal every door answers (`unavailable`)."""
    try:
        return await call
    except StoreUnavailable as e:
        raise unavailable(e) from None


def job_meta(pipeline: Pipeline, params) -> dict:
    """What the API echoes of a job's request (its resolved parameters)."""
    return {"model": pipeline.name, "width": params.width, "height": params.height,
            "num_frames": params.num_frames, "fps": params.fps,
            "seconds": round(params.num_frames / params.fps, 3) if params.fps else 0.0}


class JobApi:
    """The operations on `store` (None: no store configured: creating refuses, reads find nothing), finished
    content in `content`. `on_created` wakes this replica's runner; `on_stopped(job_id)` stops its run of a job
    that was cancelled or deleted here (other replicas' runners see it at their next renewal)."""

    def __init__(self, pipeline: Pipeline, store: JobStore | None, content: ContentStore | None,
                 settings: JobSettings = JobSettings(), clock: Callable[[], float] = time.time,
                 media: MediaCheck | None = None):
        self.pipeline, self.store, self.content, self.settings, self.clock = pipeline, store, content, settings, clock
        self.media = media  # decodes a job's media parts at submission, as Generate's admission does
        self.on_created: Callable[[], None] = lambda: None
        self.on_stopped: Callable[[str], None] = lambda job_id: None
        # Watchers of one job share its reads (the poll interval read when it is used: tests shorten it).
        self.watches = Watches(self.get, lambda: WATCH_POLL_S)

    @property
    def enabled(self) -> bool:
        return self.store is not None

    async def create(self, request: orchestrator_pb2.GenerateRequest, owner: str) -> Job:
        """Validate `request` as Generate would (its params resolved and written into it), and queue it."""
        try:
            has = [o.modality for o in self.pipeline.outputs]
            if "video" not in has:
                raise InvalidRequest("model", f'"{self.pipeline.name}" makes no video (it has: {", ".join(has)})')
            if request.outputs and list(requested_outputs(self.pipeline, request).values()) != ["video"]:
                raise InvalidRequest("outputs", "a video job makes video only: ask for [VIDEO] (or nothing)")
            checked_label(request.request_id)
            if has_media(request.params.parts) and "image" not in accepted_inputs(self.pipeline):
                raise InvalidRequest("params.parts", f'"{self.pipeline.name}" is a text-to-video pipeline (no '
                                     "image-to-video input): send the prompt as text only, without media parts")
            params = resolve(request.params, self.pipeline.limits)
            check_needed_parts(self.pipeline, params.parts)
            if self.media is not None and has_media(params.parts):  # a bad image is refused now, not when it runs
                await self.media.check(params.parts)
        except InvalidRequest as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e), param=e.field) from None
        except Overloaded as e:  # the media decoders stayed busy
            raise Refused.overloaded(e) from None
        store = self._store()  # after the request's own checks: a bad request is told so wherever it is sent
        job_id = new_job_id()
        sent = orchestrator_pb2.GenerateRequest()
        sent.CopyFrom(request)
        sent.params.CopyFrom(fill_resolved(request.params, params))
        del sent.outputs[:]
        sent.outputs.append(orchestrator_pb2.VIDEO)
        sent.request_id = job_id  # the run's label: the job's id (a client's label names its Submit call only)
        job = Job(id=job_id, owner=owner, kind=KIND, status=JobStatus.QUEUED,
                  request=sent.SerializeToString(), created_at=self.clock(), meta=job_meta(self.pipeline, params),
                  pipeline=self.pipeline.name)
        try:
            job = await store.create(job, self.settings.max_queued_per_key)
        except QuotaExceeded:
            raise QuotaRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"this API key has {self.settings.max_queued_per_key} videos queued already (the most it "
                          "may); retry once some have started", retry_after_s=STORE_RETRY_AFTER_S) from None
        except StoreUnavailable as e:
            raise unavailable(e) from None
        self.on_created()
        return job

    async def get(self, job_id: str, owner: str) -> Job:
        if self.store is None:
            raise not_found(job_id)
        job = await stored(self.store.get(job_id, owner))
        if job is None:
            raise not_found(job_id)
        return job

    async def list(self, owner: str, after: str | None, limit: int | None, order: str | None) -> tuple[list[Job], bool]:
        limit = LIST_DEFAULT if limit is None or limit == 0 else limit
        if not 1 <= limit <= LIST_MOST:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"limit: must be 1 to {LIST_MOST}, got {limit}",
                          param="limit")
        order = order or "desc"
        if order not in ("asc", "desc"):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f'order: must be "asc" or "desc", got "{order}"',
                          param="order")
        if self.store is None:
            return [], False
        unknown_after = Refused(grpc.StatusCode.INVALID_ARGUMENT, f"after: no video {after!r} to list after",
                                param="after")
        if after:  # a cursor that names no job of this owner's is an error, not an empty page
            try:
                await self.get(after, owner)
            except Refused as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
                raise unknown_after from None
        try:
            return await self.store.list(owner, after or None, limit, order)
        except StoreUnavailable as e:
            raise unavailable(e) from None
        except ValueError:  # the cursor's job went (deleted, swept) since it was read above
            if not after:
                raise
            raise unknown_after from None

    async def cancel(self, job_id: str, owner: str) -> Job:
        """A queued or running job ends failed ("cancelled"); a finished one is left as it is."""
        job = await self.get(job_id, owner)
        if job.status in FINISHED:
            return job
        await stored(self.store.fail(job_id, None, self.clock(), self.settings.ttl_s, CANCELLED,  # type: ignore[union-attr]
                                     "cancelled by its owner"))
        self.on_stopped(job_id)
        return await self.get(job_id, owner)

    async def delete(self, job_id: str, owner: str) -> Job:
        """The job and its content gone (a run of it stops at its next renewal, or at once on this replica)."""
        if self.store is None:
            raise not_found(job_id)
        job = await stored(self.store.delete(job_id, owner))
        if job is None:
            raise not_found(job_id)
        self.on_stopped(job_id)
        if self.content is not None:
            await asyncio.to_thread(self.content.delete, job_id)
        return job

    def watch(self, job_id: str, owner: str) -> AsyncGenerator[Job, None]:
        """The job now, then each time its status or progress changes, until it is finished (Refused when it is
        gone, or this replica holds as many watches as it keeps: watch.py)."""
        return self.watches.watch(job_id, owner)

    async def content_of(self, job_id: str, owner: str, variant: str | None) -> tuple[Path, str]:
        """(the file, its media type) of a completed job's `variant` ("video" when None)."""
        variant = variant or "video"
        if variant not in VARIANTS:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f'variant: must be one of {", ".join(VARIANTS)}, '
                          f'got "{variant}"', param="variant")
        job = await self.get(job_id, owner)
        if job.status != JobStatus.COMPLETED:
            why = (f"it failed ({job.error_code}: {job.error_message})" if job.status == JobStatus.FAILED else
                   f"it is {job.status.value} ({job.progress}%)")
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"video {job_id!r} has no content: {why}")
        path = self.content.path(job_id, variant) if self.content is not None else None
        if path is None:
            raise content_gone(job_id, variant)
        return path, MEDIA_TYPES[variant]

    def _store(self) -> JobStore:
        if self.store is None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, NO_STORE)
        return self.store
