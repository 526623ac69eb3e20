"""Pure status: the OmniPipeline's `status` from what its Deployments report and the rollout plan.

`stages.<name>` / `orchestrator`: `replicas` is the count the spec asks for, `readyReplicas` and
`updatedReplicas` come from the Deployment. Conditions:
  Ready        True/AllStagesReady when every stage and the orchestrator have all replicas ready;
               False/StagesNotReady, False/ScaledToZero, False/InvalidSpec
  Progressing  True/RollingOut while a Deployment is written, rolling or waiting its turn;
               False/RolloutComplete; False/InvalidSpec
  Degraded     True/StageUnavailable when replicas went missing after the pipeline was ready (or stay
               missing since), True/ProgressDeadlineExceeded or True/ReplicaFailure from a Deployment;
               False/AsExpected
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from .conditions import condition, is_true, set_condition
from .pipeline_object import plain
from .rollout import RolloutPlan, deadline_exceeded
from .vocabulary import (DEGRADED, ORCHESTRATOR, PROGRESSING, READY, R_ALL_READY, R_AS_EXPECTED,
                         R_INVALID_SPEC, R_NOT_READY, R_PROGRESS_DEADLINE, R_REPLICA_FAILURE, R_ROLLING_OUT,
                         R_ROLLOUT_COMPLETE, R_SCALED_TO_ZERO, R_STAGE_UNAVAILABLE)

MAX_MESSAGE = 1000


def unit_counts(desired_replicas: int, live: Mapping[str, Any] | None) -> dict[str, int]:
    st = (live or {}).get("status") or {}
    return {"replicas": desired_replicas, "readyReplicas": st.get("readyReplicas", 0) or 0,
            "updatedReplicas": st.get("updatedReplicas", 0) or 0}


def build_status(old: Mapping[str, Any] | None, *, generation: int, stages: Mapping[str, dict],
                 orchestrator: dict, deployments: Mapping[str, Mapping | None], plan: RolloutPlan,
                 endpoint: str, now: str) -> dict:
    """`stages`/`orchestrator`: unit_counts; `deployments`: live Deployment by unit name."""
    old = dict(old or {})
    units = {**stages, ORCHESTRATOR: orchestrator}
    short = [f"{name} {c['readyReplicas']}/{c['replicas']} ready" for name, c in units.items()
             if c["readyReplicas"] < c["replicas"]]
    zero = [name for name, c in units.items() if c["replicas"] == 0]
    conditions = copy.deepcopy(list(old.get("conditions") or []))
    was_ready, was_degraded = is_true(conditions, READY), is_true(conditions, DEGRADED)

    if zero:
        ready = condition(READY, False, R_SCALED_TO_ZERO, f"no replicas asked for: {', '.join(zero)}", generation)
    elif short:
        ready = condition(READY, False, R_NOT_READY, "; ".join(short), generation)
    else:
        ready = condition(READY, True, R_ALL_READY,
                          f"{len(stages)} stages and the orchestrator have every replica ready", generation)

    if plan.progressing:
        parts = [f"rolling out: {', '.join(plan.in_progress)}"] if plan.in_progress else []
        if plan.waiting:
            parts.append(f"waiting their turn: {', '.join(plan.waiting)}")
        progressing = condition(PROGRESSING, True, R_ROLLING_OUT, "; ".join(parts), generation)
    else:
        progressing = condition(PROGRESSING, False, R_ROLLOUT_COMPLETE, "every Deployment is rolled out",
                                generation)

    stuck = [n for n, d in deployments.items() if d is not None and deadline_exceeded(d)]
    failing = [n for n, d in deployments.items() if d is not None and _replica_failure(d)]
    if stuck:
        degraded = condition(DEGRADED, True, R_PROGRESS_DEADLINE, f"not progressing: {', '.join(stuck)}",
                             generation)
    elif failing:
        degraded = condition(DEGRADED, True, R_REPLICA_FAILURE, f"cannot create pods: {', '.join(failing)}",
                             generation)
    elif short and (was_ready or was_degraded):
        degraded = condition(DEGRADED, True, R_STAGE_UNAVAILABLE, "; ".join(short), generation)
    else:
        degraded = condition(DEGRADED, False, R_AS_EXPECTED, "no replica missing, no Deployment failing",
                             generation)

    for c in (ready, progressing, degraded):
        c["message"] = c["message"][:MAX_MESSAGE]
        set_condition(conditions, c, now)
    ready_stages = sum(1 for c in stages.values() if c["replicas"] > 0 and c["readyReplicas"] >= c["replicas"])
    return {"observedGeneration": generation, "stagesReady": f"{ready_stages}/{len(stages)}",
            "orchestratorEndpoint": endpoint, "stages": dict(stages), "orchestrator": orchestrator,
            "conditions": conditions}


def invalid_status(old: Mapping[str, Any] | None, *, generation: int, errors: list[str], now: str) -> dict:
    """The spec cannot be served: say why; what already runs is left alone."""
    new = copy.deepcopy(dict(old or {}))
    conditions = new.setdefault("conditions", [])
    message = "; ".join(errors)[:MAX_MESSAGE]
    set_condition(conditions, condition(READY, False, R_INVALID_SPEC, message, generation), now)
    set_condition(conditions, condition(PROGRESSING, False, R_INVALID_SPEC,
                                        "nothing is rolled out until the spec is fixed", generation), now)
    new["observedGeneration"] = generation
    return new


def status_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict | None:
    """A merge patch turning `old` into `new`, or None when they are the same (no write)."""
    old = dict(old or {})
    if plain(old) == plain(new):
        return None
    patch = dict(new)
    for key in old:            # fields (and stages) that went away are removed explicitly
        if key not in new:
            patch[key] = None
    if isinstance(old.get("stages"), Mapping) and isinstance(new.get("stages"), Mapping):
        patch["stages"] = {**{s: None for s in old["stages"] if s not in new["stages"]}, **new["stages"]}
    return patch


def _replica_failure(dep: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "ReplicaFailure" and c.get("status") == "True"
               for c in (dep.get("status") or {}).get("conditions") or ())
