"""The stage planner in the operator, its pure parts: which pods are measured, the replicas an autoscaled
stage's Deployment starts with and keeps, what the status and the Planned condition say of a decision,
when the status is written again, the NetworkPolicy rule for the operator's scrapes and its setting, and
every pipeline's decisions as one Prometheus exposition, and what one scrape of the pods (with a fetch of
our own) hands the planner. The loop around them (scrapes, the scale subresource, events) runs against the
real API server in e2e/test_autoscaling.py."""

from __future__ import annotations

import copy
import json
import math

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omnistage.planner.controller import Planner
from omnistage.planner.decisions import Change
from omnistage.planner.load import ReplicaCounters
from omnistage.planner.metrics import PlannerMetrics
from omnistage.planner.scrape import RTF
from omnistage_operator.autoscaler import Autoscaler, _Merged, autoscaling_enabled, signature
from omnistage_operator.builders import build_children
from omnistage_operator.config import ConfigError, ModelVolume, OperatorConfig, from_env
from omnistage_operator.pipeline_object import parse
from omnistage_operator.planning import (
    STATUS_REFRESH_S,
    PlannedView,
    Plans,
    ScrapeTarget,
    change_message,
    planned_replicas,
    planned_view,
    ready_floor,
    scrape_targets,
    starting_replicas,
)
from omnistage_operator.rollout import RolloutPlan
from omnistage_operator.status import build_status
from omnistage_operator.vocabulary import (
    COMPONENT_STAGE,
    LABEL_COMPONENT,
    LABEL_STAGE,
    PLANNED,
    R_BUDGET_LIMITED,
    R_MEASURING,
    R_NO_LOAD,
    R_SIZED,
)
from orchestrator_service.metrics import OrchestratorMetrics

from ..conftest import EXAMPLES

BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())   # thinker -> talker -> code2wav
STAGES = ("thinker", "talker", "code2wav")
CFG = OperatorConfig(model_volume=ModelVolume("hostPath", "/srv/models", "/models"))
T0 = "2024-01-01T00:00:00Z"


def doc(auto=None, replicas=None) -> dict:
    d = copy.deepcopy(BASE)
    if auto is not None:
        d["spec"]["deployment"]["autoscaling"] = auto
    for stage, n in (replicas or {}).items():
        d["spec"]["deployment"]["stages"][stage]["replicas"] = n
    return d


AUTO = {"enabled": True, "stages": {"talker": {"minReplicas": 2, "maxReplicas": 3}}}


# ------------------------------------------------------------------------------- scrape targets

def pod(name, *, stage="talker", ready=True, ip="127.0.1.5", deleting=False, component="stage", port=None):
    meta = {"name": name, "labels": {"omnistage.io/component": component, "omnistage.io/stage": stage}}
    if deleting:
        meta["deletionTimestamp"] = T0
    ports = [{"name": "grpc", "containerPort": 50051}] + ([{"name": "http", "containerPort": port}] if port else [])
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"containers": [{"name": "stage", "ports": ports}]}, "status": status}


def test_only_ready_pods_with_an_ip_are_measured_on_their_http_port_stages_and_orchestrators_apart():
    pods = [pod("t-a", port=9090), pod("t-b"), pod("t-starting", ready=False), pod("t-going", deleting=True),
            pod("t-no-ip", ip=""), pod("orch", component="orchestrator"), pod("c-a", stage="code2wav", ip="127.0.1.9")]
    assert scrape_targets(pods) == {
        "talker": [ScrapeTarget("t-a", "127.0.1.5", 9090), ScrapeTarget("t-b", "127.0.1.5", 8080)],
        "code2wav": [ScrapeTarget("c-a", "127.0.1.9", 8080)],
        "orchestrator": [ScrapeTarget("orch", "127.0.1.5", 8080)]}   # its first packets and rtf, for the targets


class Recording(Planner):
    """The real planner, keeping what the orchestrators' scrape handed it."""

    def observe_orchestrators(self, readings, at):
        self.orchestrator_readings = readings
        super().observe_orchestrators(readings, at)

    def observe_classes(self, readings, at):
        self.class_readings = readings
        super().observe_classes(readings, at)


@pytest.mark.parametrize("targets", [{}, {"rtf": 0.8}])
def test_the_orchestrator_pods_are_scraped_for_their_histograms_and_request_classes(targets):
    orch = OrchestratorMetrics(CollectorRegistry())
    orch.observe_audio(3.0, 2.0)
    orch.class_requests.labels("text->text+audio").inc(3)
    texts = {"orch": generate_latest(orch.registry).decode(), "t-a": ""}
    fetched = []

    def fetch(target):
        fetched.append(target.pod)
        return texts[target.pod]

    planner = Recording(config(targets=targets), {"thinker": 1, "talker": 2, "code2wav": 1})
    autoscaler = Autoscaler(None, Plans(), fetch, clock=lambda: 0.0)
    try:
        autoscaler._observe(planner, [pod("t-a"), pod("orch", component="orchestrator")])
    finally:
        autoscaler.close()
    assert sorted(fetched) == ["orch", "t-a"]   # with a latency target or without: the classes are read
    got = planner.orchestrator_readings
    assert got["orch"][RTF][math.inf] == 1 and got["orch"][RTF][1.5] == 1
    assert planner.class_readings["orch"].admitted == {"text->text+audio": 3.0}


# ------------------------------------------------------------------------------------ replicas

@pytest.mark.parametrize("auto, spec_n, want", [
    (None, 5, 5),                 # no autoscaling: the count
    ({"enabled": False, **{k: v for k, v in AUTO.items() if k != "enabled"}}, 5, 5),
    (AUTO, 1, 2),                 # the starting count, clamped up to minReplicas
    (AUTO, 5, 3),                 # and down to maxReplicas
    (AUTO, 2, 2),
])
def test_a_stage_starts_at_its_count_clamped_to_its_bounds_under_autoscaling(auto, spec_n, want):
    p = parse(doc(auto, {"talker": spec_n}))
    assert starting_replicas(p, "talker") == want
    assert build_children(p, CFG, "policy/v1").stages["talker"].deployment["spec"]["replicas"] == want
    assert planned_replicas(p, "talker", None) == want


def test_under_autoscaling_the_live_count_stands_and_without_it_the_spec_wins():
    live = {"spec": {"replicas": 3}}
    assert planned_replicas(parse(doc(AUTO)), "talker", live) == 3       # the planner's, never fought
    assert planned_replicas(parse(doc(None, {"talker": 1})), "talker", live) == 1   # put back


def test_replicas_the_planner_added_are_not_missing_while_they_start():
    auto = parse(doc(AUTO))
    assert ready_floor(auto, "talker", 3) == 2    # minReplicas
    assert ready_floor(auto, "thinker", 2) == 1   # the default minReplicas 1
    assert ready_floor(auto, "talker", 1) == 1    # never more than it runs
    assert ready_floor(parse(doc()), "talker", 3) == 3


# ------------------------------------------------------------------------------- planned view

def counters(at, units, busy, finished=0.0, queued=0):
    return ReplicaCounters(at, units, busy, finished, queued, 1 if busy else 0)


def run(planner, seconds, per_stage):
    """`per_stage`: stage -> (units/s served, busy share of one replica, queued); read every second."""
    totals = {s: [0.0, 0.0] for s in per_stage}
    for t in range(seconds + 1):
        for stage, (rate, busy, queued) in per_stage.items():
            planner.observe(stage, {f"{stage}-0": counters(float(t), totals[stage][0], totals[stage][1],
                                                           totals[stage][0] / 10, queued)}, "frames")
            totals[stage][0] += rate
            totals[stage][1] += busy
    return planner.decide(float(seconds))


def config(**kw):
    return parse(doc({**AUTO, **kw})).deployment.autoscaling


def test_the_view_names_each_stage_figures_and_a_sized_condition():
    planner = Planner(config(), {"thinker": 1, "talker": 2, "code2wav": 1})
    d = run(planner, 12, {"thinker": (50.0, 0.5, 0), "talker": (100.0, 0.95, 30), "code2wav": (80.0, 0.2, 0)})
    view = planned_view(d, planner.desired())
    assert set(view.stages) == set(STAGES)
    talker = view.stages["talker"]
    assert talker["desiredReplicas"] == planner.desired()["talker"] >= 2
    assert talker["capacityUnit"] == "frames/s" and talker["capacity"] > 0 and talker["utilization"] > 0
    assert view.condition["type"] == PLANNED and view.condition["status"] == "True"
    assert view.condition["reason"] == R_SIZED and "bottleneck" in view.condition["message"]


def test_the_view_shows_each_stage_demand_per_request_from_the_graph():
    """10 units a request everywhere; 4 of the Thinker's 5 requests a second go on to the Talker (and all of
    those to Code2Wav): a request entering the pipeline takes 10 units at the Thinker, 8 at the others."""
    graph = {"thinker": (), "talker": ("thinker",), "code2wav": ("talker",)}
    planner = Planner(config(), {"thinker": 1, "talker": 1, "code2wav": 1}, upstream=graph)
    d = run(planner, 30, {"thinker": (50.0, 0.5, 0), "talker": (40.0, 0.4, 0), "code2wav": (40.0, 0.4, 0)})
    demand = {s: v.get("demandPerRequest") for s, v in planned_view(d, planner.desired()).stages.items()}
    assert demand == pytest.approx({"thinker": 10.0, "talker": 8.0, "code2wav": 8.0}, rel=0.02)
    alone = Planner(config(), {"thinker": 1, "talker": 1, "code2wav": 1})   # no graph: each stage its own source
    d = run(alone, 30, {"thinker": (50.0, 0.5, 0), "talker": (40.0, 0.4, 0), "code2wav": (40.0, 0.4, 0)})
    assert planned_view(d, alone.desired()).stages["talker"]["demandPerRequest"] == pytest.approx(10.0, rel=0.02)


def test_a_budget_that_cannot_meet_the_target_says_so():
    planner = Planner(config(budget={"maxReplicas": 4}), {"thinker": 1, "talker": 2, "code2wav": 1})
    # every stage busy all the time with a queue: each surely needs more than one replica (at 0.9 busy, 5 to 8
    # requests a second over a 10 s window would be within the noise of the 0.8 target: load.load_floor)
    d = run(planner, 12, {"thinker": (50.0, 1.0, 20), "talker": (100.0, 1.0, 60), "code2wav": (80.0, 1.0, 20)})
    view = planned_view(d, planner.desired())
    assert view.condition["reason"] == R_BUDGET_LIMITED
    assert "cannot meet the target" in view.condition["message"]
    assert sum(v["desiredReplicas"] for v in view.stages.values()) <= 4


def test_before_any_work_the_condition_is_unknown_and_says_what_is_not_measured():
    planner = Planner(config(), {"thinker": 1, "talker": 2, "code2wav": 1})
    view = planned_view(planner.decide(0.0), planner.desired())
    assert (view.condition["status"], view.condition["reason"]) == ("Unknown", R_MEASURING)
    assert "talker" in view.condition["message"]
    assert view.stages["talker"] == {"desiredReplicas": 2, "capacity": 0.0, "utilization": 0.0}   # no unit yet


def test_no_load_after_measuring_is_said():
    planner = Planner(config(), {"thinker": 1, "talker": 2, "code2wav": 1})
    run(planner, 12, {"thinker": (50.0, 0.5, 0), "talker": (100.0, 0.5, 0), "code2wav": (80.0, 0.2, 0)})
    d = run(planner, 30, {"thinker": (0.0, 0.0, 0), "talker": (0.0, 0.0, 0), "code2wav": (0.0, 0.0, 0)})
    assert planned_view(d, planner.desired()).condition["reason"] == R_NO_LOAD


# ------------------------------------------------------------------------------- status writes

def view(talker=2, reason=R_SIZED, capacity=100.0):
    stages = {s: {"desiredReplicas": talker if s == "talker" else 1, "capacity": capacity,
                  "capacityUnit": "frames/s", "utilization": 0.5} for s in STAGES}
    return PlannedView(stages, {"type": PLANNED, "status": "True", "reason": reason, "message": "m"})


def test_a_changed_count_or_reason_is_written_at_once_figures_at_most_every_refresh():
    plans, key = Plans(), ("ns", "p")
    assert plans.put(key, view(), 0.0)                     # first
    assert not plans.put(key, view(), 1.0)                 # the same
    assert not plans.put(key, view(capacity=90.0), 2.0)    # figures only, within the refresh
    assert plans.put(key, view(talker=3), 3.0)             # a count
    assert plans.put(key, view(talker=3, reason=R_NO_LOAD), 4.0)   # a reason
    assert plans.put(key, view(talker=3, reason=R_NO_LOAD, capacity=80.0), 4.0 + STATUS_REFRESH_S)
    assert plans.get(key) == view(talker=3, reason=R_NO_LOAD, capacity=80.0)
    assert plans.drop(key) and plans.get(key) is None and not plans.drop(key)


def counts(ready, replicas):
    return {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": ready}


def test_the_status_carries_the_view_and_a_starting_added_replica_is_not_missing():
    stages = {"thinker": counts(1, 1), "talker": counts(2, 3), "code2wav": counts(1, 1)}
    st = build_status(None, generation=4, stages=stages, orchestrator=counts(1, 1), deployments={},
                      plan=RolloutPlan((), (), ()), endpoint="e", now=T0,
                      floors={"thinker": 1, "talker": 2, "code2wav": 1}, autoscaled=True, planned=view(talker=3))
    assert st["stages"]["talker"] == {**counts(2, 3), "desiredReplicas": 3, "capacity": 100.0,
                                      "capacityUnit": "frames/s", "utilization": 0.5}
    by_type = {c["type"]: c for c in st["conditions"]}
    assert by_type["Ready"]["status"] == "True" and by_type["Degraded"]["status"] == "False"
    assert by_type[PLANNED]["reason"] == R_SIZED and by_type[PLANNED]["observedGeneration"] == 4
    assert st["stagesReady"] == "3/3"
    # a new operator process has no view yet: the status keeps what it said (no flap, no rewrite)
    again = build_status(st, generation=4, stages=stages, orchestrator=counts(1, 1), deployments={},
                         plan=RolloutPlan((), (), ()), endpoint="e", now="2024-01-01T00:09:00Z",
                         floors={"thinker": 1, "talker": 2, "code2wav": 1}, autoscaled=True, planned=None)
    assert again == st
    # below minReplicas it is missing; and autoscaling turned off drops the Planned condition
    stages["talker"] = counts(1, 3)
    st2 = build_status(st, generation=5, stages=stages, orchestrator=counts(1, 1), deployments={},
                       plan=RolloutPlan((), (), ()), endpoint="e", now=T0, floors={"talker": 2})
    by_type = {c["type"]: c for c in st2["conditions"]}
    assert by_type["Ready"]["status"] == "False" and "talker 1/3" in by_type["Ready"]["message"]
    assert PLANNED not in by_type and "desiredReplicas" not in st2["stages"]["talker"]


# ------------------------------------------------------------------------------- NetworkPolicy

OPERATOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "omnistage-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "omnistage"}}}


@pytest.mark.parametrize("policy", ["network_policy", "orchestrator_network_policy"])
def test_only_autoscaled_pipelines_let_the_operator_read_stage_and_orchestrator_metrics(policy):
    cfg = OperatorConfig(model_volume=CFG.model_volume, operator_peer=OPERATOR)
    rule = {"from": [OPERATOR], "ports": [{"protocol": "TCP", "port": "http"}]}
    assert rule in getattr(build_children(parse(doc(AUTO)), cfg, "policy/v1"), policy)["spec"]["ingress"]
    assert rule not in getattr(build_children(parse(doc()), cfg, "policy/v1"), policy)["spec"]["ingress"]
    assert rule not in getattr(build_children(parse(doc(AUTO)), CFG, "policy/v1"), policy)["spec"]["ingress"]


def test_the_operator_peer_setting():
    assert from_env({"OMNISTAGE_OPERATOR_PEER": json.dumps(OPERATOR)}).operator_peer == OPERATOR
    assert from_env({}).operator_peer is None
    for bad in ("{not json", "[]", "{}"):
        with pytest.raises(ConfigError, match="OMNISTAGE_OPERATOR_PEER"):
            from_env({"OMNISTAGE_OPERATOR_PEER": bad})


# ------------------------------------------------------------------------------- the watch

def test_the_watch_tracks_what_asks_for_autoscaling_and_a_change_starts_afresh():
    assert autoscaling_enabled(doc(AUTO)) and not autoscaling_enabled(doc())
    assert not autoscaling_enabled({"spec": {"deployment": None}}) and not autoscaling_enabled({})
    a, b = parse(doc(AUTO)), parse(doc({**AUTO, "intervalSeconds": 2}))
    assert signature(a) == signature(parse(doc(AUTO))) != signature(b)


def test_every_pipelines_decisions_are_one_exposition():
    by_pipeline = {}
    for ns, talker in (("a", 2), ("b", 3)):
        planner = Planner(config(), {"thinker": 1, "talker": talker, "code2wav": 1})
        by_pipeline[(ns, "p")] = PlannerMetrics(f"{ns}/p")
        by_pipeline[(ns, "p")].record(planner, planner.decide(0.0))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(by_pipeline))
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    desired = next(f for f in families if f.name == "omnistage_planner_desired_replicas")
    assert {(s.labels["pipeline"], s.labels["stage"]): s.value
            for s in desired.samples if s.labels["stage"] == "talker"} \
        == {("a/p", "talker"): 2.0, ("b/p", "talker"): 3.0}
    assert len([f for f in families if f.name == desired.name]) == 1   # one family, both pipelines' samples
    del by_pipeline[("a", "p")]                                          # a pipeline forgotten leaves it
    assert "a/p" not in generate_latest(registry).decode()


def test_a_change_is_told_with_the_stages_own_figures_and_the_plans_reason_in_either_mode():
    planner = Planner(config(), {"thinker": 1, "talker": 2, "code2wav": 1})
    d = run(planner, 12, {"thinker": (50.0, 0.5, 0), "talker": (100.0, 0.95, 30), "code2wav": (80.0, 0.2, 0)})
    scaled = change_message(d, Change("talker", 2, 3))
    assert scaled.startswith("talker: 2 -> 3 replicas (") and "frames/s offered" in scaled
    assert scaled.endswith(f"); {d.plan.reason}")
    assert change_message(d, Change("talker", 2, 3), scales=False).startswith("talker: 2 -> 3 replicas recommended (")


class StillKube:
    """The API server as the autoscaler reads it: one autoscaled pipeline whose stage Deployments exist, no pods
    ready yet; scales and events are recorded."""

    def __init__(self, body):
        self.body, self.scaled, self.events = body, [], []

    def get_pipeline(self, namespace, name):
        return self.body

    def list_kind(self, kind, namespace, name):
        return [{"metadata": {"labels": {LABEL_COMPONENT: COMPONENT_STAGE, LABEL_STAGE: s}}, "spec": {"replicas": 2}}
                for s in STAGES]

    def list_pods(self, namespace, name):
        return []

    def list_replica_sets(self, namespace, name):
        return []

    def scale(self, *args):
        self.scaled.append(args)

    def post_event(self, *args):
        self.events.append(args)


def test_the_cluster_planner_is_given_the_pipelines_stage_graph():
    """The graph (spec.topology's inputs) lets the planner read an upstream's catch-up as backlog in transit
    (omnistage.planner.graph); the operator hands it over as `serve --autoscale` does."""
    body = doc(AUTO)
    body["metadata"].setdefault("namespace", "ns")
    autoscaler = Autoscaler(StillKube(body), Plans(), lambda t: "", clock=lambda: 0.0)
    try:
        autoscaler.tracked.add(("ns", body["metadata"]["name"]))
        autoscaler.step(("ns", body["metadata"]["name"]))
    finally:
        autoscaler.close()
    planner = autoscaler.pipelines[("ns", body["metadata"]["name"])].planner
    assert planner.upstream == {"thinker": (), "talker": ("thinker",), "code2wav": ("talker",)}
