"""Pure rollout decisions: given what each stage's Deployment looks like now and whether it matches
the spec, which Deployments to write in this pass and which changed ones wait their turn.

`OneStageAtATime` (the default): a changed stage is written only when no other stage (or the
orchestrator, which rolls last) is still rolling out or short of ready replicas, first by
`rollout.order`, then in data-flow order. `Parallel`: every changed stage at once. A missing
Deployment (first creation, or deleted by hand) is always written at once: nothing of it is serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from omnistage.api import ROLLOUT_STRATEGIES, Pipeline

from .vocabulary import ORCHESTRATOR, R_PROGRESS_DEADLINE

ONE_STAGE_AT_A_TIME, PARALLEL = ROLLOUT_STRATEGIES


@dataclass(frozen=True)
class UnitState:
    """One rollout unit (a stage or the orchestrator) as observed in this pass."""
    name: str
    exists: bool
    in_sync: bool = False       # the live Deployment already matches the desired one
    rolled_out: bool = False    # controller caught up; every replica updated and available; no old ones


@dataclass(frozen=True)
class RolloutPlan:
    apply: tuple[str, ...]        # write these Deployments in this pass
    waiting: tuple[str, ...]      # changed, held back until the unit in progress is done
    in_progress: tuple[str, ...]  # rolling towards their current spec

    @property
    def progressing(self) -> bool:
        return bool(self.apply or self.waiting or self.in_progress)


def rollout_order(p: Pipeline) -> tuple[str, ...]:
    """`rollout.order` first, the other stages in data-flow order, the orchestrator last."""
    first = list(p.deployment.rollout.order)
    rest = [s.name for s in p.topo_order() if s.name not in first]
    return (*first, *rest, ORCHESTRATOR)


def plan_rollout(units: Sequence[UnitState], strategy: str, order: Sequence[str]) -> RolloutPlan:
    rank = {name: i for i, name in enumerate(order)}
    units = sorted(units, key=lambda u: (rank.get(u.name, len(rank)), u.name))
    missing = [u.name for u in units if not u.exists]
    changed = [u.name for u in units if u.exists and not u.in_sync]
    busy = {u.name for u in units if u.exists and not u.rolled_out} | set(missing)
    if strategy == PARALLEL:
        apply, waiting = missing + changed, []
    elif busy:
        # Only what is already in motion may move again (a unit changed twice, a missing one).
        apply = missing + [n for n in changed if n in busy]
        waiting = [n for n in changed if n not in busy]
    else:
        apply, waiting = changed[:1], changed[1:]
    in_progress = [u.name for u in units if u.name in busy or u.name in apply]
    return RolloutPlan(tuple(_ordered(apply, rank)), tuple(waiting), tuple(in_progress))


def deployment_rolled_out(dep: Mapping[str, Any] | None) -> tuple[bool, str]:
    """`kubectl rollout status` for one Deployment object: (done, what it waits for)."""
    if dep is None:
        return False, "not created yet"
    spec, status = dep.get("spec") or {}, dep.get("status") or {}
    generation = (dep.get("metadata") or {}).get("generation", 0)
    if status.get("observedGeneration", 0) < generation:
        return False, "waiting for the deployment controller to observe the change"
    if deadline_exceeded(dep):
        return False, "progress deadline exceeded"
    want = spec.get("replicas", 1)
    updated, total = status.get("updatedReplicas", 0), status.get("replicas", 0)
    available = status.get("availableReplicas", 0)
    if updated < want:
        return False, f"{updated} of {want} replicas updated"
    if total > updated:
        return False, f"{total - updated} old replicas pending termination"
    if available < updated:
        return False, f"{available} of {updated} updated replicas available"
    return True, "rolled out"


def deadline_exceeded(dep: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Progressing" and c.get("reason") == R_PROGRESS_DEADLINE
               for c in (dep.get("status") or {}).get("conditions") or ())


def _ordered(names: list[str], rank: Mapping[str, int]) -> list[str]:
    return sorted(dict.fromkeys(names), key=lambda n: (rank.get(n, len(rank)), n))
