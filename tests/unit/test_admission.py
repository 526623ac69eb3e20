"""Admission: bounds, per-stage commitments, priority and fairness, no starvation."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator_service.admission import Admission, Overloaded


def make(max_inflight=2, max_queued=2, caps=None, backlog=None, **kw) -> Admission:
    caps = caps or {}
    backlog = backlog if backlog is not None else {}
    return Admission(max_inflight, max_queued, capacity=lambda s: caps.get(s, 100),
                     backlog=lambda s: backlog.get(s, 0), **kw)


async def test_admits_up_to_max_inflight_then_queues_then_refuses():
    a = make(max_inflight=2, max_queued=1)
    t1 = await a.admit({"x"})
    t2 = await a.admit({"x"})
    waiter = asyncio.create_task(a.admit({"x"}))
    await asyncio.sleep(0)
    assert a.queued == 1 and not waiter.done()
    with pytest.raises(Overloaded) as e:
        await a.admit({"x"})
    assert "maxInflight 2, maxQueued 1" in str(e.value) and e.value.retry_after_s > 0
    a.release(t1)
    t3 = await asyncio.wait_for(waiter, 1)
    assert a.inflight == 2 and a.queued == 0
    a.release(t2)
    a.release(t3)
    a.release(t3)  # releasing twice is harmless
    assert a.inflight == 0


async def test_a_full_stage_holds_back_only_the_requests_that_need_it():
    backlog = {"talker": 1}
    a = make(max_inflight=10, max_queued=10, caps={"talker": 1}, backlog=backlog)
    blocked = asyncio.create_task(a.admit({"thinker", "talker"}))
    await asyncio.sleep(0)
    assert not blocked.done()
    text_only = await asyncio.wait_for(a.admit({"thinker"}), 1)  # does not need the talker: goes ahead
    backlog["talker"] = 0  # the talker finished a request
    a.poke()
    t = await asyncio.wait_for(blocked, 1)
    assert a.inflight == 2
    for x in (t, text_only):
        a.release(x)
    assert a.inflight == 0


async def test_priority_goes_first_then_arrival_order():
    a = make(max_inflight=1, max_queued=10)
    holder = await a.admit({"s"})
    order = []

    async def req(name, prio):
        t = await a.admit({"s"}, priority=prio)
        order.append(name)
        a.release(t)

    tasks = [asyncio.create_task(req(n, p)) for n, p in [("low1", 0), ("high", 5), ("low2", 0), ("mid", 1)]]
    await asyncio.sleep(0)
    a.release(holder)
    await asyncio.gather(*tasks)
    assert order == ["high", "mid", "low1", "low2"]


async def test_shortest_first_with_a_bound_on_overtaking():
    a = make(max_inflight=1, max_queued=100, fairness="ShortestFirst", max_overtakes=3)
    holder = await a.admit({"s"})
    order = []

    async def req(name, cost):
        t = await a.admit({"s"}, cost=cost)
        order.append(name)
        await asyncio.sleep(0)
        a.release(t)

    tasks = [asyncio.create_task(req("long", 100))]
    tasks += [asyncio.create_task(req(f"short{i}", 1)) for i in range(8)]
    await asyncio.sleep(0)
    a.release(holder)
    await asyncio.gather(*tasks)
    # Shorter jobs overtake the long one, but only three times.
    assert order.index("long") == 3, order


async def test_cancelled_waiter_leaves_no_trace():
    a = make(max_inflight=1, max_queued=5)
    t = await a.admit({"s"})
    w = asyncio.create_task(a.admit({"s"}))
    await asyncio.sleep(0)
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    assert a.queued == 0
    a.release(t)
    assert a.inflight == 0


async def test_a_release_between_a_waiters_timeout_and_its_cleanup_skips_it():
    """A deadline cancels the waiter's future at once, but its cleanup runs a loop turn later: a release
    in between (the request ahead ending at the same deadline) must pass it over, not fail."""
    a = make(max_inflight=1, max_queued=5)
    t = await a.admit({"s"})
    w = asyncio.create_task(a.admit({"s"}))
    behind = asyncio.create_task(a.admit({"s"}))
    await asyncio.sleep(0)
    w.cancel()  # the waiter's future is cancelled now; its except clause has not run yet
    a.release(t)  # must not raise InvalidStateError
    with pytest.raises(asyncio.CancelledError):
        await w
    t2 = await asyncio.wait_for(behind, 1)  # the room went to the one still waiting
    assert a.inflight == 1 and a.queued == 0
    a.release(t2)
    assert a.inflight == 0


async def test_new_capacity_is_picked_up_by_poke():
    caps = {"s": 0}
    a = Admission(10, 10, capacity=lambda s: caps[s], backlog=lambda s: 0)
    w = asyncio.create_task(a.admit({"s"}))
    await asyncio.sleep(0)
    assert not w.done()
    caps["s"] = 1  # a replica became ready
    a.poke()
    t = await asyncio.wait_for(w, 1)
    a.release(t)


@given(st.lists(st.tuples(st.sampled_from(["admit", "release", "cancel"]), st.integers(0, 3),
                          st.sets(st.sampled_from("abc"), min_size=1)), max_size=60))
@settings(max_examples=150, deadline=None)
def test_invariants_hold_under_any_sequence(ops):
    """Each admitted request stands for one request sitting at each of its stages (the backlog)."""
    caps = {"a": 2, "b": 3, "c": 1}

    async def run():
        held: list = []
        backlog = lambda s: sum(1 for t in held if s in t.stages)  # noqa: E731
        adm = Admission(4, 3, capacity=lambda s: caps[s], backlog=backlog)
        waiting = []
        for op, k, stages in ops:
            if op == "admit":
                task = asyncio.create_task(adm.admit(stages, priority=k))
                await asyncio.sleep(0)
                if task.done():
                    if task.exception() is None:
                        held.append(task.result())
                        adm.arrived(task.result())
                    else:
                        assert isinstance(task.exception(), Overloaded)
                else:
                    waiting.append(task)
            elif op == "release" and held:
                adm.release(held.pop(k % len(held)))
                for _ in range(3):  # let woken waiters run
                    await asyncio.sleep(0)
            elif op == "cancel" and waiting:
                w = waiting.pop(k % len(waiting))
                w.cancel()
                await asyncio.sleep(0)
                if w.done() and not w.cancelled() and w.exception() is None:
                    held.append(w.result())
                    adm.arrived(w.result())
            for w in list(waiting):
                if w.done():
                    waiting.remove(w)
                    held.append(w.result())
                    adm.arrived(w.result())
            assert adm.inflight <= 4 and adm.queued <= 3
            assert all(backlog(s) <= caps[s] for s in caps)
            assert adm.inflight == len(held)
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for w in waiting:
            if not w.cancelled() and w.exception() is None:
                held.append(w.result())
        for t in list(held):
            adm.release(t)
        assert adm.inflight == 0

    asyncio.run(run())
