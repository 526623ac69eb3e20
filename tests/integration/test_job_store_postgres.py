"""The job store's contract on a real PostgreSQL server (tests/postgres_server.py starts one), and the store
through a server outage: StoreUnavailable while it is down, the same store object working once it is back."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest

from omnistage.store_url import redacted_url as redacted
from orchestrator_service.jobs import open_store
from orchestrator_service.jobs.postgres_store import PostgresJobStore, owner_lock_key
from orchestrator_service.jobs.store import StoreUnavailable
from tests.jobs_contract import LEASE_S, PIPELINE, JobStoreContract, opened_stores, queued, state
from tests.postgres_server import PostgresServer


@pytest.fixture(scope="module")
def postgres():
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture
async def make_store(postgres):
    url = postgres.create_database()
    # leases on the times the contract passes (`now`), not the server's clock (tested below)
    async for make in opened_stores(lambda pipeline, **settings: PostgresJobStore(url, pipeline, server_clock=False,
                                                                                  **settings)):
        yield make


class TestPostgresJobStore(JobStoreContract):
    pass


async def test_stopped_server_is_unavailable_then_the_store_recovers(postgres, make_store):
    store = await make_store()
    job = await store.create(queued(), max_queued=8)
    await store.counts()  # a few pooled connections the restart will leave dead
    postgres.stop()
    try:
        with pytest.raises(StoreUnavailable, match="cannot be reached"):
            await store.get(job.id, "key-a")
        with pytest.raises(StoreUnavailable):
            await store.create(queued(), max_queued=8)
        with pytest.raises(StoreUnavailable):
            await store.claim("orch-1", LEASE_S, now=200)
    finally:
        postgres.start()
    assert await store.get(job.id, "key-a") == state(job)
    claimed = await store.claim("orch-1", LEASE_S, now=200)
    assert claimed is not None and claimed.id == job.id
    assert await store.counts() == {"queued": 0, "in_progress": 1, "completed": 0, "failed": 0}


async def test_a_restart_between_calls_fails_no_call(postgres, make_store):
    store = await make_store()
    job = await store.create(queued(), max_queued=8)
    postgres.stop()  # every pooled connection dies with the server
    postgres.start()
    assert await store.get(job.id, "key-a") == state(job)
    assert await store.renew(job.id, "orch-1", LEASE_S, now=100, progress=1) is False


async def test_a_replica_may_start_while_the_server_is_down(postgres):
    url = postgres.create_database()
    store = open_store(url, pipeline=PIPELINE)
    postgres.stop()
    try:
        with pytest.raises(StoreUnavailable):
            await store.open()
    finally:
        postgres.start()
    try:
        job = await store.create(queued(), max_queued=8)  # connects and creates the schema now
        assert await store.get(job.id, "key-a") == state(job)
    finally:
        await store.close()


def test_messages_never_show_the_password():  # more forms in tests/unit/jobs/test_store_failures.py
    assert redacted("postgresql://jobs:s3cret@db:5432/jobs") == "postgresql://jobs:***@db:5432/jobs"
    assert redacted("postgresql://jobs@db/jobs") == "postgresql://jobs@db/jobs"


async def test_the_urls_own_options_are_kept_beside_the_stores_timeouts(postgres):
    """A search_path the URL sets (`options=-csearch_path=video`) is honoured: the table lands in that schema,
    and the store's own statement timeout holds too."""
    url = postgres.create_database()
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("CREATE SCHEMA video")
    store = open_store(url + ("&" if "?" in url else "?") + "options=-csearch_path%3Dvideo", pipeline=PIPELINE)
    try:
        job = await store.create(queued(), max_queued=8)
        assert await store.get(job.id, "key-a") == state(job)
        assert isinstance(store, PostgresJobStore)
        timeout = await store._run(lambda cur: cur.execute("SHOW statement_timeout").fetchone()[0], write=False)
        assert timeout == "30s"
    finally:
        await store.close()
    with psycopg.connect(url) as admin:
        assert admin.execute("SELECT to_regclass('video.omnistage_jobs') IS NOT NULL,"
                             " to_regclass('public.omnistage_jobs') IS NOT NULL").fetchone() == (True, False)


async def test_leases_run_on_the_servers_clock_so_a_skewed_replica_takes_no_fresh_lease(postgres):
    """Replicas whose clocks disagree by more than a lease: lease times are the server's, so a replica an hour
    ahead never takes over a lease another replica just took, and one an hour behind renews it to the server's
    now plus the lease; a lease that did run out (by the server's clock) is taken over as ever."""
    url = postgres.create_database()
    holder, ahead = open_store(url, pipeline=PIPELINE), open_store(url, pipeline=PIPELINE)
    try:
        job = await holder.create(queued(), max_queued=8)
        now = time.time()
        claimed = await holder.claim("orch-1", LEASE_S, now=now - 3600)  # orch-1's clock an hour behind
        assert claimed is not None and claimed.id == job.id
        assert await ahead.claim("orch-2", LEASE_S, now=now + 3600) is None  # orch-2's an hour ahead
        assert await holder.renew(job.id, "orch-1", LEASE_S, now=now - 3600, progress=10)
        row = await ahead.get(job.id, "key-a")
        # the server's now, not orch-1's
        assert row is not None and row.lease_owner == "orch-1" and row.lease_until > now - 60
        assert await holder.renew(job.id, "orch-1", 0.0, now=now - 3600, progress=20)  # a lease that ends now
        taken = await ahead.claim("orch-2", LEASE_S, now=now - 7200)  # run out by the server's clock
        assert taken is not None and (taken.id, taken.attempts, taken.lease_owner) == (job.id, 2, "orch-2")
    finally:
        await holder.close()
        await ahead.close()


async def test_a_lock_held_by_a_frozen_replica_fails_as_unavailable_not_forever(postgres):
    """A replica frozen inside a creation (its owner's quota lock held) makes another's creation for that owner
    fail as unavailable once the statement timeout passes, and work once the lock is released."""
    url = postgres.create_database()
    store = PostgresJobStore(url, PIPELINE, statement_timeout_s=1)
    await store.open()
    frozen = await asyncio.to_thread(psycopg.connect, url)  # a transaction that holds the lock and never ends
    try:
        await asyncio.to_thread(frozen.execute, "SELECT pg_advisory_xact_lock(%s)", (owner_lock_key("key-a"),))
        with pytest.raises(StoreUnavailable) as e:
            # the bound only keeps a hang from stalling the suite; the store must fail on its own
            await asyncio.wait_for(store.create(queued("key-a"), max_queued=8), timeout=120)
        assert "statement timeout" in str(e.value.__cause__)
        await store.create(queued("key-b"), max_queued=8)  # other owners never waited
        await asyncio.to_thread(frozen.rollback)
        job = await store.create(queued("key-a"), max_queued=8)
        assert await store.get(job.id, "key-a") == state(job)
    finally:
        await asyncio.to_thread(frozen.close)
        await store.close()
