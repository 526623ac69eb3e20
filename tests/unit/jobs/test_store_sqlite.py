"""The job store's contract on SQLite, two store objects on one file acting as two orchestrators, and what
makes the file unreachable (StoreUnavailable)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys

import pytest

from orchestrator_service.jobs import open_store
from orchestrator_service.jobs.sqlite_store import SqliteJobStore, sqlite_path
from orchestrator_service.jobs.store import StoreUnavailable
from tests.jobs_contract import PIPELINE, JobStoreContract, create_many, opened_stores, queued, state

# Writers from two stores take turns on the file's lock; on a loaded test machine's disk a turn may take long,
# so the tests wait longer than the 5 s an orchestrator does (a bound, never reached when things work).
TEST_BUSY_TIMEOUT_S = 60.0


@pytest.fixture
async def make_store(tmp_path):
    async for make in opened_stores(lambda pipeline, **settings: SqliteJobStore(
            tmp_path / "state" / "jobs.db", pipeline, busy_timeout_s=TEST_BUSY_TIMEOUT_S, **settings)):
        yield make


class TestSqliteJobStore(JobStoreContract):
    pass


async def test_the_file_is_in_wal_mode(make_store, tmp_path):
    await make_store()
    with sqlite3.connect(tmp_path / "state" / "jobs.db") as reader:
        assert reader.execute("PRAGMA journal_mode").fetchone() == ("wal",)


async def test_a_file_that_is_no_database_is_unavailable_until_replaced(tmp_path):
    path = tmp_path / "jobs.db"
    path.write_bytes(b"this is not a database file, " * 200)
    store = SqliteJobStore(path, PIPELINE)
    try:
        with pytest.raises(StoreUnavailable) as e:
            await store.open()
        assert "not a database" in str(e.value.__cause__)  # the detail: the cause (and the log), not the message
        with pytest.raises(StoreUnavailable):
            await store.create(queued(), max_queued=4)
        path.unlink()  # the operator restores the volume: the same store object works again
        job = await store.create(queued(), max_queued=4)
        assert await store.get(job.id, "key-a") == state(job)
    finally:
        await store.close()


async def test_a_path_that_cannot_be_created_is_unavailable(tmp_path):
    (tmp_path / "file").write_text("a file where the folder should be")
    store = SqliteJobStore(tmp_path / "file" / "jobs.db", PIPELINE)
    try:
        with pytest.raises(StoreUnavailable, match="cannot be reached") as e:
            await store.counts()
        assert isinstance(e.value.__cause__, OSError)
    finally:
        await store.close()


@pytest.mark.parametrize(("url", "path"), [("sqlite:///var/lib/jobs.db", "/var/lib/jobs.db"),
                                           ("sqlite:////var/lib/jobs.db", "/var/lib/jobs.db"),
                                           ("sqlite:state/jobs.db", "state/jobs.db")])
def test_sqlite_urls_name_a_file(url, path):
    assert str(sqlite_path(url)) == path
    assert isinstance(open_store(url, pipeline=PIPELINE), SqliteJobStore)


@pytest.mark.parametrize(("url", "message"), [("sqlite://host/jobs.db", "not a host"), ("sqlite://", "names no file"),
                                              ("mysql://db/jobs", "unknown scheme 'mysql'"),
                                              ("/var/lib/jobs.db", "unknown scheme")])
def test_bad_store_urls_are_refused_by_name(url, message):
    with pytest.raises(ValueError, match=message):
        open_store(url, pipeline=PIPELINE)


CLAIMER = """
import asyncio, json, sys
from orchestrator_service.jobs.sqlite_store import SqliteJobStore

async def main():
    store = SqliteJobStore(sys.argv[1], sys.argv[3], busy_timeout_s=float(sys.argv[2]))
    await store.open()
    print("ready", flush=True)
    sys.stdin.readline()
    claimed = []
    while (job := await store.claim("orch-2", 10.0, now=500.0)) is not None:
        claimed.append(job.id)
    await store.close()
    print(json.dumps(claimed), flush=True)

asyncio.run(main())
"""


async def test_two_processes_on_one_file_claim_each_job_once(make_store, tmp_path):
    store = await make_store()
    jobs = await create_many(store, 40)
    argv = [sys.executable, "-c", CLAIMER, str(tmp_path / "state" / "jobs.db"), str(TEST_BUSY_TIMEOUT_S), PIPELINE]
    other = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert await asyncio.to_thread(other.stdout.readline) == "ready\n"
        other.stdin.write("go\n")
        other.stdin.flush()
        mine = []
        while (job := await store.claim("orch-1", 10.0, now=500.0)) is not None:
            mine.append(job.id)
        out, _ = await asyncio.to_thread(other.communicate, timeout=120)
    finally:
        if other.poll() is None:
            other.kill()
    theirs = json.loads(out)
    assert sorted(mine + theirs) == sorted(j.id for j in jobs)  # each job claimed once, by one process
    rows = [await store.get(job_id, "key-a") for job_id in theirs]
    assert all(r.lease_owner == "orch-2" and r.attempts == 1 for r in rows)


async def test_a_write_lock_held_past_the_busy_timeout_is_unavailable_then_released(tmp_path):
    """Another process stuck inside a write transaction: this store's writes fail as unavailable (the caller
    answers 503) instead of waiting for good, its reads go on (WAL), and it writes again once the lock is free."""
    path = tmp_path / "jobs.db"
    store = SqliteJobStore(path, PIPELINE, busy_timeout_s=0.5)
    try:
        job = await store.create(queued(), max_queued=8)
        stuck = sqlite3.connect(path, isolation_level=None)
        stuck.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(StoreUnavailable) as e:
                await store.claim("orch-1", 10.0, now=200)
            assert "locked" in str(e.value.__cause__)
            assert await store.get(job.id, "key-a") == state(job)
        finally:
            stuck.rollback()
            stuck.close()
        assert (await store.claim("orch-1", 10.0, now=200)).id == job.id
    finally:
        await store.close()
