"""What a stage is offered and what one of its replicas serves, from the counters its replicas export.

Every stage replica counts, in its Prometheus metrics, the work units it produced
(`omnistage_stage_units`), the time its engine spent in steps (`omnistage_stage_step_seconds`), the
requests that ended (`omnistage_stage_requests`) and what it holds now (queue depth, running). Two
snapshots of those counters, a window apart, give per stage:

- throughput: units per second, all replicas together;
- busy: engine-step seconds per second (0 to one per replica);
- capacity of one replica: units per busy second, i.e. what a replica would serve if it stepped all the
  time at the batch sizes it runs. Batching makes a fuller replica faster (the tiny Talker makes about
  8.7x the frames per busy second at batch 16 as at batch 1), so the estimate keeps the best rate seen,
  with how full its steps ran (units per step), and lets a lower rate lower it only slowly
  (`CAPACITY_MEMORY`), and only when it says the replica got slower. A replica at low load runs small
  batches and is slower per busy second by design, so a rate measured with emptier steps is first scaled
  up to the best's fill, as if a fuller step took no longer (batching's best case, so an upper bound):
  only if even that is lower has the replica got slower (contention, a slower step). Were light batches
  to lower the capacity as they are, one client that keeps a replica stepping at batch 1 would make the
  stage look full;
- offered load: what arrives, plus the queued work to drain. What arrives is counted in requests: those
  that ended, plus the growth of those the stage holds (queued or running), at the work per request
  (units over the requests that ended; a request that entered service in the window counts as half
  done, or a filling stage would read its first requests as several times their size). Counting
  requests, not units, keeps a replica that joined in the window right: the requests it took from the
  queue count as held, not as load gone. The queued work spread over `drain_seconds` (the larger of the
  queue target and `MIN_DRAIN_S`) is the backlog; the sizing plans it at full utilisation (a backlog is
  worked off by headroom, not by replicas that start after it is gone);
- what of it is an upstream's backlog in transit (with the stage graph, `graph.py`): requests arriving
  above the steady rate the stage's upstream is offered (times the share of its requests that reach the
  stage) are a catch-up passing through, not a new rate; they count as backlog (their work over the drain
  time), like the stage's own queue;
- how sure a load is (`load_floor`): what arrived in a window is a count of requests, off by about its
  square root (Poisson), so a short window or a stage with few, large requests reads a steady load as
  bursts. The planner grows a stage only for the load it surely has. Arrivals steadier than Poisson
  (clients that wait for their answers send more evenly) are measured (`dispersion`: how much the counts
  of successive intervals differ, against Poisson's) and narrow the interval, never widen it.

Pure: snapshots in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from omnistage.planner.sizing import StageNeed

# Busy time below this share of a second is too little to say what a replica serves.
MIN_BUSY = 0.02
# Each window the best capacity seen keeps this share of itself against a lower measurement (a window too
# idle to measure keeps it whole).
CAPACITY_MEMORY = 0.95
# Each window moves the work-per-request estimate by this much less than the window says.
PER_REQUEST_MEMORY = 0.8
# A backlog is planned to be gone within this long at least (see the module docstring).
MIN_DRAIN_S = 30.0
# Arrivals count as steadier than Poisson only when measured over this many successive intervals at least, and
# never as more than this much steadier (`dispersion`).
MIN_DISPERSION_INTERVALS = 8
MIN_DISPERSION = 0.1


@dataclass(frozen=True)
class ReplicaCounters:
    """One replica's counters at one moment (totals since it started, and gauges)."""

    at: float                 # seconds, on the observer's monotonic clock
    units: float = 0.0        # work units produced
    busy_seconds: float = 0.0 # engine-step time
    finished: float = 0.0     # requests that ended after reaching the engine (finished, cancelled, failed, timed out)
    queued: int = 0
    running: int = 0
    steps: float = 0.0        # engine steps (0: not counted; then how full they ran is not known)


@dataclass(frozen=True)
class StageWindow:
    """A stage over one window, its replicas summed."""

    stage: str
    replicas: int
    seconds: float
    units_per_s: float
    busy: float               # replica-seconds of engine steps per second
    requests_per_s: float
    queued: int
    running: int
    queued_before: int = 0    # at the window's start
    steps_per_s: float = 0.0  # engine steps, all replicas together (0: not counted)
    running_before: int = 0   # at the window's start

    @property
    def units_per_step(self) -> float:
        """How full the steps ran (the batch, for a stage making one unit per request per step); 0: not known."""
        return self.units_per_s / self.steps_per_s if self.steps_per_s > 0 else 0.0


def window(stage: str, before: Mapping[str, ReplicaCounters], after: Mapping[str, ReplicaCounters]) -> StageWindow:
    """The stage between two snapshots of its replicas (by replica name). A replica that restarted (a
    counter went down) counts from zero. One missing from `before` (new, or not read then) counts nothing
    this window: its totals may span its whole life, not the window. One gone by `after` counts nothing
    (the planner can no longer read it)."""
    units = busy = finished = steps = span = 0.0
    queued_before = running_before = 0
    for name, b in after.items():
        a = before.get(name, b)
        if b.units < a.units or b.busy_seconds < a.busy_seconds or b.finished < a.finished or b.steps < a.steps:
            a = ReplicaCounters(at=a.at, queued=a.queued, running=a.running)
        units += b.units - a.units
        busy += b.busy_seconds - a.busy_seconds
        finished += b.finished - a.finished
        steps += b.steps - a.steps
        queued_before += a.queued
        running_before += a.running
        span = max(span, b.at - a.at)
    per_s = 1.0 / span if span > 0 else 0.0
    return StageWindow(stage, len(after), span, units * per_s, busy * per_s, finished * per_s,
                       sum(c.queued for c in after.values()), sum(c.running for c in after.values()), queued_before,
                       steps * per_s, running_before)


def window_since(stage: str, readings: Sequence[Mapping[str, ReplicaCounters]], seconds: float) -> StageWindow:
    """The stage over the last `seconds` of `readings` (oldest first, one snapshot of its replicas each): from
    the newest reading at least that old (the oldest when none is) to the last. A replica that joined since
    counts its work from its first reading, and what it holds as come in the window: it held nothing at the
    window's start (what it took from another replica's queue was held there then)."""
    newest = max(c.at for c in readings[-1].values())
    start = next((i for i in range(len(readings) - 1, -1, -1)
                  if max(c.at for c in readings[i].values()) <= newest - seconds), 0)
    first: dict[str, ReplicaCounters] = {}
    for snap in readings[start:]:
        for name, c in snap.items():
            first.setdefault(name, c)
    w = window(stage, first, readings[-1])
    at_start = [c for name, c in readings[start].items() if name in readings[-1]]
    return replace(w, queued_before=sum(c.queued for c in at_start), running_before=sum(c.running for c in at_start))


@dataclass(frozen=True)
class StageEstimate:
    """What the planner believes of a stage, carried from window to window."""

    stage: str
    capacity: float = 0.0           # units per second of one replica (0: not measured yet)
    units_per_request: float = 0.0  # the stage's work per request, as recently seen
    load: float = 0.0               # offered units per second
    utilization: float = 0.0        # load over the capacity of the replicas running
    capacity_fill: float = 0.0      # units per step when the capacity was measured (0: not known)
    backlog: float = 0.0            # of `load`: the queued work over its drain time (and what is in transit)
    in_transit: float = 0.0         # of `backlog`: an upstream's catch-up passing through (graph.py)


def estimate(prev: StageEstimate, w: StageWindow, queue_seconds: float, steady: float | None = None) -> StageEstimate:
    """The next estimate from the last one and the window `w` (see the module docstring); `steady`: the most
    requests per second that can steadily arrive, from the stage graph (None: no bound)."""
    capacity, fill = capacity_seen(prev.capacity, prev.capacity_fill, w)
    per_request = prev.units_per_request
    # units are counted as they are made, requests only as they end: a request that entered service in the
    # window counts as half done (one that left it, as half done before)
    ended = w.requests_per_s + (w.running - w.running_before) / w.seconds / 2 if w.seconds > 0 else 0.0
    if w.requests_per_s > 0 and ended > 0:  # smoothed
        seen = w.units_per_s / ended
        per_request = seen if not per_request else PER_REQUEST_MEMORY * per_request + (1 - PER_REQUEST_MEMORY) * seen
    load, backlog, transit = offered_parts(per_request, w, queue_seconds, steady)
    util = load / (w.replicas * capacity) if w.replicas and capacity > 0 else 0.0
    return StageEstimate(w.stage, capacity, per_request, load, util, fill, backlog, transit)


def capacity_seen(best: float, best_fill: float, w: StageWindow) -> tuple[float, float]:
    """The capacity of one replica after window `w`, and how full the steps ran when it was measured (see the
    module docstring). A window too idle to measure leaves it as it was; where either side did not count
    steps (fill 0), the rate is taken as it is."""
    if w.busy < MIN_BUSY or w.units_per_s <= 0:
        return best, best_fill
    rate, fill = w.units_per_s / w.busy, w.units_per_step
    if rate >= best:
        return rate, fill
    # emptier steps: what the replica would serve at the best's fill if a step took no longer
    at_best_fill = rate * best_fill / fill if 0 < fill < best_fill else rate
    return max(best * CAPACITY_MEMORY, min(at_best_fill, best)), best_fill


def arrived(w: StageWindow) -> float:
    """Requests per second that arrived at the stage over `w`: those that ended, plus the growth of those
    it holds (queued or running)."""
    if w.seconds <= 0:
        return 0.0
    held = (w.queued + w.running - w.queued_before - w.running_before) / w.seconds
    return max(w.requests_per_s + held, 0.0)


def offered(per_request: float, w: StageWindow, queue_seconds: float,
            steady: float | None = None) -> tuple[float, float]:
    """Offered load over `w` in units per second, its backlog included, and the backlog's share (see
    `offered_parts`)."""
    load, backlog, _ = offered_parts(per_request, w, queue_seconds, steady)
    return load, backlog


def offered_parts(per_request: float, w: StageWindow, queue_seconds: float,
                  steady: float | None = None) -> tuple[float, float, float]:
    """Offered load over `w` in units per second, its backlog included; the backlog's share; and of that the
    share in transit. What arrives: the requests that arrived (`arrived`) at `per_request` units each, at
    most `steady` requests per second (the stage graph's bound: None, none); those above it are an upstream's
    backlog in transit, their work over the drain time (at most their rate: the window's work, never more).
    Before a request has ended (no work per request yet) the throughput stands in, with no bound."""
    growth, backlog = _queue_terms(per_request, w, queue_seconds)
    if per_request > 0 and w.seconds > 0:
        rate, transit = arrived(w), 0.0
        if steady is not None and rate > steady:
            transit = (rate - steady) * per_request * min(1.0, w.seconds / drain_seconds(queue_seconds))
            rate = steady
        return rate * per_request + backlog + transit, backlog + transit, transit
    return max(w.units_per_s + growth, 0.0) + backlog, backlog, 0.0


def drain_seconds(queue_seconds: float) -> float:
    """How long a backlog is planned to take to drain (see the module docstring)."""
    return max(queue_seconds, MIN_DRAIN_S)


def dispersion(counts: Sequence[float]) -> float:
    """How much more or less the requests arriving in successive equal intervals (`counts`, oldest first)
    vary than a Poisson count (whose variance is its mean), as `load_floor` may use it: the upper end of the
    estimate, at most 1. The estimate is half the mean square of successive differences over the mean count
    (a load that changes level moves one difference, where the plain variance would count the change in
    every interval); its relative standard error is about 2/sqrt(m) over m differences of counts of a few
    requests, so its upper end is the estimate times 1 + 4/sqrt(m). Fewer than MIN_DISPERSION_INTERVALS
    differences, or nothing arrived: 1 (Poisson). Burstier arrivals than Poisson keep 1: the planner's
    errors are sized for Poisson and a missed target presses the bottleneck anyway (latency.py)."""
    m = len(counts) - 1
    mean = sum(counts) / len(counts) if counts else 0.0
    if m < MIN_DISPERSION_INTERVALS or mean <= 0:
        return 1.0
    seen = sum((b - a) ** 2 for a, b in zip(counts, counts[1:])) / (2 * m) / mean
    return min(max(seen * (1 + 4 / math.sqrt(m)), MIN_DISPERSION), 1.0)


def load_floor(load: float, backlog: float, per_request: float, seconds: float, errors: float,
               spread: float = 1.0) -> float:
    """The least load that a reading of `load` (its `backlog` included) over `seconds` surely is, at `errors`
    standard errors: the requests that arrived are a Poisson count n, whose rate is at least
    (sqrt(n + errors^2/4) - errors/2)^2 (the lower end of the score interval; it holds for a few requests,
    where n - errors x sqrt(n) would go below 0). The backlog is counted, not sampled: it is added as it is.
    Before the work per request is known the reading is taken as it is. Arrivals whose count varies
    `spread` times as much as a Poisson count's (what `dispersion` measures) are a Poisson count in units
    of `spread` requests."""
    per_count = per_request * spread / seconds if per_request > 0 and seconds > 0 and spread > 0 else 0.0
    if per_count <= 0 or errors <= 0:
        return load
    n = max(load - backlog, 0.0) / per_count
    return per_count * (math.sqrt(n + errors * errors / 4) - errors / 2) ** 2 + backlog


def _queue_terms(per_request: float, w: StageWindow, queue_seconds: float) -> tuple[float, float]:
    """Units per second by which the queue grew over `w` (negative: it shrank), and its backlog's share."""
    growth = (w.queued - w.queued_before) * per_request / w.seconds if w.seconds > 0 else 0.0
    return growth, w.queued * per_request / drain_seconds(queue_seconds)


def need(est: StageEstimate, min_replicas: int, max_replicas: int, gpus: int = 0, unit: str = "units/s",
         default_capacity: float = 1.0, grow_load: float | None = None, keep_load: float | None = None) -> StageNeed:
    """The sizing's view of a stage; before its capacity is measured, `default_capacity` stands in."""
    return StageNeed(est.stage, est.load, est.capacity or default_capacity, min_replicas, max_replicas, gpus, unit,
                     est.backlog, grow_load, keep_load)
