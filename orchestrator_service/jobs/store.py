"""The durable job store's contract: the job record, its states, the store's errors and its protocol.

A job (a /v1/videos request) outlives the request that created it and the replica that runs it: its row lives in a
store every orchestrator replica shares (SQLite on one host, PostgreSQL on a cluster). A replica runs a job while
it holds the job's lease (`claim`, then `renew` about every second); a replica that dies stops renewing, and once
the lease runs out another replica claims the job again from the start (`attempts` counts the claims not handed
back, `restarted_reason` says why); a replica that drains hands its running jobs back (`release`) so another claims
them at once. A store serves one pipeline, named when it is made: several pipelines may share one database and
never see or run each other's jobs. Every time is passed in (`now`), so tests need no clock; a PostgreSQL store
times leases on the server's own clock instead (replicas' clocks may disagree by more than a lease), unless made to
use the times passed in.
"""

from __future__ import annotations

import builtins
import secrets
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

# OpenAI's video ids read "video_..." and clients may check the prefix.
JOB_ID_PREFIX = "video_"
# Claims a job gets before the store fails it ("restarted_too_often") instead of letting another replica take it
# over: a run that kills its orchestrator (a crash in a stage's request path, memory) would otherwise be taken
# over by each replica in turn, for good. Three: one replica lost to an unrelated cause (a node drained, a
# rollout) and one more are forgiven; a third lost run in a row is the job's doing. (--jobs-max-attempts)
MAX_ATTEMPTS = 3
RESTARTED_TOO_OFTEN = "restarted_too_often"  # the error code of a job the store stopped restarting
# How long a job the store itself failed is kept (the replica passes --jobs-ttl-s; its default, as here).
DEFAULT_TTL_S = 86400.0


def new_job_id() -> str:
    """A fresh job id: the prefix and 32 random hex digits (128 bits: never guessed, never repeated)."""
    return JOB_ID_PREFIX + secrets.token_hex(16)


class JobStatus(str, Enum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"


# A finished job is never claimed again and is deleted once it expires.
FINISHED = (JobStatus.COMPLETED, JobStatus.FAILED)


@dataclass
class Job:
    id: str  # JOB_ID_PREFIX + 32 hex
    owner: str  # the API key's name ("" with no keys): every read is scoped to it
    kind: str  # "video"
    status: JobStatus
    # the job's GenerateRequest, serialized (params resolved at creation); only a claim reads it back: the jobs
    # reads, lists, deletes and sweeps return have it empty (an image-to-video job's carries its reference image)
    request: bytes
    created_at: float  # unix seconds
    progress: int = 0  # 0..100
    started_at: float | None = None
    completed_at: float | None = None
    expires_at: float | None = None  # completed/failed + TTL
    error_code: str = ""
    error_message: str = ""
    attempts: int = 0  # claims so far, less those a drain handed back; >1: restarted after a replica died
    restarted_reason: str = ""
    lease_owner: str = ""
    lease_until: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)  # JSON: model, size, seconds, fps, ... as the API echoes them
    content: dict[str, int] = field(default_factory=dict)  # variant -> bytes stored
    pipeline: str = ""  # the pipeline that runs it ("" until created: the store sets its own)


class StoreUnavailable(Exception):
    """The backend cannot be reached (server down, connection lost, database file unreadable).

    Callers answer 503 with Retry-After; the job itself is not lost, the store is. Its message is the same for
    every cause and names neither the server nor the driver's error (it may reach API clients); the cause is its
    `__cause__`, and the store logs it once per outage.
    """


class QuotaExceeded(Exception):
    """The owner has `max_queued` jobs queued already (HTTP 429)."""


class JobStore(Protocol):
    """Every method is async; backends run their I/O off the event loop or on an async driver. Every method sees
    only the jobs of the store's pipeline (`pipeline`, given when the store is made)."""

    pipeline: str

    async def open(self) -> None:
        """Connect and create the schema if missing (idempotent: every replica calls it on start)."""

    async def close(self) -> None: ...

    async def create(self, job: Job, max_queued: int) -> Job:
        """Insert `job` as a job of the store's pipeline (returned with it set; ValueError when it names
        another); atomically refuse with QuotaExceeded when its owner has `max_queued` queued."""

    async def get(self, job_id: str, owner: str) -> Job | None:
        """The job, or None when there is none or it is another owner's."""

    async def list(self, owner: str, after: str | None, limit: int, order: str) -> tuple[list[Job], bool]:
        """The owner's jobs by creation time ("asc" or "desc"), after the job `after`; and has_more."""

    async def delete(self, job_id: str, owner: str) -> Job | None:
        """Remove the row and return it (None when not the owner's); the caller deletes its content."""

    async def claim(self, worker: str, lease_s: float, now: float) -> Job | None:
        """Lease to `worker` the oldest queued job, or an in_progress one whose lease expired (a takeover:
        attempts + 1, restarted_reason set). Two workers never hold the same job, and a worker never takes
        over its own lease (its runner still holds that job and renews it). An expired job that had the store's
        `max_attempts` claims already is failed instead (RESTARTED_TOO_OFTEN) and the next one is claimed."""

    async def renew(self, job_id: str, worker: str, lease_s: float, now: float, progress: int | None) -> bool:
        """Extend the lease (and record progress); False once the lease is not this worker's."""

    async def release(self, job_id: str, worker: str, now: float) -> bool:
        """`worker` stops running the job (its replica drains): it is queued again at once, for any replica to
        claim, its restarted_reason saying so, its claim not counted (attempts - 1: a drain is not the job's doing);
        False when `worker` does not hold it."""

    async def finish(self, job_id: str, worker: str, now: float, ttl_s: float, content: dict[str, int]) -> bool:
        """Mark the job completed with its content sizes; False when `worker` no longer holds it."""

    async def fail(self, job_id: str, worker: str | None, now: float, ttl_s: float, code: str, message: str) -> bool:
        """Mark the job failed; worker None is a cancel from any replica (any unfinished job)."""

    async def expired(self, now: float, limit: int) -> builtins.list[Job]:
        """Finished jobs past their expires_at, oldest first (for the TTL sweeper)."""

    async def counts(self) -> dict[str, int]:
        """Jobs per status value (every status present, 0 included)."""
