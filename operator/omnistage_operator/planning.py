"""Pure: what the stage planner (omnistage.planner) means for an OmniPipeline in the cluster.

Which pods it measures (`scrape_targets`), the replicas each autoscaled stage's Deployment starts with and
keeps between decisions (`starting_replicas`, `planned_replicas`), and what the status says of its last
decision (`planned_view`: each stage's desiredReplicas, capacity and utilisation, and the `Planned`
condition). The I/O around it (scraping, the scale subresource, events) is autoscaler.py's; the status is
written by the reconcile, its one writer, from the last view (`Plans`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping

from omnistage.api import Pipeline
from omnistage.contract.launch import HTTP_PORT, HTTP_PORT_NAME
from omnistage.planner.controller import Decision
from omnistage.planner.decisions import Change

from .conditions import condition
from .vocabulary import (
    COMPONENT_ORCHESTRATOR,
    COMPONENT_STAGE,
    LABEL_COMPONENT,
    LABEL_STAGE,
    ORCHESTRATOR,
    PLANNED,
    R_BUDGET_LIMITED,
    R_MEASURING,
    R_NO_LOAD,
    R_SIZED,
)

# Between decisions that change nothing, the status's measured figures are refreshed at most this often (a
# changed replica count or condition reason is written at once): a status write per interval would load
# the API server for figures that move every second.
STATUS_REFRESH_S = 15.0


@dataclass(frozen=True)
class ScrapeTarget:
    pod: str
    host: str
    port: int


def scrape_targets(pods: Iterable[Mapping[str, Any]]) -> dict[str, list[ScrapeTarget]]:
    """Per stage, the pods to measure, and under ORCHESTRATOR the orchestrator pods (their time to first
    packet and real-time factor, for targets.ttfpP95Ms and targets.rtf): ready (they serve: a starting
    replica has no counters worth reading, and the orchestrator sends it nothing yet), not being deleted,
    with an IP."""
    out: dict[str, list[ScrapeTarget]] = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        component = labels.get(LABEL_COMPONENT)
        unit = labels.get(LABEL_STAGE) if component == COMPONENT_STAGE else (
            ORCHESTRATOR if component == COMPONENT_ORCHESTRATOR else None)
        if not unit or meta.get("deletionTimestamp"):
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
        if not ready or not status.get("podIP") or (pod.get("spec") or {}).get("hostNetwork"):
            continue   # a host-network pod's IP is its node's: the port it declares could be anything there
        out.setdefault(unit, []).append(ScrapeTarget(meta.get("name", ""), status["podIP"], _http_port(pod)))
    return out


def owned_pods(pods: Iterable[dict], replica_sets: Iterable[Mapping[str, Any]],
               deployments: Iterable[Mapping[str, Any]], pipeline_uid: str) -> list[dict]:
    """The pods the pipeline's own Deployments made: controlled by a ReplicaSet that one of its Deployments
    controls. Labels are what any tenant may put on a pod; this chain is what the operator made, so a pod
    that only wears the pipeline's labels (on a port, or a host network, of its choosing) is never scraped."""
    if not pipeline_uid:
        return []
    ours = {_uid(d) for d in deployments if _controller(d) == pipeline_uid}
    sets = {_uid(rs) for rs in replica_sets if _controller(rs) in ours}
    return [pod for pod in pods if _controller(pod) in sets]


def _uid(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("uid")


def _controller(obj: Mapping[str, Any]) -> str | None:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or ()
    return next((r.get("uid") for r in refs if r.get("controller")), None)


def _http_port(pod: Mapping[str, Any]) -> int:
    for c in (pod.get("spec") or {}).get("containers") or ():
        for p in c.get("ports") or ():
            if p.get("name") == HTTP_PORT_NAME and p.get("containerPort"):
                return int(p["containerPort"])
    return HTTP_PORT


def autoscaled(p: Pipeline) -> bool:
    return p.deployment.autoscaling.enabled


def starting_replicas(p: Pipeline, stage: str) -> int:
    """A stage Deployment's replicas when it is created: the spec's count, clamped to the stage's bounds
    under autoscaling (the starting point only), else the spec's count."""
    n = p.deployment.stages[stage].replicas
    if not autoscaled(p):
        return n
    b = p.deployment.autoscaling.bounds(stage)
    return min(max(n, b.min_replicas), b.max_replicas)


def planned_replicas(p: Pipeline, stage: str, live: Mapping[str, Any] | None) -> int:
    """The replicas a stage is asked to run (its status's `replicas`): under autoscaling, what the live
    Deployment has (the planner writes it through the scale subresource; the reconcile never writes it
    after creating the Deployment) or, before it exists, the starting count; without autoscaling, the
    spec's count."""
    if autoscaled(p) and live is not None:
        return int((live.get("spec") or {}).get("replicas", starting_replicas(p, stage)))
    return starting_replicas(p, stage)


def ready_floor(p: Pipeline, stage: str, replicas: int) -> int:
    """Ready replicas below which the stage counts as short (Ready False, Degraded): all of them, except
    that under autoscaling replicas the planner just added are not missing while they start; the stage's
    minReplicas (or fewer, when it runs fewer) are."""
    if not autoscaled(p):
        return replicas
    return min(replicas, p.deployment.autoscaling.bounds(stage).min_replicas)


@dataclass(frozen=True)
class PlannedView:
    """The planner's last word on a pipeline, as the status shows it."""
    stages: Mapping[str, Mapping[str, Any]]   # per stage: desiredReplicas, capacity, capacityUnit, utilization,
                                              # demandPerRequest
    condition: Mapping[str, Any]              # the Planned condition (no generation: the reconcile adds it)


def planned_view(decision: Decision, desired: Mapping[str, int]) -> PlannedView:
    stages = {}
    for stage, n in desired.items():
        est = decision.estimates[stage]
        entry = {"desiredReplicas": n, "capacity": _round(est.capacity), "utilization": round(est.utilization, 2)}
        if est.capacity > 0:   # absent until measured (the API server takes an empty string for null)
            entry["capacityUnit"] = decision.units[stage]
        if decision.demand.get(stage, 0) > 0:
            entry["demandPerRequest"] = _round(decision.demand[stage])
        stages[stage] = entry
    unmeasured = [s for s in desired if decision.estimates[s].capacity <= 0]
    plan = decision.plan
    if plan.bottleneck is None:
        cond = condition(PLANNED, True, R_NO_LOAD, plan.reason)
    elif plan.budget_limited:
        cond = condition(PLANNED, True, R_BUDGET_LIMITED, plan.reason)
    else:
        cond = condition(PLANNED, True, R_SIZED, plan.reason)
    if unmeasured and plan.bottleneck is None:
        cond = condition(PLANNED, "Unknown", R_MEASURING,
                         f"not measured yet (no work seen): {', '.join(unmeasured)}; held at their replicas")
    return PlannedView(stages, cond)


def change_message(decision: Decision, change: Change, scales: bool = True) -> str:
    """A change's Event: the stage's own figures, then the plan's reason."""
    verb = "replicas" if scales else "replicas recommended"
    return (f"{change.stage}: {change.before} -> {change.after} {verb} ({decision.figures(change.stage)}); "
            f"{decision.plan.reason}")


def _round(x: float) -> float:
    return float(f"{x:.3g}")


def status_changed(old: PlannedView | None, new: PlannedView) -> bool:
    """Whether `new` changes what a reader acts on: a stage's desired replicas or the condition's reason."""
    if old is None:
        return True
    return (old.condition.get("reason") != new.condition.get("reason") or
            {s: v["desiredReplicas"] for s, v in old.stages.items()} !=
            {s: v["desiredReplicas"] for s, v in new.stages.items()})


@dataclass
class Plans:
    """The planner's last view of each autoscaled pipeline, by (namespace, name): written by the autoscaler's
    task, read by reconciles (other threads)."""
    _views: dict[Hashable, PlannedView] = field(default_factory=dict)
    _written_at: dict[Hashable, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, key: Hashable) -> PlannedView | None:
        with self._lock:
            return self._views.get(key)

    def put(self, key: Hashable, view: PlannedView, now: float) -> bool:
        """Keep `view`; True when the status should be written again now (see STATUS_REFRESH_S)."""
        with self._lock:
            old = self._views.get(key)
            self._views[key] = view
            due = now - self._written_at.get(key, -STATUS_REFRESH_S) >= STATUS_REFRESH_S
            if status_changed(old, view) or (due and view != old):
                self._written_at[key] = now
                return True
            return False

    def drop(self, key: Hashable) -> bool:
        """Forget the pipeline; True when it had a view (its status should lose it)."""
        with self._lock:
            self._written_at.pop(key, None)
            return self._views.pop(key, None) is not None
