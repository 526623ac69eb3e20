"""Per-request work units on a stage (stage_service/runtime/work_tally.py): what the step scheduler tallies per
request is what the stage's `omnistage_stage_units_total` counts, and taking a request's units forgets it."""

from __future__ import annotations

import asyncio

from omnistage.api import SchedulerSettings
from stage_service.metrics import StageMetrics
from stage_service.runtime.scheduler import StepScheduler, StepState
from stage_service.runtime.work_tally import WorkTally


def test_a_requests_units_add_up_until_taken_and_then_are_gone():
    tally = WorkTally()
    tally.add("a")
    tally.add("a", 4)
    tally.add("b", 2)
    tally.add("c", 0)  # no work: nothing held for it
    assert len(tally) == 2
    assert tally.take("a") == 5 and tally.take("a") == 0  # taken once
    assert tally.take("never") == 0
    assert tally.take("b") == 2 and len(tally) == 0


class Steps(StepState):
    """Finishes after `n` steps."""

    def __init__(self, n: int):
        self.n = n

    def advance(self) -> int:
        self.n -= 1
        self.finished = self.n == 0
        return self.n


async def test_the_scheduler_tallies_per_request_what_the_metric_counts():
    metrics = StageMetrics("s")
    sched = StepScheduler("s", SchedulerSettings(max_batch=3, max_queued=8, max_wait_ms=0.0),
                          lambda states: [st.advance() for st in states], unit="frames", metrics=metrics)
    sched.start()

    async def run(request_id: str, n: int) -> None:
        async with sched.submit(request_id, Steps(n)) as stream:
            async for _ in stream:
                pass

    steps = {"a": 5, "b": 2, "c": 7, "d": 1}
    await asyncio.gather(*(run(r, n) for r, n in steps.items()))
    await sched.shutdown()
    counted = metrics.registry.get_sample_value("omnistage_stage_units_total", {"stage": "s", "unit": "frames"})
    assert {r: sched.tally.take(r) for r in steps} == steps and counted == sum(steps.values())
    assert len(sched.tally) == 0
