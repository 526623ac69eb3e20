"""Durable jobs (the /v1/videos API): the store contract (store.py), its SQLite and PostgreSQL backends
(one shared SQL in sql_store.py) and the content files of finished jobs (content.py)."""

from __future__ import annotations

from orchestrator_service.jobs.store import DEFAULT_TTL_S, MAX_ATTEMPTS, JobStore


def open_store(url: str, *, pipeline: str, max_attempts: int = MAX_ATTEMPTS, ttl_s: float = DEFAULT_TTL_S) -> JobStore:
    """The store a `--jobs-store` URL names: `sqlite:///path/jobs.db` or `postgresql://user:pass@host/db`, keeping
    the jobs of `pipeline` (the pipeline's name: pipelines sharing one database never see each other's jobs);
    `max_attempts` claims a job gets, `ttl_s` how long one it fails for lapsing past them is kept.

    Nothing is connected yet: `await store.open()` connects and creates the schema.
    """
    scheme = url.partition(":")[0].lower()
    if scheme == "sqlite":
        from orchestrator_service.jobs.sqlite_store import SqliteJobStore, sqlite_path

        return SqliteJobStore(sqlite_path(url), pipeline, max_attempts=max_attempts, ttl_s=ttl_s)
    if scheme in ("postgresql", "postgres"):
        # imported here: psycopg loads libpq, which an orchestrator on SQLite never needs
        from orchestrator_service.jobs.postgres_store import PostgresJobStore

        return PostgresJobStore(url, pipeline, max_attempts=max_attempts, ttl_s=ttl_s)
    raise ValueError(f"job store URL {url!r}: unknown scheme {scheme!r} (sqlite:///path/jobs.db or postgresql://...)")
