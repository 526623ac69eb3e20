"""How many replicas each stage needs: the pipeline sized as a whole, within a budget.

A stage's need is its offered load (work units per second: tokens, frames, denoise steps, images) over
what one replica serves, at the utilisation the targets leave room for. Stages are sized together
because a pipeline serves only as fast as its slowest stage: when the budget cannot give every stage
its need, replicas go one at a time to the stage that is the bottleneck at that moment (the highest
utilisation), which maximises the goodput the budget allows; growing a stage that is not the
bottleneck buys nothing.

A measured load is uncertain (`load.load_floor`), so a stage has three loads: the best estimate (its
utilisation, the bottleneck), the load it surely has (what it grows for), and the load over its
scale-down delay (what fewer replicas must serve, within the band, before it shrinks). Without the last
two, each is the first.

Pure: numbers in, a plan out. Measuring load and capacity is `load.py`'s; when to act on a plan is
`decisions.py`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

# A replica is removed only when the others would still run at no more than this share of the target
# utilisation: the band between adding and removing keeps a steady load from flapping.
SCALE_DOWN_MARGIN = 0.85


@dataclass(frozen=True)
class StageNeed:
    """One stage as the sizing sees it."""

    stage: str
    load: float          # offered work units per second (what arrives, plus the backlog to drain)
    capacity: float      # units per second one replica serves at the batch sizes it runs (> 0)
    min_replicas: int = 1
    max_replicas: int = 8
    gpus: int = 0        # per replica, against the budget's max_gpus
    unit: str = "units/s"
    backlog: float = 0.0                # of `load`: queued work over its drain time, planned at full utilisation
    grow_load: float | None = None      # what the stage grows for: the load it surely has (None: `load`)
    keep_load: float | None = None      # what fewer replicas must serve, within the band, to shrink (None: `load`)

    def scaled(self, factor: float) -> StageNeed:
        """The stage planned for `factor` times its load, as a missed latency target asks (latency.py). The
        miss is itself the evidence: the stage grows for its best estimate, not only for what it surely has."""
        return replace(self, load=self.load * factor, backlog=self.backlog * factor, grow_load=None,
                       keep_load=None if self.keep_load is None else self.keep_load * factor)

    def utilization(self, replicas: int) -> float:
        """Load over what `replicas` replicas serve (above 1: requests queue up)."""
        if replicas <= 0:
            return math.inf if self.load > 0 else 0.0
        return self.load / (replicas * self.capacity)

    def replicas_for(self, utilization: float, load: float | None = None) -> int:
        """The fewest replicas that serve `load` (default: the stage's), within the stage's bounds: what
        arrives at or below `utilization`, and that with the backlog at full utilisation (the headroom
        works a backlog off)."""
        load = self.load if load is None else load
        arrivals = max(load - self.backlog, 0.0)
        n = max(math.ceil(arrivals / (utilization * self.capacity) - 1e-9) if arrivals > 0 else 0,
                math.ceil(load / self.capacity - 1e-9) if load > 0 else 0)
        return min(max(n, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class Budget:
    max_replicas: int = 0  # stage replicas in all; 0: no bound
    max_gpus: int = 0      # GPUs in all; 0: no bound

    def fits(self, replicas: int, gpus: int) -> bool:
        return (not self.max_replicas or replicas <= self.max_replicas) and (not self.max_gpus or gpus <= self.max_gpus)


@dataclass(frozen=True)
class StagePlan:
    stage: str
    replicas: int         # what the stage should have now (the most it needs, within the budget)
    keep_down_to: int     # fewer than `replicas` are never needed, but a scale-down stops here (hysteresis)
    need: int             # what it would get with no budget
    utilization: float    # load over the planned replicas' capacity


@dataclass(frozen=True)
class Plan:
    stages: Mapping[str, StagePlan]
    bottleneck: str | None  # the stage with the highest planned utilisation (None: no load anywhere)
    budget_limited: bool    # some stage gets fewer replicas than it needs
    reason: str             # for a person: the Planned condition's message

    def replicas(self) -> dict[str, int]:
        return {name: p.replicas for name, p in self.stages.items()}


def plan(needs: Sequence[StageNeed], budget: Budget = Budget(), utilization: float = 0.8) -> Plan:
    """Replicas per stage: every stage's need at `utilization`, or, when the budget is short, the
    allocation that gives the bottleneck each next replica (every stage keeps its minimum)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    for n in needs:
        if n.capacity <= 0 or n.load < 0 or not 1 <= n.min_replicas <= n.max_replicas:
            raise ValueError(f"stage {n.stage}: capacity must be > 0, load >= 0 and 1 <= min <= max replicas "
                             f"(got capacity {n.capacity}, load {n.load}, {n.min_replicas}..{n.max_replicas})")
    want = {n.stage: n.replicas_for(utilization, n.grow_load) for n in needs}
    by_name = {n.stage: n for n in needs}
    fits_all = budget.fits(sum(want.values()), sum(want[n.stage] * n.gpus for n in needs))
    got = dict(want) if fits_all else {n.stage: n.min_replicas for n in needs}
    while not fits_all:
        short = [n for n in needs if got[n.stage] < want[n.stage] and _fits(budget, needs, got, n)]
        if not short:
            break
        worst = max(short, key=lambda n: n.utilization(got[n.stage]))  # ties: the first in the given order
        got[worst.stage] += 1
    limited = any(got[s] < want[s] for s in got)
    stages = {}
    for n in needs:
        # While the budget binds, its allocation is the plan: no band above it, or a stage holding replicas
        # it needs less than the bottleneck does would never give one up.
        down = got[n.stage] if limited else max(n.replicas_for(utilization * SCALE_DOWN_MARGIN, n.keep_load),
                                                got[n.stage])
        stages[n.stage] = StagePlan(n.stage, got[n.stage], down, want[n.stage], n.utilization(got[n.stage]))
    loaded = [n for n in needs if n.load > 0]
    bottleneck = max(loaded, key=lambda n: stages[n.stage].utilization).stage if loaded else None
    return Plan(stages, bottleneck, limited, _reason(stages, by_name, bottleneck, limited, budget))


def _fits(budget: Budget, needs: Sequence[StageNeed], got: Mapping[str, int], extra: StageNeed) -> bool:
    replicas = sum(got.values()) + 1
    gpus = sum(got[n.stage] * n.gpus for n in needs) + extra.gpus
    return budget.fits(replicas, gpus)


def _reason(stages: Mapping[str, StagePlan], needs: Mapping[str, StageNeed], bottleneck: str | None,
            limited: bool, budget: Budget) -> str:
    if bottleneck is None:
        return "no load: every stage at its minimum"
    p = stages[bottleneck]
    text = (f"{bottleneck} is the bottleneck: {p.utilization:.2f} utilisation at {p.replicas} "
            f"replica{'s' if p.replicas != 1 else ''} ({needs[bottleneck].capacity:.3g} "
            f"{needs[bottleneck].unit} each)")
    if limited:
        short = ", ".join(f"{s} {q.replicas}/{q.need}" for s, q in stages.items() if q.replicas < q.need)
        bound = " and ".join(x for x in (f"maxReplicas {budget.max_replicas}" if budget.max_replicas else "",
                                         f"maxGpus {budget.max_gpus}" if budget.max_gpus else "") if x)
        text += f"; the budget ({bound}) cannot meet the target: {short} replicas of what they need"
    return text


def offered_load(arrivals: Mapping[str, float], demand: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Work units per second each stage is offered: per request class, its arrival rate (requests per
    second) times the units one of its requests takes at each stage (tokens, frames, steps)."""
    load: dict[str, float] = {}
    for cls, rate in arrivals.items():
        for stage, units in demand.get(cls, {}).items():
            load[stage] = load.get(stage, 0.0) + rate * units
    return load


def goodput(replicas: Mapping[str, int], capacity: Mapping[str, float], demand: Mapping[str, float]) -> float:
    """Requests per second the pipeline completes with these replicas, for requests that take `demand`
    units at each stage: the slowest stage's rate."""
    rates = [replicas[s] * capacity[s] / d for s, d in demand.items() if d > 0]
    return min(rates) if rates else math.inf
