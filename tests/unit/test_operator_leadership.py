"""Leader election by kopf peering (leadership.py): the oldest live replica leads, a dead or departed one
stops counting, and the workers of a standby take no work until it leads."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from omnistage_operator.leadership import follow_peering, leads, leads_everywhere, start_priority
from omnistage_operator.workqueue import WorkQueue, worker

from ..polling import wait_until

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)
OLD, NEW = start_priority(now=1000.0, jitter=0), start_priority(now=2000.0, jitter=0)


def peer(priority: int, seen_ago: float = 5, lifetime: int = 60) -> dict:
    return {"priority": priority, "lifetime": lifetime,
            "lastseen": (NOW - dt.timedelta(seconds=seen_ago)).isoformat()}


def test_an_earlier_start_is_a_higher_priority_and_jitter_keeps_same_millisecond_starts_apart():
    assert OLD > NEW
    assert start_priority(now=1000.0, jitter=1) != start_priority(now=1000.0, jitter=2)
    assert start_priority(now=1000.0, jitter=999) > start_priority(now=1000.001, jitter=0)


@pytest.mark.parametrize("status, me, mine, expected", [
    (None, "a", OLD, True),                                         # no peering object yet
    ({}, "a", OLD, True),
    ({"a": peer(OLD)}, "a", OLD, True),                             # only myself
    ({"a": peer(OLD), "b": peer(NEW)}, "a", OLD, True),             # the older leads ...
    ({"a": peer(OLD), "b": peer(NEW)}, "b", NEW, False),            # ... the newer stands by
    ({"a": peer(OLD, seen_ago=61), "b": peer(NEW)}, "b", NEW, True),   # the older's record ran out
    ({"a": peer(OLD, seen_ago=30, lifetime=0)}, "b", NEW, True),    # it left cleanly (lifetime 0)
    ({"a": peer(NEW)}, "b", NEW, False),                            # same priority: kopf freezes both
    ({"a": {"priority": OLD}}, "b", NEW, False),                    # no time: assumed live
    ({"a": "garbage"}, "b", NEW, True),
])
def test_leads(status, me, mine, expected):
    assert leads(status, me, mine, NOW) is expected


def test_leads_everywhere_needs_every_namespace():
    assert leads_everywhere([{"a": peer(OLD)}, {"a": peer(OLD), "b": peer(NEW)}], "a", OLD, NOW)
    assert not leads_everywhere([{"b": peer(NEW)}, {"a": peer(OLD)}], "b", NEW, NOW)


def test_a_standby_takes_no_work_until_it_leads():
    """The peering object says another replica leads: the queued key waits; once that replica's record
    is gone, this one leads and reconciles it."""
    async def scenario():
        statuses = [{"other": {"priority": OLD, "lifetime": 60,
                               "lastseen": dt.datetime.now(dt.timezone.utc).isoformat()}}]
        polls = {"n": 0}

        def read():
            polls["n"] += 1
            return statuses

        active = asyncio.Event()
        follower = asyncio.create_task(follow_peering(read, "me", NEW, active, period=0.01))
        done: list = []

        def reconcile(ns, name):
            done.append((ns, name))
            return None

        q = WorkQueue()
        w = asyncio.create_task(worker(q, reconcile, "w", active))
        q.add(("ns", "p"))
        await wait_until(lambda: polls["n"] >= 3, 5)    # it has looked, several times: still standing by
        assert done == [] and not active.is_set() and q.pending() == 1
        statuses[0] = {}               # the leader left
        await asyncio.wait_for(active.wait(), 5)
        await wait_until(lambda: done == [("ns", "p")], 5)
        for t in (follower, w):
            t.cancel()
        await asyncio.gather(follower, w, return_exceptions=True)

    asyncio.run(scenario())


def test_a_failed_peering_read_keeps_the_last_decision():
    async def scenario():
        calls = {"n": 0}

        def read():
            calls["n"] += 1
            if calls["n"] > 1:
                raise ConnectionError("apiserver blinked")
            return [{}]

        active = asyncio.Event()
        follower = asyncio.create_task(follow_peering(read, "me", OLD, active, period=0.01))
        await asyncio.wait_for(active.wait(), 5)
        await wait_until(lambda: calls["n"] >= 3, 5)
        assert active.is_set()
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)

    asyncio.run(scenario())


def test_a_replica_demoted_while_it_waited_for_a_key_puts_the_key_back():
    """The worker passed the leadership check, then waited on an empty queue; meanwhile another replica
    took over. A key arriving now is not reconciled here: it stays queued for when this one leads again."""
    async def scenario():
        active = asyncio.Event()
        active.set()
        done: list = []
        q = WorkQueue()
        w = asyncio.create_task(worker(q, lambda ns, name: done.append((ns, name)), "w", active))
        await asyncio.sleep(0)         # the worker waits on the empty queue, leading
        active.clear()                 # demoted
        q.add(("ns", "p"))
        await wait_until(lambda: q.pending() == 1 and not q._active, 5)
        await asyncio.sleep(0.05)
        assert done == []
        active.set()
        await wait_until(lambda: done == [("ns", "p")], 5)
        w.cancel()
        await asyncio.gather(w, return_exceptions=True)

    asyncio.run(scenario())
