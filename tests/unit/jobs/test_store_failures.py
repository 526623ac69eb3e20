"""How the job store fails: what an API client is told when the store is unreachable (never its address or the
driver's words: those go to the log, once per outage), which SQLite errors are unavailability and which are
errors, and a content folder whose file system refuses to fsync a directory."""

from __future__ import annotations

import errno
import logging
import os
import socket
import sqlite3
import stat

import grpc
import pytest
import yaml

from omnistage.api import parse_pipeline
from omnistage.contract.request import build_request
from omnistage.store_url import redacted_url as redacted
from orchestrator_service.jobs import content as content_module
from orchestrator_service.jobs.api import JobApi
from orchestrator_service.jobs.content import ContentStore
from orchestrator_service.jobs.postgres_store import PostgresJobStore
from orchestrator_service.jobs.sqlite_store import SqliteJobStore
from orchestrator_service.jobs.store import StoreUnavailable
from orchestrator_service.servicer import Refused
from tests.jobs_contract import PIPELINE, queued

from ...conftest import EXAMPLES

STORE_LOG = "omnistage.orchestrator.jobs.store"


def wan():
    return parse_pipeline(yaml.safe_load((EXAMPLES / "wan-t2v-tiny.yaml").read_text()))


def closed_port() -> int:
    """A loopback port nothing listens on (connecting to it is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == STORE_LOG and r.levelno >= logging.WARNING]


async def test_an_unreachable_store_tells_the_client_only_to_retry_and_logs_the_detail_once(caplog):
    caplog.set_level(logging.INFO, logger=STORE_LOG)
    url = f"postgresql://jobuser:s3cret@127.0.0.1:{closed_port()}/jobsdb?sslmode=disable"
    pipeline = wan()
    store = PostgresJobStore(url, pipeline.name)
    api = JobApi(pipeline, store, None)
    try:
        refusals = []
        for call in (lambda: api.create(build_request("a cat", outputs=["video"]), ""),
                     lambda: api.get("video_" + "0" * 32, "")):
            with pytest.raises(Refused) as e:
                await call()
            refusals.append(e.value)
        with pytest.raises(StoreUnavailable) as raised:
            await store.counts()
    finally:
        await store.close()
    for refusal in refusals:
        assert refusal.code == grpc.StatusCode.UNAVAILABLE and refusal.retry_after_s == 5
        assert refusal.message == "the job store is unreachable; retry after 5 s"
    for told in [*(r.message for r in refusals), str(raised.value)]:
        for secret in ("127.0.0.1", "jobuser", "s3cret", "jobsdb", "refused"):
            assert secret not in told, told
    logged = warnings_of(caplog)  # the detail, for the operator: once for the three failed calls
    assert len(logged) == 1 and "127.0.0.1" in logged[0] and "refused" in logged[0].lower(), logged
    assert "s3cret" not in caplog.text


async def test_each_outage_is_logged_once_and_its_end_too(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=STORE_LOG)
    path = tmp_path / "jobs.db"
    store = SqliteJobStore(path, PIPELINE, busy_timeout_s=0.5)
    try:
        job = await store.create(queued(), max_queued=8)
        for outage in range(2):
            stuck = sqlite3.connect(path, isolation_level=None)
            stuck.execute("BEGIN IMMEDIATE")  # another process holding the write lock past the busy timeout
            try:
                for _ in range(3):
                    with pytest.raises(StoreUnavailable):
                        await store.renew(job.id, "orch-1", 10.0, now=100, progress=None)
            finally:
                stuck.rollback()
                stuck.close()
            assert len(warnings_of(caplog)) == outage + 1
            assert "locked" in warnings_of(caplog)[-1]
            await store.counts()  # reachable again: said once
            assert sum("reachable again" in r.getMessage() for r in caplog.records) == outage + 1
    finally:
        await store.close()


async def test_a_sql_error_is_an_error_not_an_unreachable_store(tmp_path):
    """A table that does not match the code (a column missing) fails every call alike: raised as what it is,
    never a 503 to retry for good."""
    path = tmp_path / "jobs.db"
    store = SqliteJobStore(path, PIPELINE)
    try:
        job = await store.create(queued(), max_queued=8)
        with sqlite3.connect(path, isolation_level=None) as other:
            other.execute("ALTER TABLE omnistage_jobs DROP COLUMN restarted_reason")
        with pytest.raises(sqlite3.OperationalError, match="no such column"):
            await store.get(job.id, "key-a")
    finally:
        await store.close()


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://jobs:s3cret@db:5432/jobs", "postgresql://jobs:***@db:5432/jobs"),
    ("postgresql://u@db:5432/x?password=s3cret", "postgresql://u@db:5432/x?password=***"),
    ("postgresql://u:pw@db/x?sslmode=require&password=s3cret&application_name=a",
     "postgresql://u:***@db/x?sslmode=require&password=***&application_name=a"),
    ("postgresql://jobs@db/jobs", "postgresql://jobs@db/jobs"),
])
def test_messages_never_show_a_password(url, shown):
    assert redacted(url) == shown


def _refusing_directories(real_fsync, code):
    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        real_fsync(fd)
    return fsync


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EBADF])
def test_a_file_system_that_cannot_fsync_a_folder_still_stores_content(tmp_path, monkeypatch, code):
    """Some network file systems refuse fsync on a directory (EINVAL, EBADF): the rename is done, the file is
    kept (as PostgreSQL does with its own directories)."""
    monkeypatch.setattr(content_module.os, "fsync", _refusing_directories(os.fsync, code))
    store = ContentStore(tmp_path)
    assert store.put("video_1", "video", b"mp4 bytes") == 9
    kept = store.path("video_1", "video")
    assert kept is not None and kept.read_bytes() == b"mp4 bytes"


def test_a_failing_disk_still_fails_the_put(tmp_path, monkeypatch):
    monkeypatch.setattr(content_module.os, "fsync", _refusing_directories(os.fsync, errno.EIO))
    with pytest.raises(OSError, match="Input/output"):
        ContentStore(tmp_path).put("video_1", "video", b"mp4 bytes")


def test_max_attempts_is_an_orchestrator_flag_passed_to_the_store(tmp_path):
    from omnistage.contract import launch
    from orchestrator_service.jobs import open_store
    from orchestrator_service.jobs.api import JobSettings
    from orchestrator_service.jobs.replica import JobsFlagError, check_settings

    parser = launch.orchestrator_parser()
    assert parser.parse_args(["--pipeline", "p.yaml"]).jobs_max_attempts == 3
    assert parser.parse_args(["--pipeline", "p.yaml", "--jobs-max-attempts", "5"]).jobs_max_attempts == 5
    with pytest.raises(JobsFlagError, match="--jobs-max-attempts 0: at least 1"):
        check_settings(JobSettings(max_attempts=0))
    store = open_store(f"sqlite:///{tmp_path}/jobs.db", pipeline=PIPELINE, max_attempts=5, ttl_s=60.0)
    assert (store.max_attempts, store.ttl_s) == (5, 60.0)  # type: ignore[attr-defined]
