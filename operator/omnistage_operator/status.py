"""Pure status: the OmniPipeline's `status` from what its Deployments report and the rollout plan.

`stages.<name>` / `orchestrator`: `replicas` is the count the spec asks for, `readyReplicas` and
`updatedReplicas` come from the Deployment; while replicas are missing, `lastFailure` says why from the
unit's pods (the newest termination message, exit code and reason of a container that is not ready).
Conditions:
  Ready        True/AllStagesReady when every stage and the orchestrator have all replicas ready;
               False/StagesNotReady, False/ScaledToZero, False/InvalidSpec
  Progressing  True/RollingOut while a Deployment is written, rolling or waiting its turn;
               False/RolloutComplete; False/InvalidSpec
  Degraded     True/StageFailing when a unit short of replicas has a failing container (the message
               names the unit and carries its termination message), True/ProgressDeadlineExceeded or
               True/ReplicaFailure from a Deployment, True/StageUnavailable when replicas went missing
               after the pipeline was ready (or stay missing since); False/AsExpected
  Planned      (autoscaling enabled) the stage planner's last decision (planning.py): True/Sized,
               True/BudgetLimited, True/NoLoad, Unknown/Measuring
Under autoscaling a stage's `replicas` is what its Deployment runs (the planner sets it), with the planner's
`desiredReplicas`, `capacity`, `capacityUnit`, `utilization` and `demandPerRequest`; replicas it added are
not counted missing while they start (only those below the stage's minReplicas are).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping

from .conditions import condition, is_true, set_condition
from .pipeline_object import plain
from .planning import PlannedView
from .rollout import RolloutPlan, deadline_exceeded
from .vocabulary import (
    COMPONENT_ORCHESTRATOR,
    COMPONENT_STAGE,
    DEGRADED,
    LABEL_COMPONENT,
    LABEL_STAGE,
    ORCHESTRATOR,
    PLANNED,
    PROGRESSING,
    R_ALL_READY,
    R_AS_EXPECTED,
    R_CHILD_CONFLICT,
    R_INVALID_SPEC,
    R_NOT_READY,
    R_PROGRESS_DEADLINE,
    R_REPLICA_FAILURE,
    R_ROLLING_OUT,
    R_ROLLOUT_COMPLETE,
    R_SCALED_TO_ZERO,
    R_STAGE_FAILING,
    R_STAGE_UNAVAILABLE,
    READY,
)

MAX_MESSAGE = 1000
# A stage entry's fields the stage planner sets (planning.planned_view).
PLANNER_FIELDS = frozenset({"desiredReplicas", "capacity", "capacityUnit", "utilization",
                            "demandPerRequest"})
# The kubelet's own bound on one container's termination message (it keeps the end, as we do).
MAX_TERMINATION_MESSAGE = 4096
# Waiting reasons of a container on its way up; any other says why it cannot start (ImagePullBackOff,
# CreateContainerConfigError, CrashLoopBackOff).
STARTING = frozenset({"ContainerCreating", "PodInitializing"})
UNSCHEDULABLE = "Unschedulable"   # the scheduler's reason on a pod it cannot place


def unit_counts(desired_replicas: int, live: Mapping[str, Any] | None,
                pods: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """A unit's entry in the status: counts from its Deployment, and while replicas are missing, the
    last failure of its `pods` (when there is one)."""
    st = (live or {}).get("status") or {}
    entry: dict[str, Any] = {"replicas": desired_replicas, "readyReplicas": st.get("readyReplicas", 0) or 0,
                             "updatedReplicas": st.get("updatedReplicas", 0) or 0}
    if entry["readyReplicas"] < desired_replicas:
        failure = last_failure(pods)
        if failure is not None:
            entry["lastFailure"] = failure
    return entry


def pods_by_unit(pods: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """A pipeline's pods by unit (stage name, or ORCHESTRATOR), from the labels the builders put on them."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        component = labels.get(LABEL_COMPONENT)
        if component == COMPONENT_ORCHESTRATOR:
            unit = ORCHESTRATOR
        elif component == COMPONENT_STAGE:
            unit = labels.get(LABEL_STAGE)
        else:
            continue
        if unit:
            out.setdefault(unit, []).append(pod)
    return out


def last_failure(pods: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The newest failure among pods not being deleted: a pod the scheduler cannot place (`Unschedulable`,
    with the scheduler's message), else a container (init containers included) that is not ready: its last
    non-zero exit (`state` or `lastState`, with the kubelet's termination message), else a waiting reason
    that is not part of starting up (an image that cannot be pulled, a config error). A ready container's
    old crash is not why replicas are missing, so it is never reported. Ties go to the pod name, so the
    same pods give the same answer."""
    found = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        unplaced = _unschedulable(meta.get("name", ""), status)
        if unplaced is not None:
            found.append(unplaced)
            continue
        for cs in [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]:
            if not cs.get("ready"):
                failure = _container_failure(meta.get("name", ""), cs)
                if failure is not None:
                    found.append(failure)
    return max(found, key=lambda f: (f.get("finishedAt", ""), f["pod"], f.get("container", "")), default=None)


def _unschedulable(pod: str, status: Mapping[str, Any]) -> dict[str, Any] | None:
    """A pod the scheduler did not place: its PodScheduled condition's reason and message ("0/3 nodes are
    available: 3 Insufficient nvidia.com/gpu.")."""
    for c in status.get("conditions") or ():
        # only the scheduler's refusal: a pod held by a gate (SchedulingGated: Kueue) waits on purpose
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == UNSCHEDULABLE:
            failure = {"pod": pod, "reason": UNSCHEDULABLE,
                       "message": _tail(c.get("message") or "", MAX_TERMINATION_MESSAGE)}
            return {k: v for k, v in failure.items() if v}
    return None


def _container_failure(pod: str, cs: Mapping[str, Any]) -> dict[str, Any] | None:
    state, last = cs.get("state") or {}, cs.get("lastState") or {}
    waiting = state.get("waiting") or {}
    waiting_reason = waiting.get("reason") if waiting.get("reason") not in STARTING else None
    ended = next((t for t in (state.get("terminated"), last.get("terminated")) if t and t.get("exitCode")), None)
    if ended is not None:
        failure = {"exitCode": ended["exitCode"], "reason": waiting_reason or ended.get("reason"),
                   "message": _tail(ended.get("message") or "", MAX_TERMINATION_MESSAGE),
                   "finishedAt": ended.get("finishedAt")}
    elif waiting_reason:
        failure = {"reason": waiting_reason, "message": _tail(waiting.get("message") or "", MAX_TERMINATION_MESSAGE)}
    else:
        return None
    failure = {"pod": pod, "container": cs.get("name", ""), **failure}
    return {k: v for k, v in failure.items() if v not in (None, "")}


def failure_summary(unit: str, failure: Mapping[str, Any], limit: int = MAX_MESSAGE) -> str:
    """One line naming the unit, how its container failed and (the end of) its message, within `limit`."""
    how = ", ".join(x for x in (f"exit code {failure['exitCode']}" if "exitCode" in failure else "",
                                failure.get("reason", "")) if x)
    head = f"{unit}: {how}"
    text = " | ".join(line.strip() for line in str(failure.get("message", "")).splitlines() if line.strip())
    if not text:
        return head[:limit]
    return f"{head}: {_tail(text, max(limit - len(head) - 2, 1))}"[:limit]


def new_failures(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[str]:
    """Summaries of the failures in `new` that `old` did not have: one Event each, not one per restart of
    a crash loop. A termination is new with a new exit code or message; a pod that cannot be placed or a
    container that cannot start (no exit code) is new with a new reason, so a scheduler message whose
    node counts change makes no second Event."""
    old_units, new_units = _units(old or {}), _units(new)
    out = []
    for unit, entry in new_units.items():
        failure = entry.get("lastFailure") or {}
        before = (old_units.get(unit) or {}).get("lastFailure") or {}
        if failure and _key(failure) != _key(before):
            out.append(failure_summary(unit, failure))
    return out


def build_status(old: Mapping[str, Any] | None, *, generation: int, stages: Mapping[str, dict],
                 orchestrator: dict, deployments: Mapping[str, Mapping | None], plan: RolloutPlan,
                 endpoint: str, now: str, floors: Mapping[str, int] | None = None,
                 autoscaled: bool = False, planned: PlannedView | None = None) -> dict:
    """`stages`/`orchestrator`: unit_counts; `deployments`: live Deployment by unit name; `floors`: per unit,
    the ready replicas below which it is short (default: all of them); `autoscaled`: the planner runs, and
    `planned` is its last view, merged into the stage entries with its Planned condition (None: no view yet
    in this process, e.g. after a restart: the status keeps what it said)."""
    old = dict(old or {})
    floors = floors or {}
    if autoscaled:
        kept = {name: {k: v for k, v in ((old.get("stages") or {}).get(name) or {}).items() if k in PLANNER_FIELDS}
                for name in stages}
        got = planned.stages if planned is not None else kept
        stages = {name: {**entry, **got.get(name, {})} for name, entry in stages.items()}
    units = {**stages, ORCHESTRATOR: orchestrator}
    short = [f"{name} {c['readyReplicas']}/{c['replicas']} ready" for name, c in units.items()
             if c["readyReplicas"] < floors.get(name, c["replicas"])]
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

    crashing = {name: c["lastFailure"] for name, c in units.items() if c.get("lastFailure")}
    stuck = [n for n, d in deployments.items() if d is not None and deadline_exceeded(d)]
    failing = [n for n, d in deployments.items() if d is not None and _replica_failure(d)]
    if crashing:   # the most useful answer: what the failing container said
        share = (MAX_MESSAGE - 2 * (len(crashing) - 1)) // len(crashing)
        degraded = condition(DEGRADED, True, R_STAGE_FAILING,
                             "; ".join(failure_summary(n, f, share) for n, f in crashing.items()), generation)
    elif stuck:
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

    own = [ready, progressing, degraded]
    if planned is not None and autoscaled:
        own.append({**planned.condition, "observedGeneration": generation})
    elif not autoscaled:
        conditions = [c for c in conditions if c.get("type") != PLANNED]   # autoscaling turned off
    for c in own:
        c["message"] = c["message"][:MAX_MESSAGE]
        set_condition(conditions, c, now)
    ready_stages = sum(1 for name, c in stages.items()
                       if c["replicas"] > 0 and c["readyReplicas"] >= floors.get(name, c["replicas"]))
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


def conflict_status(old: Mapping[str, Any] | None, *, generation: int, message: str, now: str) -> dict:
    """A child cannot be applied: its name is taken by an object the operator does not manage (never
    adopted or overwritten); say which. What already runs is left alone."""
    new = copy.deepcopy(dict(old or {}))
    conditions = new.setdefault("conditions", [])
    set_condition(conditions, condition(READY, False, R_CHILD_CONFLICT, message[:MAX_MESSAGE], generation), now)
    set_condition(conditions, condition(PROGRESSING, False, R_CHILD_CONFLICT,
                                        "nothing more is applied until the name is free", generation), now)
    new["observedGeneration"] = generation
    return new


def status_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict | None:
    """A merge patch turning `old` into `new`, or None when they are the same (no write)."""
    old = plain(dict(old or {}))
    if old == plain(new):
        return None
    return _with_removals(old, new)


def _replica_failure(dep: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "ReplicaFailure" and c.get("status") == "True"
               for c in (dep.get("status") or {}).get("conditions") or ())


def _with_removals(old: Any, new: Any) -> Any:
    """`new`, with null for every key (a field, a stage, a stage's lastFailure) that `old` has at any
    depth and `new` lacks: a merge patch leaves out-of-patch keys alone. Lists are replaced whole."""
    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        return new
    out = {key: _with_removals(old.get(key), value) for key, value in new.items()}
    out.update({key: None for key in old if key not in new})
    return out


def _units(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {**(status.get("stages") or {}), ORCHESTRATOR: status.get("orchestrator") or {}}


# Waiting reasons the kubelet alternates between for one cause: one Event for them all.
SAME_CAUSE = {"ErrImagePull": "ImagePullBackOff"}


def _key(failure: Mapping[str, Any]) -> tuple:
    if "exitCode" in failure:
        return failure["exitCode"], failure.get("message", "")
    reason = failure.get("reason", "")
    return None, SAME_CAUSE.get(reason, reason)


def _tail(text: str, limit: int) -> str:
    """At most `limit` characters, keeping the end: the error comes last in a checkpoint complaint
    ("...: no config.json") and in a traceback alike (the kubelet keeps the end too)."""
    return text if len(text) <= limit else "…" + text[len(text) - limit + 1:]
