"""Parking: a state whose reader stopped reading leaves the running set, so its batch slot goes to the next
queued request; it resumes where it stopped once its reader catches up (stage_service/runtime/scheduler.py)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_service.metrics import StageMetrics
from stage_service.runtime.errors import EngineOverloaded

from ..polling import wait_until
from .test_scheduler import Count, make, run

PENDING = 3  # results a reader may leave unread before its state is parked


async def test_states_whose_readers_stopped_free_their_batch_slots():
    sched, rec = make(max_batch=2, max_pending_results=PENDING)
    async with contextlib.AsyncExitStack() as stack:
        stalled = [Count(f"unread{i}", 20) for i in range(2)]
        streams = [await stack.enter_async_context(sched.submit(s.name, s)) for s in stalled]
        await wait_until(lambda: all(s.done >= PENDING for s in stalled), what="the unread states to step")
        # maxBatch states whose readers read nothing: another request still runs to its end
        assert await asyncio.wait_for(run(sched, Count("probe", 5)), 60) == [1, 2, 3, 4, 5]
        assert sched.parked == 2 and all(s.done == PENDING for s in stalled)
        # each continues where it stopped, with what it would have made unparked
        for s, stream in zip(stalled, streams):
            assert [r async for r in stream] == list(range(1, 21)) and s.done == 20
        assert sched.parked == 0
    assert sched.unfinished() == 0 and all(s.releases == 1 for s in stalled)
    await sched.shutdown()


async def test_parked_states_are_in_the_stage_metrics_beside_the_queue():
    metrics = StageMetrics("test")
    sched, _ = make(max_batch=1, max_pending_results=PENDING, metrics=metrics)

    def gauge(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"stage": "test"})

    async with sched.submit("slow", Count("slow", 10)) as stream, sched.submit("waiter", Count("waiter", 50)):
        await wait_until(lambda: sched.parked == 1, what="slow parked for the waiter")
        await wait_until(lambda: gauge("omnistage_stage_parked") == 1, what="the parked gauge")
        assert gauge("omnistage_stage_running") == 1 and gauge("omnistage_stage_queue_depth") == 0
        assert [r async for r in stream] == list(range(1, 11))
    await wait_until(lambda: gauge("omnistage_stage_parked") == 0, what="nothing parked once read")
    await sched.shutdown()


async def test_a_slow_reader_with_nobody_waiting_keeps_its_slot():
    sched, rec = make(max_batch=1, max_pending_results=PENDING)
    async with sched.submit("slow", slow := Count("slow", 10)) as stream:
        await wait_until(lambda: slow.done == PENDING, what="slow a reader's bound ahead")
        await asyncio.sleep(0)
        assert sched.parked == 0 and sched.running == 1
        async with sched.submit("waiter", Count("waiter", 1)) as waiting:  # now someone waits: parked
            assert [r async for r in waiting] == [1]
        assert sched.parked == 1
        assert [r async for r in stream] == list(range(1, 11))
    await sched.shutdown()


async def test_a_parked_state_resumes_in_front_of_the_queue_once_its_reader_took_half():
    sched, rec = make(max_batch=1, max_pending_results=4)
    async with sched.submit("slow", slow := Count("slow", 12)) as stream, \
            sched.submit("waiter", Count("waiter", 1)):  # waits for the slot: slow is parked for it
        await wait_until(lambda: sched.parked == 1, what="slow parked")
        assert await stream.next() == 1  # one taken: 3 of 4 wait, above half: still parked
        await asyncio.sleep(0)
        assert sched.parked == 1 and slow.done == 4
        assert await stream.next() == 2  # half taken: back in the batch
        await wait_until(lambda: slow.done > 4, what="slow stepping again")
        assert [r async for r in stream] == list(range(3, 13))
    await sched.shutdown()


async def test_a_parked_state_cancelled_is_released_once():
    sched, _ = make(max_batch=1, max_pending_results=PENDING)
    gone = Count("gone", 50)
    async with sched.submit("gone", gone), sched.submit("waiter", Count("waiter", 1)):
        await wait_until(lambda: sched.parked == 1, what="parked")
        assert sched.held_bytes("gone") == 100
    assert sched.unfinished() == 0 and gone.releases == 1 and sched.held_bytes() == 0
    assert await run(sched, Count("after", 2)) == [1, 2]
    await sched.shutdown()


async def test_parked_states_count_against_max_queued():
    """A replica holds at most maxBatch + maxQueued requests, parked or not."""
    sched, _ = make(max_batch=1, max_queued=2, max_pending_results=1)
    async with contextlib.AsyncExitStack() as stack:
        for i in range(3):
            await stack.enter_async_context(sched.submit(f"u{i}", Count(f"u{i}", 10)))
        # each parked for the next one queued; the last, with nobody waiting, keeps its slot
        await wait_until(lambda: sched.parked == 2 and sched.running == 1 and not sched.queued,
                         what="two parked, the last running")
        with pytest.raises(EngineOverloaded, match="maxQueued 2"):
            await stack.enter_async_context(sched.submit("one-more", Count("one-more", 1)))
    await sched.shutdown()


@dataclass(eq=False)
class Kv(Count):
    """Holds `per_step` bytes of KV per step taken; can be recomputed when `preemptible`."""

    per_step: int = 10
    preemptible: bool = True
    kv: int = 0
    preempted: int = 0

    def kv_bytes(self) -> int:
        return self.kv

    def kv_bytes_next(self) -> int:
        return self.kv + self.per_step if self.preemptible else self.length * self.per_step

    def preempt(self) -> None:
        self.preempted += 1
        self.kv = 0


def kv_step(rec):
    def step(states):
        out = rec(states)
        for s in states:
            s.kv = s.done * s.per_step
        return out
    return step


async def test_under_a_kv_budget_parked_states_keep_their_kv_until_the_queues_head_needs_it():
    sched, rec = make(max_batch=2, max_pending_results=PENDING)
    sched.step_fn, sched.kv_budget = kv_step(rec), 1000
    async with sched.submit("r", r := Kv("r", 10)) as stream, sched.submit("n", n := Kv("n", 10, preemptible=False)), \
            sched.submit("w", w := Kv("w", 88, preemptible=False)):
        # r and n park for w, which needs 880 bytes: beside n's 100 reserved and r's 30 held it does not fit,
        # so r (which can be recomputed) gives its KV back; n keeps its own, reserved at its most
        await wait_until(lambda: sched.parked == 2 and w.done > 0, what="both parked, w running")
        assert r.preempted == 1 and r.kv == 0 and n.preempted == 0 and n.kv == PENDING * 10
        assert sched._running_budget() == 1000 - 100
        assert [x async for x in stream] == list(range(1, 11))  # r resumes beside w and n's reservation
    await sched.shutdown()


async def test_a_parked_state_that_cannot_be_recomputed_keeps_room_even_with_nothing_running():
    """kv_budget.admits lets the queue's head in when nothing runs; with a parked state's KV reserved, that
    would run it on memory the parked state still holds."""
    sched, rec = make(max_batch=1, max_pending_results=PENDING)
    sched.step_fn, sched.kv_budget = kv_step(rec), 1000
    async with sched.submit("a", Kv("a", 10, preemptible=False)) as stream, \
            sched.submit("b", b := Kv("b", 95, preemptible=False)):  # 950: fits only once a has ended
        await wait_until(lambda: sched.parked == 1, what="a parked")
        await asyncio.sleep(0.05)
        assert sched.running == 0 and b.done == 0 and sched._reserved() == 100
        assert [x async for x in stream] == list(range(1, 11))
        await wait_until(lambda: b.done > 0, what="b running once a ended")
    await sched.shutdown()


@settings(max_examples=25, deadline=None)
@given(max_batch=st.integers(1, 4), plan=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 30)),
                                                  min_size=1, max_size=8))
def test_slow_readers_get_exactly_their_results_whatever_parks(max_batch, plan):
    """Readers that pause for a while between results (so their states park and resume at random): each
    gets exactly what it would alone, no batch exceeds maxBatch, every state is released once."""
    async def scenario():
        sched, rec = make(max_batch=max_batch, max_queued=100, max_pending_results=2)
        states = [Count(f"r{i}", n) for i, (n, _) in enumerate(plan)]

        async def one(state, pause):
            async with sched.submit(state.name, state) as stream:
                got = []
                async for r in stream:
                    got.append(r)
                    for _ in range(pause):
                        await asyncio.sleep(0)
                return got

        results = await asyncio.gather(*(one(s, p) for s, (_, p) in zip(states, plan)))
        assert results == [list(range(1, n + 1)) for n, _ in plan]
        assert all(len(b) <= max_batch for b in rec.batches) and all(s.releases == 1 for s in states)
        assert sched.unfinished() == 0 and sched.held_bytes() == 0
        await sched.shutdown()

    asyncio.run(scenario())
