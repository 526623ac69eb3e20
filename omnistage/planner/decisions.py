"""When a plan becomes replicas: up at once, down only after a delay, never past the budget.

A stage whose plan asks for more replicas gets them at the next decision (the load estimate is already
a window long, so a one-sample spike does not count). A stage whose plan allows fewer keeps its replicas
until fewer have been enough for its whole scale-down delay, and then goes to the most it was asked for
during that delay; the plan's band between adding and removing (`sizing.SCALE_DOWN_MARGIN`) keeps a
steady load from flapping. Replicas freed by a scale-down drain before they stop (the stage's drain
contract), so removing one fails no request.

Scale-ups are granted against the budget with the replicas that still run: when the bottleneck moves
under a full budget, the stage it moved to grows only as the one it left shrinks. The one it left then
shrinks sooner than its own delay: once fewer replicas have been enough for it for `REBALANCE_S`, a
replica it no longer needs goes to the bottleneck that waits for the budget (the delay guards a stage
against its own load coming back; it must not keep a pipeline's bottleneck starved).

Pure: the state of each stage, a plan and the time in; the next state out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from omnistage.planner.sizing import Budget, Plan

REBALANCE_S = 5.0


@dataclass(frozen=True)
class StageScale:
    replicas: int                      # what the stage is set to
    lower_since: float | None = None   # since when the plan has allowed fewer
    lower_to: int = 0                  # the most the plan asked for since then: a scale-down goes there


@dataclass(frozen=True)
class Change:
    stage: str
    before: int
    after: int


def decide(current: Mapping[str, StageScale], plan: Plan, now: float, delays: Mapping[str, float],
           gpus: Mapping[str, int] | None = None,
           budget: Budget = Budget()) -> tuple[dict[str, StageScale], list[Change]]:
    """The next state of every stage and the changes it makes (see the module docstring)."""
    gpus = gpus or {}
    nxt: dict[str, StageScale] = {}
    ups: list[str] = []
    for stage, cur in current.items():
        p = plan.stages[stage]
        if p.replicas > cur.replicas:
            nxt[stage] = StageScale(cur.replicas)
            ups.append(stage)
        elif p.keep_down_to >= cur.replicas:
            nxt[stage] = StageScale(cur.replicas)
        else:  # fewer would do: count the delay from when that began (lower_to is 0 before)
            since = now if cur.lower_since is None else cur.lower_since
            nxt[stage] = _down_or_wait(cur.replicas, since, max(cur.lower_to, p.keep_down_to), now,
                                       delays.get(stage, 0.0))
    # Grant scale-ups one replica at a time to the most loaded, while the budget holds with what runs;
    # a stage waiting out its delay with replicas it no longer needs gives them up first.
    ups.sort(key=lambda s: (-plan.stages[s].utilization, s))

    def fits(stage: str) -> bool:
        total = sum(s.replicas for s in nxt.values()) + 1
        used = sum(s.replicas * gpus.get(n, 0) for n, s in nxt.items()) + gpus.get(stage, 0)
        return budget.fits(total, used)

    granted = True
    while granted:
        granted = False
        for stage in ups:
            if nxt[stage].replicas >= plan.stages[stage].replicas:
                continue
            if not fits(stage):
                _give_up_one(nxt, now, gpus.get(stage, 0), gpus)
            if fits(stage):
                nxt[stage] = StageScale(nxt[stage].replicas + 1)
                granted = True
                break
    changes = [Change(s, current[s].replicas, nxt[s].replicas) for s in current
               if nxt[s].replicas != current[s].replicas]
    return nxt, changes


def _give_up_one(nxt: dict[str, StageScale], now: float, wanted_gpus: int, gpus: Mapping[str, int]) -> None:
    """One replica from a stage that has had more than it needs for REBALANCE_S (the longest so first), when
    that frees what the waiting stage needs (a replica; its GPUs)."""
    donors = [(s, sc) for s, sc in nxt.items() if sc.lower_since is not None and sc.replicas > sc.lower_to
              and now - sc.lower_since >= REBALANCE_S and gpus.get(s, 0) >= min(wanted_gpus, 1)]
    if donors:
        s, sc = min(donors, key=lambda d: (d[1].lower_since, d[0]))
        nxt[s] = StageScale(sc.replicas - 1, sc.lower_since, sc.lower_to)


def _down_or_wait(replicas: int, since: float, lower_to: int, now: float, delay: float) -> StageScale:
    if now - since >= delay:
        return StageScale(lower_to)
    return StageScale(replicas, since, lower_to)
