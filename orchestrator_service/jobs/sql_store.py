"""The job store's SQL, written once for its SQLite and PostgreSQL backends.

Each store method is one short transaction: a plain function over a DB-API cursor, run on the store's
worker threads so the event loop never waits on the database. The SQL uses `?` placeholders; a backend
names how to connect, how a transaction begins (SQLite's BEGIN IMMEDIATE takes the write lock at once),
the row lock of a claim (PostgreSQL's FOR UPDATE SKIP LOCKED), the lock that makes a quota check atomic,
which errors mean the database cannot be reached (StoreUnavailable) and the clock leases are timed on. Every
statement names the store's pipeline: pipelines sharing the database share the table, never a job.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

from orchestrator_service.jobs.store import (
    DEFAULT_TTL_S,
    FINISHED,
    MAX_ATTEMPTS,
    RESTARTED_TOO_OFTEN,
    Job,
    JobStatus,
    QuotaExceeded,
    StoreUnavailable,
)

T = TypeVar("T")
log = logging.getLogger("omnistage.orchestrator.jobs.store")
# What StoreUnavailable says, whatever the cause: it may reach API clients, so it names no server, user or driver
# error (those are logged, once per outage).
UNREACHABLE = "the job store cannot be reached (the orchestrator's log says why)"

TABLE = "omnistage_jobs"
COLUMNS = ("id", "owner", "kind", "status", "request", "created_at", "progress", "started_at", "completed_at",
           "expires_at", "error_code", "error_message", "attempts", "restarted_reason", "lease_owner",
           "lease_until", "meta", "content", "pipeline")
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM {TABLE}"
# A job's state without its request (empty): what reads, lists, watches and sweeps take. The request (an
# image-to-video job's reference image: megabytes) is read once, by the replica that claims the job.
_SELECT_STATE = "SELECT " + ", ".join("substr(request, 1, 0)" if c == "request" else c for c in COLUMNS) + \
    f" FROM {TABLE}"
_FINISHED_VALUES = tuple(s.value for s in FINISHED)


@dataclasses.dataclass(frozen=True)
class Dialect:
    blob: str  # the column type of the serialized request
    real: str  # the column type of unix-seconds times
    begin_write: str  # starts a transaction that writes
    claim_lock: str  # appended to the claim's SELECT
    placeholder: str  # what `?` becomes in the driver's paramstyle
    table_exists: str  # one row, one column: true when the table named by the parameter exists
    column_exists: str  # one row, one column: true when the table (first parameter) has the column (second)


def schema(d: Dialect) -> list[str]:
    """CREATE statements, each a no-op when its object exists (every replica runs them on start): the table, then
    its indexes (after `migrations`: they index columns an older table lacks)."""
    statuses = ", ".join(f"'{s.value}'" for s in JobStatus)
    return [
        f"""CREATE TABLE IF NOT EXISTS {TABLE} (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            kind TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ({statuses})),
            request {d.blob} NOT NULL,
            created_at {d.real} NOT NULL,
            progress INTEGER NOT NULL DEFAULT 0,
            started_at {d.real},
            completed_at {d.real},
            expires_at {d.real},
            error_code TEXT NOT NULL DEFAULT '',
            error_message TEXT NOT NULL DEFAULT '',
            attempts INTEGER NOT NULL DEFAULT 0,
            restarted_reason TEXT NOT NULL DEFAULT '',
            lease_owner TEXT NOT NULL DEFAULT '',
            lease_until {d.real} NOT NULL DEFAULT 0,
            meta TEXT NOT NULL DEFAULT '{{}}',
            content TEXT NOT NULL DEFAULT '{{}}',
            pipeline TEXT NOT NULL DEFAULT '')""",
        # listing one owner's jobs in creation order, and the quota's count of its queued ones
        f"CREATE INDEX IF NOT EXISTS {TABLE}_pipeline_owner_created ON {TABLE} (pipeline, owner, created_at, id)",
        # the claim: queued or leased jobs, oldest first
        f"CREATE INDEX IF NOT EXISTS {TABLE}_pipeline_status_created ON {TABLE} (pipeline, status, created_at, id)",
        # the TTL sweep
        f"CREATE INDEX IF NOT EXISTS {TABLE}_pipeline_expires ON {TABLE} (pipeline, expires_at)",
    ]


# The indexes of the table before jobs named their pipeline (each replaced by one that leads with it).
_INDEXES_BEFORE_PIPELINES = ("owner_created", "status_created", "expires")


def migrate(cur: Cursor, d: Dialect, pipeline: str) -> None:
    """Bring a table an older orchestrator made up to `schema`, inside the schema transaction: the pipeline column
    added, its jobs adopted (`adopt_unnamed`) and the older indexes dropped."""
    if cur.execute(d.column_exists, (TABLE, "pipeline")).fetchone()[0]:
        return
    cur.execute(f"ALTER TABLE {TABLE} ADD COLUMN pipeline TEXT NOT NULL DEFAULT ''")
    adopt_unnamed(cur, pipeline)
    for name in _INDEXES_BEFORE_PIPELINES:
        cur.execute(f"DROP INDEX IF EXISTS {TABLE}_{name}")


def adopt_unnamed(cur: Cursor, pipeline: str) -> None:
    """Give each job that names no pipeline (an older orchestrator made it: before the migration, or beside this
    version during a rolling upgrade) the pipeline its `model` names (the pipeline that made it: the name the API
    echoes), else `pipeline` (the replica adopting it)."""
    for job_id, meta in cur.execute(f"SELECT id, meta FROM {TABLE} WHERE pipeline = ''").fetchall():
        cur.execute(f"UPDATE {TABLE} SET pipeline = ? WHERE id = ? AND pipeline = ''",
                    (json.loads(meta).get("model") or pipeline, job_id))


def to_row(job: Job) -> tuple[Any, ...]:
    return (job.id, job.owner, job.kind, JobStatus(job.status).value, bytes(job.request), job.created_at,
            job.progress, job.started_at, job.completed_at, job.expires_at, job.error_code, job.error_message,
            job.attempts, job.restarted_reason, job.lease_owner, job.lease_until, json.dumps(job.meta),
            json.dumps(job.content), job.pipeline)


def from_row(row: Sequence[Any]) -> Job:
    values = dict(zip(COLUMNS, row))
    values["status"] = JobStatus(values["status"])
    values["request"] = bytes(values["request"])
    values["meta"] = json.loads(values["meta"])
    values["content"] = json.loads(values["content"])
    return Job(**values)


def lapsed(job: Job) -> str:
    """Why a job still in progress is claimed: its holder stopped renewing the lease."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(job.lease_until))
    return f"orchestrator {job.lease_owner} stopped renewing its lease at {when}"


def claimed(job: Job, worker: str, lease_until: float, now: float) -> Job:
    """The job as `worker` holds it after claiming it (leased until `lease_until`); a job still in progress is a
    takeover."""
    reason = job.restarted_reason
    if job.status is JobStatus.IN_PROGRESS:
        reason = f"{lapsed(job)}; restarted from the start"
    return dataclasses.replace(job, status=JobStatus.IN_PROGRESS, attempts=job.attempts + 1, restarted_reason=reason,
                               lease_owner=worker, lease_until=lease_until, started_at=now, progress=0)


def restarted_too_often(job: Job) -> str:
    """The error message of a job whose lease lapsed once more after its last allowed attempt."""
    earlier = job.restarted_reason.removesuffix("; restarted from the start")
    before = f"; attempt {job.attempts} began because {earlier}" if earlier else ""
    return (f"stopped after {job.attempts} attempts, the most a job gets (--jobs-max-attempts), none of which "
            f"finished: {lapsed(job)}{before}")


def released_reason(worker: str, now: float) -> str:
    """Why a job a draining replica handed back runs again (kept through its next claim)."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    return f"orchestrator {worker} drained (shut down) at {when} while running it; restarted from the start"


class Cursor:
    """A DB-API cursor speaking the shared SQL (`?` placeholders) in the driver's paramstyle."""

    def __init__(self, cursor: Any, dialect: Dialect):
        self._cursor = cursor
        self._placeholder = dialect.placeholder

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        if self._placeholder != "?":
            sql = sql.replace("?", self._placeholder)
        self._cursor.execute(sql, tuple(params))
        return self

    def fetchone(self) -> Any:
        return self._cursor.fetchone()

    def fetchall(self) -> list[Any]:
        return list(self._cursor.fetchall())

    @property
    def rowcount(self) -> int:
        return int(self._cursor.rowcount)


class SqlJobStore:
    """The JobStore protocol over a DB-API driver; a backend subclasses it with its connection and dialect.
    `pipeline`: the pipeline whose jobs it keeps (each statement is scoped to it); `max_attempts`: the claims a
    job gets before a lapsed lease fails it; `ttl_s`: how long a job the store fails that way is kept."""

    dialect: Dialect
    name: str  # how logs name this store (no password)

    def __init__(self, threads: int, pipeline: str, max_attempts: int = MAX_ATTEMPTS, ttl_s: float = DEFAULT_TTL_S):
        if not pipeline:
            raise ValueError("a job store keeps one pipeline's jobs: name the pipeline")
        if max_attempts < 1:
            raise ValueError(f"max_attempts {max_attempts}: at least 1 (a job is claimed at least once)")
        self.pipeline, self.max_attempts, self.ttl_s = pipeline, max_attempts, ttl_s
        self._down = False  # the last call found the store unreachable (its outage is logged once)
        self._down_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="job-store")
        self._idle: list[Any] = []  # open connections no thread uses now
        self._idle_lock = threading.Lock()
        self._closed = False

    # ---- what a backend provides
    def _connect(self) -> Any:
        """A new DB-API connection in autocommit mode (transactions are begun explicitly)."""
        raise NotImplementedError

    def _unreachable(self, error: BaseException) -> bool:
        """True when `error` means the database cannot be reached (StoreUnavailable), not a bad statement."""
        raise NotImplementedError

    def _lost(self, connection: Any) -> bool:
        """True when `connection` is known dead (its server went away)."""
        return False

    def _lock_owner(self, cur: Cursor, owner: str) -> None:
        """Serialize creations of one owner's jobs until the transaction ends (the quota check is atomic)."""

    def _lock_schema(self, cur: Cursor) -> None:
        """Serialize schema creation among replicas starting at once."""

    def _lease_now(self, cur: Cursor, now: float) -> float:
        """The time leases are set and compared at in this transaction: the caller's `now` (one host's clock)."""
        return now

    # ---- the protocol
    async def open(self) -> None:
        await self._run(lambda cur: None, write=False)  # a connection, and with it the schema

    async def close(self) -> None:
        self._closed = True
        await asyncio.to_thread(self._shutdown)

    async def create(self, job: Job, max_queued: int) -> Job:
        if job.pipeline and job.pipeline != self.pipeline:
            raise ValueError(f"job {job.id} is pipeline {job.pipeline!r}'s, not this store's ({self.pipeline!r})")
        job = dataclasses.replace(job, pipeline=self.pipeline)

        def run(cur: Cursor) -> Job:
            self._lock_owner(cur, job.owner)
            (queued,) = cur.execute(f"SELECT COUNT(*) FROM {TABLE} WHERE pipeline = ? AND owner = ? AND status = ?",
                                    (self.pipeline, job.owner, JobStatus.QUEUED.value)).fetchone()
            if queued >= max_queued:
                raise QuotaExceeded(f"this API key has {queued} jobs queued, the most it may have queued "
                                    f"({max_queued}); wait for one to start")
            marks = ", ".join("?" * len(COLUMNS))
            cur.execute(f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({marks})", to_row(job))
            return job
        return await self._run(run)

    async def get(self, job_id: str, owner: str) -> Job | None:
        def run(cur: Cursor) -> Job | None:
            row = cur.execute(f"{_SELECT_STATE} WHERE pipeline = ? AND id = ? AND owner = ?",
                              (self.pipeline, job_id, owner)).fetchone()
            return None if row is None else from_row(row)
        return await self._run(run, write=False)

    async def list(self, owner: str, after: str | None, limit: int, order: str) -> tuple[list[Job], bool]:
        if order not in ("asc", "desc"):
            raise ValueError(f"order must be 'asc' or 'desc', not {order!r}")
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        cmp, direction = (">", "ASC") if order == "asc" else ("<", "DESC")

        def run(cur: Cursor) -> tuple[list[Job], bool]:
            where, params = "pipeline = ? AND owner = ?", [self.pipeline, owner]
            if after is not None:
                mark = cur.execute(f"SELECT created_at, id FROM {TABLE} WHERE pipeline = ? AND id = ? AND owner = ?",
                                   (self.pipeline, after, owner)).fetchone()
                if mark is None:
                    raise ValueError(f"after: there is no job {after!r}")
                where += f" AND (created_at {cmp} ? OR (created_at = ? AND id {cmp} ?))"
                params += [mark[0], mark[0], mark[1]]
            rows = cur.execute(f"{_SELECT_STATE} WHERE {where} ORDER BY created_at {direction}, id {direction} LIMIT ?",
                               (*params, limit + 1)).fetchall()
            return [from_row(r) for r in rows[:limit]], len(rows) > limit
        return await self._run(run, write=False)

    async def delete(self, job_id: str, owner: str) -> Job | None:
        def run(cur: Cursor) -> Job | None:
            row = cur.execute(f"{_SELECT_STATE} WHERE pipeline = ? AND id = ? AND owner = ?",
                              (self.pipeline, job_id, owner)).fetchone()
            if row is None:
                return None
            cur.execute(f"DELETE FROM {TABLE} WHERE id = ?", (job_id,))
            return from_row(row)
        return await self._run(run)

    async def claim(self, worker: str, lease_s: float, now: float) -> Job | None:
        def run(cur: Cursor) -> Job | None:
            adopt_unnamed(cur, self.pipeline)  # jobs an older replica still running beside this one queued
            lease_now = self._lease_now(cur, now)
            while True:  # each turn claims a job or fails one restarted too often (a bounded number of rows)
                # An expired lease of `worker`'s own is left alone: its runner still runs that job and renews it.
                row = cur.execute(
                    f"{_SELECT} WHERE pipeline = ?"
                    " AND (status = ? OR (status = ? AND lease_until < ? AND lease_owner <> ?))"
                    f" ORDER BY created_at, id LIMIT 1{self.dialect.claim_lock}",
                    (self.pipeline, JobStatus.QUEUED.value, JobStatus.IN_PROGRESS.value, lease_now,
                     worker)).fetchone()
                if row is None:
                    return None
                found = from_row(row)
                if found.status is not JobStatus.IN_PROGRESS or found.attempts < self.max_attempts:
                    break
                cur.execute(f"UPDATE {TABLE} SET status = ?, completed_at = ?, expires_at = ?, error_code = ?,"
                            " error_message = ?, lease_owner = '', lease_until = 0 WHERE id = ?",
                            (JobStatus.FAILED.value, now, now + self.ttl_s, RESTARTED_TOO_OFTEN,
                             restarted_too_often(found), found.id))
            job = claimed(found, worker, lease_now + lease_s, now)
            cur.execute(f"UPDATE {TABLE} SET status = ?, attempts = ?, restarted_reason = ?, lease_owner = ?,"
                        " lease_until = ?, started_at = ?, progress = ? WHERE id = ?",
                        (job.status.value, job.attempts, job.restarted_reason, job.lease_owner, job.lease_until,
                         job.started_at, job.progress, job.id))
            return job
        return await self._run(run)

    async def renew(self, job_id: str, worker: str, lease_s: float, now: float, progress: int | None) -> bool:
        progress = None if progress is None else min(100, max(0, int(progress)))

        def run(cur: Cursor) -> bool:
            lease_until = self._lease_now(cur, now) + lease_s
            return cur.execute(
                f"UPDATE {TABLE} SET lease_until = ?, progress = COALESCE(?, progress)"
                " WHERE pipeline = ? AND id = ? AND lease_owner = ? AND status = ?",
                (lease_until, progress, self.pipeline, job_id, worker, JobStatus.IN_PROGRESS.value)).rowcount == 1
        return await self._run(run)

    async def release(self, job_id: str, worker: str, now: float) -> bool:
        def run(cur: Cursor) -> bool:
            # Queued again, as it was created (its created_at keeps its place: claimed first); the next claim
            # keeps this reason. A drain stopped the run, not the job: its claim is given back (attempts - 1), so
            # hand-backs in a rolling upgrade never use up the restarts a job gets (max_attempts).
            return cur.execute(
                f"UPDATE {TABLE} SET status = ?, lease_owner = '', lease_until = 0, started_at = NULL, progress = 0,"
                " attempts = attempts - 1, restarted_reason = ?"
                " WHERE pipeline = ? AND id = ? AND lease_owner = ? AND status = ?",
                (JobStatus.QUEUED.value, released_reason(worker, now), self.pipeline, job_id, worker,
                 JobStatus.IN_PROGRESS.value)).rowcount == 1
        return await self._run(run)

    async def finish(self, job_id: str, worker: str, now: float, ttl_s: float, content: dict[str, int]) -> bool:
        def run(cur: Cursor) -> bool:
            done = cur.execute(
                f"UPDATE {TABLE} SET status = ?, progress = 100, completed_at = ?, expires_at = ?, content = ?,"
                " lease_until = 0 WHERE pipeline = ? AND id = ? AND lease_owner = ? AND status = ?",
                (JobStatus.COMPLETED.value, now, now + ttl_s, json.dumps(content), self.pipeline, job_id, worker,
                 JobStatus.IN_PROGRESS.value)).rowcount == 1
            # A retried finish whose first try committed (the reply was lost with the connection) is done too.
            return done or self._already(cur, job_id, worker, JobStatus.COMPLETED)
        return await self._run(run)

    async def fail(self, job_id: str, worker: str | None, now: float, ttl_s: float, code: str, message: str) -> bool:
        def run(cur: Cursor) -> bool:
            sets = ("status = ?, completed_at = ?, expires_at = ?, error_code = ?, error_message = ?,"
                    " lease_until = 0")
            values = [JobStatus.FAILED.value, now, now + ttl_s, code, message, self.pipeline, job_id]
            if worker is None:  # a cancel: any unfinished job; its runner sees renew() False
                return cur.execute(f"UPDATE {TABLE} SET {sets}, lease_owner = '' WHERE pipeline = ? AND id = ?"
                                   " AND status IN (?, ?)",
                                   (*values, JobStatus.QUEUED.value, JobStatus.IN_PROGRESS.value)).rowcount == 1
            done = cur.execute(f"UPDATE {TABLE} SET {sets} WHERE pipeline = ? AND id = ? AND lease_owner = ?"
                               " AND status = ?", (*values, worker, JobStatus.IN_PROGRESS.value)).rowcount == 1
            return done or self._already(cur, job_id, worker, JobStatus.FAILED)
        return await self._run(run)

    async def expired(self, now: float, limit: int) -> builtins.list[Job]:
        def run(cur: Cursor) -> list[Job]:
            rows = cur.execute(f"{_SELECT_STATE} WHERE pipeline = ? AND status IN (?, ?) AND expires_at <= ?"
                               " ORDER BY expires_at, id LIMIT ?",
                               (self.pipeline, *_FINISHED_VALUES, now, limit)).fetchall()
            return [from_row(r) for r in rows]
        return await self._run(run, write=False)

    async def counts(self) -> dict[str, int]:
        def run(cur: Cursor) -> dict[str, int]:
            found = dict(cur.execute(f"SELECT status, COUNT(*) FROM {TABLE} WHERE pipeline = ? GROUP BY status",
                                     (self.pipeline,)).fetchall())
            return {s.value: int(found.get(s.value, 0)) for s in JobStatus}
        return await self._run(run, write=False)

    # ---- transactions on the worker threads
    def _already(self, cur: Cursor, job_id: str, worker: str, status: JobStatus) -> bool:
        row = cur.execute(f"SELECT status, lease_owner FROM {TABLE} WHERE pipeline = ? AND id = ?",
                          (self.pipeline, job_id)).fetchone()
        return row is not None and row[0] == status.value and row[1] == worker

    async def _run(self, fn: Callable[[Cursor], T], write: bool = True) -> T:
        if self._closed:
            raise RuntimeError(f"job store {self.name} is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._transaction, fn, write)

    def _transaction(self, fn: Callable[[Cursor], T], write: bool) -> T:
        connection, reused = self._take()
        try:
            cur = Cursor(connection.cursor(), self.dialect)
            try:
                cur.execute(self.dialect.begin_write if write else "BEGIN")
            except Exception as error:
                if not (reused and self._unreachable(error) and self._lost(connection)):
                    raise
                # A pooled connection whose server restarted: the server never saw this transaction, so it
                # is safe to begin it again on a new connection (the other idle ones are as stale).
                self._close_quietly(connection)
                self._drop_idle()
                connection, _ = self._take(fresh=True)
                cur = Cursor(connection.cursor(), self.dialect)
                cur.execute(self.dialect.begin_write if write else "BEGIN")
            result = fn(cur)
            cur.execute("COMMIT")
        except BaseException as error:
            if isinstance(error, Exception) and self._unreachable(error):
                # Never reused: its server or file may have been replaced since (a new one is opened next time).
                self._close_quietly(connection)
                raise self._unavailable(error) from error
            if self._rollback(connection):
                self._give_back(connection)
            raise
        self._give_back(connection)
        self._reachable()
        return result

    def _unavailable(self, error: Exception) -> StoreUnavailable:
        """The error callers get for `error`; its detail (server, driver error) is logged once per outage."""
        with self._down_lock:
            first, self._down = not self._down, True
        if first:
            log.warning("jobs: the store %s cannot be reached: %s (job calls answer 503 until it is back)",
                        self.name, error)
        return StoreUnavailable(UNREACHABLE)

    def _reachable(self) -> None:
        if self._down:
            with self._down_lock:
                was, self._down = self._down, False
            if was:
                log.info("jobs: the store %s is reachable again", self.name)

    def _take(self, fresh: bool = False) -> tuple[Any, bool]:
        if not fresh:
            with self._idle_lock:
                while self._idle:
                    connection = self._idle.pop()
                    if not self._lost(connection):
                        return connection, True
                    self._close_quietly(connection)
        try:
            connection = self._connect()
        except Exception as error:
            if self._unreachable(error):
                raise self._unavailable(error) from error
            raise
        try:
            self._prepare(connection)
        except BaseException as error:
            self._close_quietly(connection)
            if isinstance(error, Exception) and self._unreachable(error):
                raise self._unavailable(error) from error
            raise
        return connection, False

    def _prepare(self, connection: Any) -> None:
        """Create the schema on a new connection when the database has none (a first start, or a database that
        came back empty), or migrate the table an older orchestrator made; looking needs no write lock, so reads go
        on while another process writes. Under the lock it is all done again (each step a no-op once done): a
        replica starting beside this one may have done it first."""
        cur = Cursor(connection.cursor(), self.dialect)
        if (cur.execute(self.dialect.table_exists, (TABLE,)).fetchone()[0]
                and cur.execute(self.dialect.column_exists, (TABLE, "pipeline")).fetchone()[0]):
            return
        cur.execute(self.dialect.begin_write)
        try:
            self._lock_schema(cur)
            table, *indexes = schema(self.dialect)
            cur.execute(table)
            migrate(cur, self.dialect, self.pipeline)
            for statement in indexes:
                cur.execute(statement)
            cur.execute("COMMIT")
        except BaseException:
            self._rollback(connection)
            raise

    def _rollback(self, connection: Any) -> bool:
        """Roll back what the failed transaction left; False (and the connection closed) when that fails too."""
        if self._lost(connection):
            self._close_quietly(connection)
            return False
        try:
            connection.cursor().execute("ROLLBACK")
        except Exception:  # noqa: BLE001 - any failure here means the connection is unusable: drop it
            self._close_quietly(connection)
            return False
        return True

    def _give_back(self, connection: Any) -> None:
        with self._idle_lock:
            if not self._closed:
                self._idle.append(connection)
                return
        self._close_quietly(connection)

    def _drop_idle(self) -> None:
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            self._close_quietly(connection)

    def _shutdown(self) -> None:
        self._executor.shutdown(wait=True)
        self._drop_idle()

    @staticmethod
    def _close_quietly(connection: Any) -> None:
        try:
            connection.close()
        except Exception:  # noqa: BLE001 - closing a connection that is already broken may fail in any way
            pass
