"""The job store's contract: one suite every backend passes (SQLite in tests/unit/jobs, PostgreSQL in
tests/integration). A backend's test class subclasses `JobStoreContract` and gives the `make_store` fixture:
an async factory of opened stores, all on ONE database, so two of them act as two orchestrator replicas
(of one pipeline, PIPELINE, unless the factory is given another's name; store settings such as `max_attempts` as
keywords). Every time is passed in; no test waits on a clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import pytest

from orchestrator_service.jobs.sql_store import TABLE, Cursor, SqlJobStore
from orchestrator_service.jobs.store import MAX_ATTEMPTS, Job, JobStatus, JobStore, QuotaExceeded, new_job_id

LEASE_S = 10.0
TTL_S = 3600.0
PIPELINE = "pipe-a"  # the pipeline the stores serve unless a test names another


class MakeStore(Protocol):
    def __call__(self, pipeline: str = PIPELINE, **settings: Any) -> Awaitable[JobStore]: ...


# The table as the store made it before jobs named their pipeline (a database an older orchestrator left); its
# column types are the backend's (`blob`, `real`).
TABLE_BEFORE_PIPELINES = f"""CREATE TABLE {TABLE} (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL, request {{blob}} NOT NULL,
    created_at {{real}} NOT NULL, progress INTEGER NOT NULL DEFAULT 0, started_at {{real}}, completed_at {{real}},
    expires_at {{real}}, error_code TEXT NOT NULL DEFAULT '', error_message TEXT NOT NULL DEFAULT '',
    attempts INTEGER NOT NULL DEFAULT 0, restarted_reason TEXT NOT NULL DEFAULT '',
    lease_owner TEXT NOT NULL DEFAULT '', lease_until {{real}} NOT NULL DEFAULT 0,
    meta TEXT NOT NULL DEFAULT '{{{{}}}}', content TEXT NOT NULL DEFAULT '{{{{}}}}')"""
INDEXES_BEFORE_PIPELINES = (f"CREATE INDEX {TABLE}_owner_created ON {TABLE} (owner, created_at, id)",
                            f"CREATE INDEX {TABLE}_status_created ON {TABLE} (status, created_at, id)")


async def opened_stores(new: Callable[..., SqlJobStore]) -> AsyncIterator[MakeStore]:
    """The `make_store` fixture of a backend: `new(pipeline, **settings)` builds a store, opened here and closed
    when the test ends."""
    stores: list[SqlJobStore] = []

    async def make(pipeline: str = PIPELINE, **settings) -> SqlJobStore:
        store = new(pipeline, **settings)
        await store.open()
        stores.append(store)
        return store
    yield make
    for store in stores:
        await store.close()


def queued(owner: str = "key-a", created_at: float = 100.0, **fields) -> Job:
    return Job(id=new_job_id(), owner=owner, kind="video", status=JobStatus.QUEUED, request=b"\x00request\xff",
               created_at=created_at, **fields)


def state(job: Job) -> Job:
    """A job as reads return it: its state, the request left in the store (a claim reads it)."""
    return dataclasses.replace(job, request=b"")


async def create_many(store: JobStore, n: int, owner: str = "key-a", start: float = 100.0) -> list[Job]:
    return [await store.create(queued(owner, start + i), max_queued=1000) for i in range(n)]


class JobStoreContract:
    """The tests; subclasses name the backend and provide `make_store`."""

    async def test_a_created_job_reads_back_field_for_field(self, make_store: MakeStore):
        store = await make_store()
        job = queued(meta={"model": "wan-t2v-tiny", "size": "832x480", "seconds": "4", "fps": 16},
                     content={"video": 0})
        created = await store.create(job, max_queued=4)
        assert created == dataclasses.replace(job, pipeline=PIPELINE)  # the store's pipeline is the job's
        # Reads leave the request (a reference image may be megabytes) in the store; the claim reads it whole.
        assert await store.get(job.id, "key-a") == state(created)
        assert [j.request for j in (await store.list("key-a", None, 10, "desc"))[0]] == [b""]
        claimed = await store.claim("w1", 10.0, 200.0)
        assert claimed is not None and claimed.id == job.id and claimed.request == job.request
        named = queued(pipeline=PIPELINE)
        assert await store.create(named, max_queued=4) == named
        with pytest.raises(ValueError, match="pipe-b"):  # a job of another pipeline is not this store's to keep
            await store.create(queued(pipeline="pipe-b"), max_queued=4)

    async def test_two_pipelines_on_one_database_never_see_or_claim_each_others_jobs(self, make_store: MakeStore):
        a, b = await make_store("pipe-a"), await make_store("pipe-b")
        ja = await a.create(queued("key-a", 100), max_queued=1)
        jb = await b.create(queued("key-a", 200), max_queued=1)  # the same key's quota is per pipeline
        assert (ja.pipeline, jb.pipeline) == ("pipe-a", "pipe-b")
        assert await b.get(ja.id, "key-a") is None and await a.get(jb.id, "key-a") is None
        assert await a.list("key-a", None, 10, "asc") == ([state(ja)], False)
        assert await b.list("key-a", None, 10, "desc") == ([state(jb)], False)
        with pytest.raises(ValueError, match="after"):  # another pipeline's id is no cursor
            await b.list("key-a", ja.id, 10, "asc")
        assert await b.counts() == {"queued": 1, "in_progress": 0, "completed": 0, "failed": 0}
        # b's claims take only b's job, though a's is older; a's never, not even once its lease ran out
        assert (await b.claim("orch-b", LEASE_S, now=300)).id == jb.id
        assert await b.claim("orch-b", LEASE_S, now=300) is None
        assert (await a.claim("orch-a", LEASE_S, now=300)).id == ja.id
        assert (await b.claim("orch-b2", LEASE_S, now=10_000)).id == jb.id  # both leases ran out: b's own only
        assert await b.claim("orch-b2", LEASE_S, now=10_000) is None
        # nor renew, finish, fail, cancel, release or delete them
        assert not await b.renew(ja.id, "orch-a", LEASE_S, now=301, progress=5)
        assert not await b.finish(ja.id, "orch-a", now=301, ttl_s=TTL_S, content={})
        assert not await b.fail(ja.id, "orch-a", now=301, ttl_s=TTL_S, code="x", message="y")
        assert not await b.fail(ja.id, None, now=301, ttl_s=TTL_S, code="cancelled", message="cancelled")
        assert not await b.release(ja.id, "orch-a", now=301)
        assert await b.delete(ja.id, "key-a") is None
        assert await a.finish(ja.id, "orch-a", now=302, ttl_s=0, content={"video": 1})
        assert await b.expired(now=10_000, limit=10) == []  # b's sweeper leaves a's content alone
        assert [j.id for j in await a.expired(now=10_000, limit=10)] == [ja.id]
        assert await b.counts() == {"queued": 0, "in_progress": 1, "completed": 0, "failed": 0}
        assert await a.counts() == {"queued": 0, "in_progress": 0, "completed": 1, "failed": 0}

    async def test_a_table_from_before_pipelines_gains_the_column_and_keeps_its_jobs(self, make_store: MakeStore):
        """A database an older orchestrator made: its rows go to the pipeline their `model` names (the pipeline
        that made them); two replicas starting on it at once both migrate it (once)."""
        older = await make_store()
        assert isinstance(older, SqlJobStore)
        rows = [queued("key-a", 100, meta={"model": "pipe-a"}), queued("key-a", 200, meta={"model": "pipe-b"})]

        def insert_as_before(cur: Cursor, job: Job) -> None:  # as an older orchestrator writes a job
            cur.execute(f"INSERT INTO {TABLE} (id, owner, kind, status, request, created_at, meta)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?)", (job.id, job.owner, job.kind, job.status.value, job.request,
                                                        job.created_at, json.dumps(job.meta)))

        def make_old_table(cur: Cursor) -> None:
            cur.execute(f"DROP TABLE {TABLE}")
            cur.execute(TABLE_BEFORE_PIPELINES.format(blob=older.dialect.blob, real=older.dialect.real))
            for statement in INDEXES_BEFORE_PIPELINES:
                cur.execute(statement)
            for job in rows:
                insert_as_before(cur, job)
        await older._run(make_old_table)  # the store's own transaction, on the same database
        a, b = await asyncio.gather(make_store("pipe-a"), make_store("pipe-b"))
        for store, row, name in ((a, rows[0], "pipe-a"), (b, rows[1], "pipe-b")):
            want = state(dataclasses.replace(row, pipeline=name))
            assert await store.list("key-a", None, 10, "asc") == ([want], False)
        # an older replica still running beside these (a rolling upgrade) queues a job naming no pipeline:
        # the next claim adopts it for the pipeline its model names
        late = queued("key-a", 50, meta={"model": "pipe-b"})
        await older._run(lambda cur: insert_as_before(cur, late))
        assert (await a.claim("orch-a", LEASE_S, now=300)).id == rows[0].id  # `late` adopted for pipe-b on the way
        assert (await b.get(late.id, "key-a")).pipeline == "pipe-b"
        assert (await b.claim("orch-b", LEASE_S, now=300)).id == late.id  # the oldest
        assert (await b.claim("orch-b", LEASE_S, now=300)).id == rows[1].id
        assert await b.claim("orch-b", LEASE_S, now=300) is None
        again = await make_store("pipe-a")  # a later start finds the column there
        assert (await again.create(queued("key-a", 300), max_queued=4)).pipeline == "pipe-a"
        assert await again.counts() == {"queued": 1, "in_progress": 1, "completed": 0, "failed": 0}

    async def test_another_owners_job_is_invisible(self, make_store: MakeStore):
        store = await make_store()
        job = await store.create(queued("key-a"), max_queued=4)
        assert await store.get(job.id, "key-b") is None
        assert await store.list("key-b", None, 10, "asc") == ([], False)
        assert await store.delete(job.id, "key-b") is None
        assert await store.get(job.id, "key-a") == state(job)
        with pytest.raises(ValueError, match="after"):  # another owner's id is no cursor either
            await store.list("key-b", job.id, 10, "asc")

    async def test_quota_refuses_past_max_queued_per_owner(self, make_store: MakeStore):
        store = await make_store()
        for i in range(3):
            await store.create(queued("key-a", 100 + i), max_queued=3)
        with pytest.raises(QuotaExceeded, match="3 jobs queued"):
            await store.create(queued("key-a", 200), max_queued=3)
        await store.create(queued("key-b", 200), max_queued=3)  # another key's quota is its own
        assert await store.claim("orch-1", LEASE_S, now=300) is not None  # running jobs do not count
        await store.create(queued("key-a", 300), max_queued=3)
        assert (await store.counts())["queued"] == 4

    async def test_quota_holds_under_concurrent_creates_from_two_replicas(self, make_store: MakeStore):
        stores = [await make_store(), await make_store()]
        results = await asyncio.gather(*(stores[i % 2].create(queued("key-a", 100 + i), max_queued=5)
                                         for i in range(24)), return_exceptions=True)
        created = [r for r in results if isinstance(r, Job)]
        refused = [r for r in results if isinstance(r, QuotaExceeded)]
        assert (len(created), len(refused)) == (5, 19), results
        assert (await stores[0].counts())["queued"] == 5

    async def test_claims_the_oldest_queued_job_first(self, make_store: MakeStore):
        store = await make_store()
        newer = await store.create(queued(created_at=200), max_queued=8)
        older = await store.create(queued(created_at=100), max_queued=8)
        first = await store.claim("orch-1", LEASE_S, now=300)
        assert first is not None and first.id == older.id
        assert (first.status, first.attempts, first.lease_owner, first.lease_until, first.started_at) == (
            JobStatus.IN_PROGRESS, 1, "orch-1", 300 + LEASE_S, 300)
        assert first.restarted_reason == ""
        assert await store.get(older.id, "key-a") == state(first)
        second = await store.claim("orch-1", LEASE_S, now=300)
        assert second is not None and second.id == newer.id
        assert await store.claim("orch-1", LEASE_S, now=300) is None  # both leases live: nothing to claim

    async def test_concurrent_claimers_on_two_replicas_claim_each_job_once(self, make_store: MakeStore):
        stores = [await make_store(), await make_store()]
        jobs = await create_many(stores[0], 30)
        claims = await asyncio.gather(*(stores[i % 2].claim(f"orch-{i % 2}", LEASE_S, now=500) for i in range(80)))
        got = [c for c in claims if c is not None]
        assert sorted(c.id for c in got) == sorted(j.id for j in jobs)  # every job once, none twice
        assert len(got) == 30 and all(c.attempts == 1 for c in got)
        for claim in got:  # the row agrees with the claim its holder was given
            assert (await stores[0].get(claim.id, "key-a")).lease_owner == claim.lease_owner

    async def test_an_expired_lease_is_taken_over_and_restarted(self, make_store: MakeStore):
        dying, survivor = await make_store(), await make_store()
        job = await dying.create(queued(), max_queued=4)
        await dying.claim("orch-1", LEASE_S, now=1000)
        assert await dying.renew(job.id, "orch-1", LEASE_S, now=1005, progress=40)  # leased until 1015
        assert await survivor.claim("orch-2", LEASE_S, now=1015) is None  # not expired yet
        taken = await survivor.claim("orch-2", LEASE_S, now=1016)
        assert taken is not None and taken.id == job.id
        assert (taken.attempts, taken.lease_owner, taken.progress, taken.status) == (
            2, "orch-2", 0, JobStatus.IN_PROGRESS)
        assert taken.restarted_reason == ("orchestrator orch-1 stopped renewing its lease at 1970-01-01T00:16:55Z;"
                                          " restarted from the start")
        # the old holder learns it lost the job: renew, finish and fail all refuse it
        assert not await dying.renew(job.id, "orch-1", LEASE_S, now=1017, progress=90)
        assert not await dying.finish(job.id, "orch-1", now=1017, ttl_s=TTL_S, content={"video": 1})
        assert not await dying.fail(job.id, "orch-1", now=1017, ttl_s=TTL_S, code="x", message="y")
        assert await survivor.renew(job.id, "orch-2", LEASE_S, now=1017, progress=10)
        assert await survivor.finish(job.id, "orch-2", now=1020, ttl_s=TTL_S, content={"video": 123})
        done = await dying.get(job.id, "key-a")
        assert (done.status, done.attempts, done.content, done.progress) == (
            JobStatus.COMPLETED, 2, {"video": 123}, 100)

    async def test_a_job_restarted_too_often_fails_instead_of_running_again(self, make_store: MakeStore):
        """A job whose run kills its replica would be taken over by each replica in turn for good: past
        max_attempts claims it fails, naming why it was restarted, and the claim takes the next job instead."""
        stores = [await make_store(max_attempts=2, ttl_s=60.0) for _ in range(3)]
        poison = await stores[0].create(queued(created_at=100), max_queued=4)
        after = await stores[0].create(queued(created_at=200), max_queued=4)
        assert (await stores[0].claim("orch-1", LEASE_S, now=1000)).id == poison.id  # orch-1 dies running it
        taken = await stores[1].claim("orch-2", LEASE_S, now=1011)
        assert (taken.id, taken.attempts) == (poison.id, 2)  # orch-2 dies too
        instead = await stores[2].claim("orch-3", LEASE_S, now=1022)
        assert instead is not None and (instead.id, instead.attempts) == (after.id, 1)
        failed = await stores[2].get(poison.id, "key-a")
        assert (failed.status, failed.error_code, failed.attempts, failed.lease_owner) == (
            JobStatus.FAILED, "restarted_too_often", 2, "")
        assert (failed.completed_at, failed.expires_at) == (1022, 1022 + 60.0)
        assert failed.error_message == (
            "stopped after 2 attempts, the most a job gets (--jobs-max-attempts), none of which finished: "
            "orchestrator orch-2 stopped renewing its lease at 1970-01-01T00:17:01Z; attempt 2 began because "
            "orchestrator orch-1 stopped renewing its lease at 1970-01-01T00:16:50Z")
        assert not await stores[1].renew(poison.id, "orch-2", LEASE_S, now=1023, progress=5)  # orch-2 lost it
        assert await stores[2].claim("orch-3", LEASE_S, now=5000) is None  # never claimed again
        assert (await stores[0].counts())["failed"] == 1

    async def test_a_claim_never_takes_over_the_claimers_own_expired_lease(self, make_store: MakeStore):
        store, other = await make_store(), await make_store()
        job = await store.create(queued(), max_queued=4)
        await store.claim("orch-1", LEASE_S, now=100)  # leased until 110
        # orch-1's runner still runs it (its renewals were late): its own claim leaves it to that runner
        assert await store.claim("orch-1", LEASE_S, now=200) is None
        row = await store.get(job.id, "key-a")
        assert (row.attempts, row.lease_owner, row.restarted_reason) == (1, "orch-1", "")
        assert await store.renew(job.id, "orch-1", LEASE_S, now=200, progress=30)  # still its own
        taken = await other.claim("orch-2", LEASE_S, now=211)  # another replica takes over a lease run out
        assert taken is not None and (taken.id, taken.attempts) == (job.id, 2)

    async def test_a_draining_replica_releases_its_job_to_be_claimed_at_once(self, make_store: MakeStore):
        draining, other = await make_store(), await make_store()
        job = await draining.create(queued(), max_queued=4)
        assert not await draining.release(job.id, "orch-1", now=100)  # queued: nobody holds it
        await draining.claim("orch-1", LEASE_S, now=100)
        assert await draining.renew(job.id, "orch-1", LEASE_S, now=103, progress=60)  # leased until 113
        assert not await draining.release(job.id, "orch-2", now=104)  # only its holder releases it
        assert await draining.release(job.id, "orch-1", now=104)
        row = await other.get(job.id, "key-a")
        assert (row.status, row.lease_owner, row.lease_until, row.progress, row.started_at, row.attempts) == (
            JobStatus.QUEUED, "", 0, 0, None, 0)  # a hand-back is not an attempt
        assert row.restarted_reason == ("orchestrator orch-1 drained (shut down) at 1970-01-01T00:01:44Z while "
                                        "running it; restarted from the start")
        # claimable at once, long before the lease it had would have run out; the reason stays with it
        taken = await other.claim("orch-2", LEASE_S, now=105)
        assert taken is not None and taken.id == job.id
        assert (taken.attempts, taken.lease_owner, taken.restarted_reason) == (1, "orch-2", row.restarted_reason)
        assert not await draining.release(job.id, "orch-1", now=106)  # no longer its: refused
        assert not await draining.renew(job.id, "orch-1", LEASE_S, now=106, progress=70)
        assert await other.finish(job.id, "orch-2", now=107, ttl_s=TTL_S, content={"video": 1})
        assert not await other.release(job.id, "orch-2", now=108)  # finished: stays finished
        assert (await other.get(job.id, "key-a")).status is JobStatus.COMPLETED

    async def test_drain_hand_backs_do_not_use_up_the_restart_budget(self, make_store: MakeStore):
        """A released job was stopped by a drain, not by its own doing: two drains (a rolling upgrade) and one
        replica dying still leave it its next run."""
        a, b, c, d = [await make_store(max_attempts=MAX_ATTEMPTS, ttl_s=60.0) for _ in range(4)]
        job = await a.create(queued(), max_queued=4)
        await a.claim("orch-a", LEASE_S, now=100)
        assert await a.release(job.id, "orch-a", now=101)
        await b.claim("orch-b", LEASE_S, now=102)
        assert await b.release(job.id, "orch-b", now=103)
        assert (await c.claim("orch-c", LEASE_S, now=104)).attempts == 1  # handed back twice: its first real run
        taken = await d.claim("orch-d", LEASE_S, now=104 + LEASE_S + 1)  # orch-c died: its lease ran out
        assert taken is not None and (taken.id, taken.attempts, taken.status) == (job.id, 2, JobStatus.IN_PROGRESS)
        assert (await d.get(job.id, "key-a")).error_code == ""

    async def test_renew_records_progress_within_0_to_100(self, make_store: MakeStore):
        store = await make_store()
        job = await store.create(queued(), max_queued=4)
        assert not await store.renew(job.id, "orch-1", LEASE_S, now=100, progress=5)  # not claimed: no lease
        await store.claim("orch-1", LEASE_S, now=100)
        assert await store.renew(job.id, "orch-1", LEASE_S, now=101, progress=37)
        assert (await store.get(job.id, "key-a")).progress == 37
        assert await store.renew(job.id, "orch-1", LEASE_S, now=102, progress=None)  # lease only
        assert await store.renew(job.id, "orch-1", LEASE_S, now=103, progress=250)
        row = await store.get(job.id, "key-a")
        assert (row.progress, row.lease_until) == (100, 103 + LEASE_S)

    async def test_finish_and_its_retry(self, make_store: MakeStore):
        store = await make_store()
        job = await store.create(queued(), max_queued=4)
        await store.claim("orch-1", LEASE_S, now=100)
        assert await store.finish(job.id, "orch-1", now=150, ttl_s=TTL_S, content={"video": 10, "thumbnail": 2})
        # a retry after a lost reply is answered as done, not as a takeover
        assert await store.finish(job.id, "orch-1", now=151, ttl_s=TTL_S, content={"video": 10, "thumbnail": 2})
        row = await store.get(job.id, "key-a")
        assert (row.status, row.completed_at, row.expires_at, row.content) == (
            JobStatus.COMPLETED, 150, 150 + TTL_S, {"video": 10, "thumbnail": 2})
        assert await store.claim("orch-2", LEASE_S, now=10_000) is None  # finished jobs are never claimed

    async def test_a_worker_fails_its_job(self, make_store: MakeStore):
        store = await make_store()
        job = await store.create(queued(), max_queued=4)
        await store.claim("orch-1", LEASE_S, now=100)
        assert await store.fail(job.id, "orch-1", now=110, ttl_s=60, code="stage_failed", message="denoise died")
        row = await store.get(job.id, "key-a")
        assert (row.status, row.error_code, row.error_message, row.expires_at) == (
            JobStatus.FAILED, "stage_failed", "denoise died", 170)

    async def test_cancel_fails_queued_and_running_jobs_once(self, make_store: MakeStore):
        store, other = await make_store(), await make_store()
        waiting = await store.create(queued(created_at=200), max_queued=4)
        running = await store.create(queued(created_at=100), max_queued=4)
        assert (await store.claim("orch-1", LEASE_S, now=300)).id == running.id
        for job in (waiting, running):  # a cancel from any replica
            assert await other.fail(job.id, None, now=301, ttl_s=TTL_S, code="cancelled", message="cancelled")
            assert not await other.fail(job.id, None, now=302, ttl_s=TTL_S, code="cancelled", message="again")
            assert (await store.get(job.id, "key-a")).status is JobStatus.FAILED
        # the runner holding the running one sees it on its next renew, and cannot finish it
        assert not await store.renew(running.id, "orch-1", LEASE_S, now=302, progress=50)
        assert not await store.finish(running.id, "orch-1", now=303, ttl_s=TTL_S, content={"video": 1})
        assert not await store.fail(running.id, "orch-1", now=303, ttl_s=TTL_S, code="x", message="y")
        assert (await store.get(running.id, "key-a")).error_message == "cancelled"

    async def test_finished_jobs_expire_after_their_ttl(self, make_store: MakeStore):
        store = await make_store()
        done, failed, running = await create_many(store, 3)
        for job in (done, failed, running):
            await store.claim("orch-1", LEASE_S, now=200)
        await store.finish(done.id, "orch-1", now=300, ttl_s=50, content={"video": 1})
        await store.fail(failed.id, "orch-1", now=310, ttl_s=50, code="e", message="m")
        assert await store.expired(now=349, limit=10) == []
        assert [j.id for j in await store.expired(now=350, limit=10)] == [done.id]
        assert [j.id for j in await store.expired(now=10_000, limit=10)] == [done.id, failed.id]
        assert [j.id for j in await store.expired(now=10_000, limit=1)] == [done.id]
        deleted = await store.delete(done.id, "key-a")
        assert deleted is not None and deleted.id == done.id
        assert await store.get(done.id, "key-a") is None
        assert await store.delete(done.id, "key-a") is None
        assert [j.id for j in await store.expired(now=10_000, limit=10)] == [failed.id]

    async def test_pages_in_creation_order_both_ways(self, make_store: MakeStore):
        store = await make_store()
        jobs = await create_many(store, 5)
        twin = await store.create(queued(created_at=jobs[2].created_at), max_queued=100)  # a tie on time
        await create_many(store, 2, owner="key-b")
        asc = sorted([*jobs, twin], key=lambda j: (j.created_at, j.id))

        async def walk(order: str, limit: int) -> list[str]:
            seen, after, more = [], None, True
            while more:
                page, more = await store.list("key-a", after, limit, order)
                assert len(page) <= limit and (page or not more)
                seen += [j.id for j in page]
                after = page[-1].id if page else None
            return seen

        for limit in (1, 2, 4, 6, 50):
            assert await walk("asc", limit) == [j.id for j in asc]
            assert await walk("desc", limit) == [j.id for j in reversed(asc)]
        page, more = await store.list("key-a", None, 6, "asc")
        assert len(page) == 6 and not more
        page, more = await store.list("key-a", asc[-1].id, 3, "asc")
        assert (page, more) == ([], False)
        with pytest.raises(ValueError, match="after"):
            await store.list("key-a", "video_" + "0" * 32, 3, "asc")
        with pytest.raises(ValueError, match="order"):
            await store.list("key-a", None, 3, "sideways")

    async def test_counts_every_status(self, make_store: MakeStore):
        store = await make_store()
        assert await store.counts() == {"queued": 0, "in_progress": 0, "completed": 0, "failed": 0}
        a, b, _ = await create_many(store, 3)
        await store.claim("orch-1", LEASE_S, now=200)
        await store.claim("orch-1", LEASE_S, now=200)
        await store.finish(a.id, "orch-1", now=201, ttl_s=TTL_S, content={})
        assert await store.counts() == {"queued": 1, "in_progress": 1, "completed": 1, "failed": 0}

    async def test_open_is_idempotent_and_keeps_the_jobs(self, make_store: MakeStore):
        store = await make_store()
        job = await store.create(queued(), max_queued=4)
        await store.open()
        again = await make_store()  # another replica starting on the same database
        assert await again.get(job.id, "key-a") == state(job)
