"""The planner between decisions (a clock of our own), the counters it reads, the metrics it exports."""

from __future__ import annotations

from prometheus_client import generate_latest

from omnistage.planner.controller import Planner
from omnistage.planner.load import ReplicaCounters
from omnistage.planner.metrics import DESIRED_REPLICAS, PlannerMetrics
from omnistage.planner.scrape import replica_counters
from omnistage.spec.model import Autoscaling, AutoscalingBudget, AutoscalingTargets, StageAutoscaling
from stage_service.metrics import StageMetrics


def test_counters_from_a_stage_replicas_metrics():
    m = StageMetrics("talker")
    m.step(4, 250.0, "frames", 100)
    m.step(2, 750.0, "frames", 50)
    for outcome in ("finished", "finished", "cancelled", "rejected"):
        m.outcome(outcome)
    m.load(3, 2)
    counters, unit = replica_counters(generate_latest(m.registry).decode(), at=7.0)
    # requests that reached the engine count (finished and cancelled), the rejected one does not
    assert counters == ReplicaCounters(7.0, units=150.0, busy_seconds=1.0, finished=3.0, queued=2, running=3,
                                       steps=2.0)
    assert unit == "frames"
    assert replica_counters("", 1.0) == (ReplicaCounters(1.0), "")


def config(**stages):
    return Autoscaling(enabled=True, targets=AutoscalingTargets(queue_seconds=1.0, utilization=0.8),
                       budget=AutoscalingBudget(max_replicas=6),
                       stages={s: StageAutoscaling(lo, hi, delay) for s, (lo, hi, delay) in stages.items()})


class Replicas:
    """Stage replicas whose counters advance as a modeled service would: each serves `capacity` units per
    busy second, busy as much as the offered load needs (up to all the time), one request = `per_request`."""

    def __init__(self, capacity: float, per_request: float):
        self.capacity, self.per_request = capacity, per_request
        self.counters: dict[str, ReplicaCounters] = {}

    def run(self, names: list[str], at: float, dt: float, load: float) -> dict[str, ReplicaCounters]:
        share = load / len(names)
        for n in names:
            c = self.counters.get(n, ReplicaCounters(at - dt))
            busy = min(share / self.capacity, 1.0) * dt
            served = busy * self.capacity
            queued = int(max(share - self.capacity, 0) * 2 / self.per_request)
            self.counters[n] = ReplicaCounters(at, c.units + served, c.busy_seconds + busy,
                                               c.finished + served / self.per_request, queued, 1)
        return {n: self.counters[n] for n in names}


def test_a_load_step_grows_the_bottleneck_within_the_window_and_a_drop_shrinks_it_after_the_delay():
    planner = Planner(config(thinker=(1, 4, 10.0), talker=(1, 4, 10.0)), {"thinker": 1, "talker": 1})
    stages = {"thinker": Replicas(200.0, 20), "talker": Replicas(100.0, 100)}
    up_at = down_at = None
    for tick in range(120):
        now = tick * 0.5
        load = 2.5 if 5 <= now < 30 else 0.5      # requests per second: a step up at 5 s, down at 30 s
        for stage, reps in stages.items():
            names = [f"{stage}-{i}" for i in range(planner.desired()[stage])]
            planner.observe(stage, reps.run(names, now, 0.5, load * reps.per_request), "tokens")
        d = planner.decide(now)
        for c in d.changes:
            if c.stage == "talker" and c.after > c.before and up_at is None:
                up_at = now
            if c.stage == "talker" and c.after < c.before and down_at is None:
                down_at = now
        assert sum(planner.desired().values()) <= 6
    assert up_at is not None and up_at - 5 <= 5, up_at       # the talker (250 of 100 units/s) grew within 5 s
    assert down_at is not None and down_at - 30 >= 10, down_at  # and shrank only after its 10 s delay
    assert planner.desired() == {"thinker": 1, "talker": 1}


def test_the_users_replicas_are_clamped_to_the_bounds_and_exported():
    planner = Planner(config(thinker=(2, 4, 60.0)), {"thinker": 1, "talker": 9})
    assert planner.desired() == {"thinker": 2, "talker": 8}  # talker: the defaults 1..8
    metrics = PlannerMetrics("p")
    metrics.record(planner, planner.decide(0.0))
    text = generate_latest(metrics.registry).decode()
    assert f'{DESIRED_REPLICAS}{{pipeline="p",stage="talker"}} 8.0' in text


def test_a_stage_the_controller_cannot_scale_is_planned_at_what_it_runs():
    """serve does not add GPU replicas: such a stage is planned at its count, so the budget holds what runs."""
    planner = Planner(config(thinker=(1, 4, 60.0)), {"thinker": 1, "talker": 1}, fixed=frozenset({"thinker"}))
    thinker = Replicas(100.0, 20)
    for tick in range(10):
        planner.observe("thinker", thinker.run(["t0"], tick * 0.5, 0.5, 400.0), "tokens")
        planner.decide(tick * 0.5)
    assert planner.desired()["thinker"] == 1


def test_a_stage_not_yet_measured_over_a_window_is_held_where_it_is():
    """Before two readings nothing says the load is low: a 0 s scale-down delay must not cut the file's
    starting replicas to the minimum."""
    planner = Planner(config(talker=(1, 4, 0.0)), {"thinker": 1, "talker": 3})
    assert planner.decide(0.0).changes == [] and planner.desired()["talker"] == 3
    planner.observe("talker", {"t0": ReplicaCounters(0.0)}, "frames")
    assert planner.decide(0.5).changes == [] and planner.desired()["talker"] == 3
    planner.observe("talker", {"t0": ReplicaCounters(1.0)}, "frames")  # a window with no work: now it may shrink
    assert planner.decide(1.0).changes and planner.desired()["talker"] == 1


def test_one_light_client_lets_a_stage_that_batches_give_up_its_added_replica():
    """The real run's Talker: a replica makes FRAMES_PER_STEP_S frames per busy second per request in its
    batch. Six clients keep two replicas at batch 3; then one client keeps one replica stepping 85% of the
    time at batch 1 (the orchestrator sends a lone request to the same replica), the other idle. Measured
    at batch 1 a replica looks a third as fast: had that lowered the capacity, the stage would look 0.85
    utilised at one replica and keep both. Only steps as full as the best's may lower it."""
    planner = Planner(config(talker=(1, 2, 10.0)), {"talker": 2})
    frames_per_step_s, light_load = 65.0, 55.0
    counters = {n: ReplicaCounters(0.0) for n in ("t0", "t1")}
    down_at = None
    for tick in range(1, 181):
        now = tick * 1.0
        heavy = now <= 60
        for name, c in counters.items():
            batch = 3 if heavy else (1 if name == "t0" else 0)
            units = 125.0 if heavy else (light_load if name == "t0" else 0.0)
            busy = units / (frames_per_step_s * batch) if batch else 0.0
            counters[name] = ReplicaCounters(now, c.units + units, c.busy_seconds + busy, c.finished + units / 100,
                                             0, batch, c.steps + (units / batch if batch else 0.0))
        planner.observe("talker", {n: counters[n] for n in ("t0", "t1")[:planner.desired()["talker"]]}, "frames")
        d = planner.decide(now)
        if heavy:
            assert planner.desired()["talker"] == 2, d.estimates["talker"]  # 0.64 utilised: both are needed
        elif d.changes and down_at is None:
            down_at = now
    assert down_at is not None and 10 <= down_at - 60 <= 25, down_at
    est = planner.estimates["talker"]
    assert est.capacity > 2.5 * frames_per_step_s and est.utilization < 0.35  # a batch-3 rate, not batch 1's
