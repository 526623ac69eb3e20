"""The step scheduler on its own: admission, continuous batching, batch keys, cancellation at step
boundaries, failure, batch filling and backpressure. The step is plain Python (counting), so
these run without a model; the engines' integration tests run the same scheduler on real models."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnistage.api import SchedulerSettings
from stage_service.runtime.errors import EngineDead, EngineError, EngineOverloaded
from stage_service.runtime.scheduler import StepScheduler, StepState

from ..polling import wait_until


@dataclass(eq=False)
class Count(StepState):
    """Counts to `length`, one per step."""

    name: str
    length: int
    key: str | None = None
    cost: int = 1
    due: float | None = None
    done: int = 0
    finished: bool = False
    releases: int = 0
    held: bytes = b"x" * 100

    def held_bytes(self) -> int:
        return len(self.held)

    def release(self) -> None:
        self.releases += 1
        self.held = b""


@dataclass
class Recorder:
    """The step function: records each batch's names; can fail or block on demand."""

    batches: list[list[str]] = field(default_factory=list)
    fail_steps: set[int] = field(default_factory=set)
    gate: threading.Event | None = None          # every step waits for it
    allowed: threading.Semaphore | None = None   # each step takes one permit: the test advances steps
    entered: int = 0                             # steps begun (a step blocked on its permit counts)

    def __call__(self, states: list[Count]) -> list[int]:
        self.entered += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.allowed is not None:
            assert self.allowed.acquire(timeout=10)
        self.batches.append([s.name for s in states])
        if len(self.batches) in self.fail_steps:
            raise RuntimeError(f"step {len(self.batches)} broke")
        for s in states:
            s.done += 1
            s.finished = s.done >= s.length
        return [s.done for s in states]


def make(max_batch=4, max_queued=8, max_wait_ms=0.0, **kw) -> tuple[StepScheduler, Recorder]:
    rec = Recorder()
    sched = StepScheduler("test", SchedulerSettings(max_batch, max_queued, max_wait_ms), rec, **kw)
    sched.start()
    return sched, rec


async def run(sched: StepScheduler, state: Count) -> list[int]:
    async with sched.submit(state.name, state) as stream:
        return [r async for r in stream]


@pytest.mark.parametrize("max_batch, max_queued, submitted, refused", [
    (4, 8, 12, 0),    # 4 run, 8 wait
    (4, 8, 13, 1),    # one too many
    (1, 0, 3, 2),     # no queue: only the one that runs
    (8, 0, 8, 0),     # a full batch needs no queue
    (2, 3, 10, 5),
])
async def test_admission_is_bounded_by_batch_plus_queue(max_batch, max_queued, submitted, refused):
    sched, _ = make(max_batch, max_queued)
    stack = contextlib.AsyncExitStack()
    errors = 0
    async with stack:
        for i in range(submitted):
            try:
                await stack.enter_async_context(sched.submit(f"r{i}", Count(f"r{i}", 1000)))
            except EngineOverloaded as e:
                errors += 1
                assert "maxQueued" in str(e)
        assert errors == refused
        assert sched.unfinished() == submitted - refused
    await sched.shutdown()


async def test_requests_join_at_the_next_step_and_leave_when_done():
    sched, rec = make(max_batch=4)
    rec.allowed = threading.Semaphore(2)
    long = asyncio.create_task(run(sched, Count("long", 6)))
    await wait_until(lambda: len(rec.batches) >= 2, interval=0.001, what="two steps")
    short = asyncio.create_task(run(sched, Count("short", 2)))
    # queued while step 3 waits for its permit
    await wait_until(lambda: sched.unfinished() >= 2, interval=0.001, what="short queued")
    for _ in range(10):
        rec.allowed.release()
    assert await short == [1, 2] and await long == [1, 2, 3, 4, 5, 6]
    joined = next(i for i, b in enumerate(rec.batches) if "short" in b)
    assert rec.batches[joined] == ["long", "short"] and rec.batches[joined + 1] == ["long", "short"]
    assert all(b == ["long"] for b in rec.batches[joined + 2:])  # short left once done
    await sched.shutdown()


async def test_a_batch_alone_steps_ahead_of_the_loop_and_an_arrival_ends_the_run():
    """With nothing changing, the worker runs the batch's next step without waiting for the loop to pick
    it (each run: at least two steps); a request arriving joins at the next step boundary all the same."""
    sched, rec = make(max_batch=4)
    picks = []
    pick = sched._pick
    sched._pick = lambda: picks.append(1) or pick()
    assert await run(sched, Count("long", 40)) == list(range(1, 41))
    assert len(rec.batches) == 40 and len(picks) <= 21  # about one pick per two steps, never one per step
    rec.allowed = threading.Semaphore(3)
    first = asyncio.create_task(run(sched, Count("first", 30)))
    await wait_until(lambda: len(rec.batches) >= 43, interval=0.001, what="three steps of the run")
    second = asyncio.create_task(run(sched, Count("second", 2)))
    await wait_until(lambda: sched.unfinished() == 2, interval=0.001, what="second queued")
    for _ in range(40):
        rec.allowed.release()
    assert await second == [1, 2] and await first == list(range(1, 31))
    joined = next(i for i, b in enumerate(rec.batches) if "second" in b)
    assert joined <= 44 and rec.batches[joined] == ["first", "second"]  # the run ended at the next boundary
    await sched.shutdown()


async def test_cancel_during_a_run_of_steps_frees_the_state_when_the_run_ends():
    sched, rec = make()
    rec.allowed = threading.Semaphore(3)
    state = Count("c", 100)
    task = asyncio.create_task(run(sched, state))
    # The fourth step begun and waiting for its permit (`_in_step` alone could still be the third, finishing).
    await wait_until(lambda: rec.entered >= 4, interval=0.001, what="the fourth step in flight")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert state.releases == 0  # the step in flight (waiting for its permit) still uses it
    for _ in range(10):
        rec.allowed.release()
    await wait_until(lambda: not sched.unfinished(), interval=0.001, what="nothing unfinished")
    assert state.releases == 1 and len(rec.batches) == 4  # no step after the one in flight
    await sched.shutdown()


async def test_a_step_failing_in_a_run_keeps_the_results_delivered_before_it():
    sched, rec = make()
    rec.fail_steps = {5}
    state, got = Count("a", 10), []
    with pytest.raises(EngineError, match="step 5 broke"):
        async with sched.submit("a", state) as stream:
            async for r in stream:
                got.append(r)
    assert got == [1, 2, 3, 4] and state.releases == 1 and sched.failed is None
    await sched.shutdown()


async def test_results_that_cannot_be_delivered_declare_the_engine_dead():
    class Broken:
        def load(self, running, queued, parked):
            pass

        def step(self, *args):
            time.sleep(0.02)  # a slow failure: the worker must not step on while the loop is failing
            raise RuntimeError("metrics broke")

    dead = []
    sched, rec = make(on_dead=dead.append)
    sched.metrics = Broken()
    state = Count("a", 10)
    with pytest.raises(EngineDead, match="metrics broke"):
        await run(sched, state)
    assert len(dead) == 1 and state.releases == 1 and sched.unfinished() == 0
    assert len(rec.batches) <= 2  # the run ended at the next step boundary
    await sched.shutdown()


async def test_batches_never_exceed_max_batch_and_the_queue_drains_in_order():
    sched, rec = make(max_batch=3, max_queued=10)
    results = await asyncio.gather(*(run(sched, Count(f"r{i}", 3)) for i in range(9)))
    assert results == [[1, 2, 3]] * 9
    assert max(len(b) for b in rec.batches) == 3
    first_step = {n: next(i for i, b in enumerate(rec.batches) if n in b) for n in (f"r{i}" for i in range(9))}
    assert sorted(first_step, key=lambda n: (first_step[n], int(n[1:]))) == [f"r{i}" for i in range(9)]
    await sched.shutdown()


async def test_states_with_different_keys_never_share_a_step_and_take_turns():
    sched, rec = make(max_batch=4)
    names = {"a1": "A", "a2": "A", "b1": "B", "b2": "B"}
    await asyncio.gather(*(run(sched, Count(n, 5, key=k)) for n, k in names.items()))
    assert all(len({names[n] for n in b}) == 1 for b in rec.batches)
    keys = [names[b[0]] for b in rec.batches]
    assert keys.count("A") == keys.count("B") == 5
    assert all(x != y for x, y in zip(keys, keys[1:]))  # neither key waits while the other runs on
    await sched.shutdown()


async def test_a_step_takes_states_while_their_cost_fits_and_the_rest_go_next():
    sched, rec = make(max_batch=8, max_step_cost=100)
    costs = {"a": 50, "b": 50, "c": 50, "d": 200}  # d alone exceeds the budget: it still runs, alone
    await asyncio.gather(*(run(sched, Count(n, 2, cost=c)) for n, c in costs.items()))
    assert all(sum(costs[n] for n in b) <= 100 or len(b) == 1 for b in rec.batches)
    assert ["d"] in rec.batches and all(len(b) <= 2 for b in rec.batches)
    await sched.shutdown()


async def queued_behind_a_step(sched: StepScheduler, rec: Recorder, dues: dict[str, float]) -> list[list[str]]:
    """States submitted in the order of `dues` (name -> due) while a first state's step holds the worker,
    then let run: the batches after that first step."""
    rec.gate = threading.Event()
    blocker = asyncio.ensure_future(run(sched, Count("blocker", 1, due=0.0)))
    await wait_until(lambda: rec.batches or sched._in_step, what="the first step running")
    runs = []
    for name, due in dues.items():
        runs.append(asyncio.ensure_future(run(sched, Count(name, 1, due=due))))
        await wait_until(lambda: sched.queued + sched.running >= len(runs) + 1, what=f"{name} submitted")
    rec.gate.set()
    await asyncio.gather(blocker, *runs)
    return rec.batches[1:]


async def test_due_states_step_earliest_due_first_whatever_their_arrival():
    # One state per step (each costs the whole step): the order of the steps is the order of the dues.
    sched, rec = make(max_batch=8, max_step_cost=1)
    after = await queued_behind_a_step(sched, rec, {"late": 30.0, "mid": 20.0, "first": 10.0})
    assert after == [["first"], ["mid"], ["late"]]
    await sched.shutdown()


async def test_due_states_are_admitted_earliest_due_first():
    # One running at a time: the queue is admitted by due, not by arrival.
    sched, rec = make(max_batch=1, max_queued=8)
    after = await queued_behind_a_step(sched, rec, {"late": 30.0, "mid": 20.0, "first": 10.0, "also_first": 10.0})
    assert after == [["first"], ["also_first"], ["mid"], ["late"]]  # equal dues: in arrival order
    await sched.shutdown()


async def test_cancel_during_a_step_frees_the_state_when_that_step_returns():
    sched, rec = make()
    rec.gate = threading.Event()
    state = Count("c", 100)
    task = asyncio.create_task(run(sched, state))
    await wait_until(lambda: sched.running and sched._in_step, interval=0.001, what="a step in flight")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert state.releases == 0 and sched.unfinished() == 1  # the step in flight still uses it
    rec.gate.set()
    await wait_until(lambda: not sched.unfinished(), interval=0.001, what="nothing unfinished")
    assert state.releases == 1 and sched.held_bytes() == 0 and len(rec.batches) == 1
    assert len(sched.tally) == 0  # the step its caller gave up during is no work done for the request
    await sched.shutdown()


async def test_cancel_while_queued_frees_at_once():
    sched, rec = make(max_batch=1)
    rec.gate = threading.Event()
    first = asyncio.create_task(run(sched, Count("first", 2)))
    queued = Count("queued", 2)
    second = asyncio.create_task(run(sched, queued))
    await wait_until(lambda: sched.queued, interval=0.001, what="one queued")
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert queued.releases == 1 and sched.queued == 0
    rec.gate.set()
    assert await first == [1, 2]
    assert all(b == ["first"] for b in rec.batches)
    await sched.shutdown()


async def test_a_failed_step_fails_its_batch_and_the_next_requests_run():
    sched, rec = make(max_batch=2)
    rec.fail_steps = {2}
    a, b = Count("a", 4), Count("b", 4)
    results = await asyncio.gather(run(sched, a), run(sched, b), return_exceptions=True)
    assert all(isinstance(r, EngineError) and "step 2 broke" in str(r) for r in results)
    assert a.releases == b.releases == 1 and sched.failed is None
    assert await run(sched, Count("c", 2)) == [1, 2]
    await sched.shutdown()


async def test_failed_steps_in_a_row_declare_the_engine_dead():
    dead = []
    sched, rec = make(max_batch=1, max_queued=8, max_failed_steps=3, on_dead=dead.append)
    rec.fail_steps = {1, 2, 3, 4, 5}
    states = [Count(f"r{i}", 3) for i in range(5)]
    results = await asyncio.gather(*(run(sched, s) for s in states), return_exceptions=True)
    assert [type(r) for r in results] == [EngineError] * 3 + [EngineDead] * 2
    assert len(dead) == 1 and sched.failed is dead[0]
    assert all(s.releases == 1 for s in states) and sched.unfinished() == 0
    with pytest.raises(EngineDead):
        await run(sched, Count("late", 1))
    await sched.shutdown()


async def test_coming_out_of_idle_the_batch_waits_max_wait_to_fill():
    sched, rec = make(max_batch=4, max_wait_ms=300)
    first = asyncio.create_task(run(sched, Count("first", 1)))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(run(sched, Count("second", 1)))
    await asyncio.gather(first, second)
    assert rec.batches[0] == ["first", "second"]
    await sched.shutdown()


async def test_a_consumer_that_falls_behind_holds_its_state_back():
    sched, rec = make(max_pending_results=3)
    state = Count("slow", 50)
    async with sched.submit("slow", state) as stream:
        await asyncio.sleep(0.2)
        assert state.done == 3  # three results wait unread: no fourth step
        got = [r async for r in stream]
    assert got == list(range(1, 51))
    await sched.shutdown()


async def test_shutdown_fails_what_is_held():
    sched, rec = make(max_batch=1)
    rec.gate = threading.Event()
    tasks = [asyncio.create_task(run(sched, Count(f"r{i}", 5))) for i in range(3)]
    await wait_until(lambda: sched._in_step, interval=0.001, what="a step in flight")
    rec.gate.set()
    await sched.shutdown()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, EngineDead) for r in results) and sched.unfinished() == 0
    with pytest.raises(EngineDead):
        await run(sched, Count("late", 1))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(max_batch=st.integers(1, 5),
       plan=st.lists(st.tuples(st.integers(1, 6), st.one_of(st.none(), st.integers(0, 5)),
                               st.sampled_from(["A", "B", None])), min_size=1, max_size=12))
def test_invariants_under_random_load(max_batch, plan):
    """Whatever arrives and whoever cancels: uncancelled requests get exactly their results, and as many
    work units in the tally (one per step, as the stage's metric counts them), no batch exceeds maxBatch or
    mixes keys, every state is released once, and nothing is held afterwards."""
    async def scenario():
        sched, rec = make(max_batch=max_batch, max_queued=100)
        states = [Count(f"r{i}", n, key=k) for i, (n, _, k) in enumerate(plan)]

        async def one(state, cancel_after):
            async with sched.submit(state.name, state) as stream:
                got = []
                async for r in stream:
                    got.append(r)
                    if cancel_after is not None and len(got) > cancel_after:
                        return None
                return got

        results = await asyncio.gather(*(one(s, c) for s, (_, c, _) in zip(states, plan)))
        await wait_until(lambda: not sched.unfinished(), interval=0.001, what="nothing unfinished")
        for s, (n, cancel_after, _), r in zip(states, plan, results):
            units = sched.tally.take(s.name)
            if cancel_after is None or cancel_after >= n:
                assert r == list(range(1, n + 1)) and units == n
            assert units <= n and s.releases == 1
        keys = {s.name: s.key for s in states}
        assert all(len(b) <= max_batch and len({keys[x] for x in b}) == 1 for b in rec.batches)
        assert sched.held_bytes() == 0 and len(sched.tally) == 0
        await sched.shutdown()

    asyncio.run(scenario())


# ------------------------------------------------------------------ liveness

BOUND = SchedulerSettings().stall_seconds


@dataclass(eq=False)
class AwaitingInput(Count):
    """Cannot step until its input arrives (as a consumer stage waiting on its producer)."""

    arrived: bool = False

    def ready(self) -> bool:
        return self.arrived


async def test_a_step_that_does_not_return_is_a_stall():
    sched, rec = make()
    rec.gate = threading.Event()
    task = asyncio.create_task(run(sched, Count("hung", 1)))
    # Asked as at a time past the bound: a step has started and not returned.
    why = await wait_until(lambda: sched.stalled(sched.clock() + BOUND + 1), what="the step to start")
    assert why.startswith("stage test: an engine step has been running for") and "\n" not in why
    assert sched.stalled(sched.clock()) is None  # within the bound it is only a slow step
    rec.gate.set()
    assert await task == [1]
    assert sched.stalled(sched.clock() + 10 * BOUND) is None  # nothing held: idle is not stalled
    await sched.shutdown()


async def test_requests_held_while_the_loop_does_not_run_are_a_stall():
    # Never started: the loop neither steps nor waits, as when the event loop is blocked.
    sched = StepScheduler("test", SchedulerSettings(max_wait_ms=0.0), Recorder())
    assert sched.stalled(sched.clock() + 10 * BOUND) is None  # holding nothing (loading a model)
    async with sched.submit("r", Count("r", 1)):
        assert sched.stalled(sched.clock()) is None
        assert sched.stalled(sched.clock() + BOUND + 1).startswith("stage test: 1 request held and no engine step")
    await sched.shutdown()


async def test_waiting_for_input_or_for_a_slow_reader_is_not_a_stall():
    sched, _ = make(max_pending_results=1)
    waiting = AwaitingInput("waiting", 3)
    async with sched.submit("waiting", waiting) as results, sched.submit("unread", Count("unread", 5)) as unread:
        # "unread" stepped once and waits for its reader; "waiting" waits for its input: the loop is idle.
        await wait_until(lambda: sched.stalled(sched.clock() + 10 * BOUND) is None, what="the loop to idle")
        # "unread" is parked out of the batch (its slot free) while its reader is behind
        assert sched.running + sched.parked == 2 and sched.stalled(sched.clock() + 10 * BOUND) is None
        assert await unread.next() == 1
        waiting.arrived = True
        sched.notify()
        assert [r async for r in results] == [1, 2, 3]
        await wait_until(lambda: sched.stalled(sched.clock() + 10 * BOUND) is None, what="the loop to idle again")
        assert sched.running + sched.parked == 1
    await sched.shutdown()
