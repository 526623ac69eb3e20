"""The chart's monitoring objects (monitoring.enabled): PodMonitors that select the pods the operator makes and
the operator itself on the ports serving /metrics, the PrometheusRule and the Grafana dashboard ConfigMap
carrying charts/omnistage/files/ as they are; nothing of it by default. (What the rules and the dashboard
query is checked against a real Prometheus: tests/local/test_serve_prometheus.py.)"""

from __future__ import annotations

import json

import yaml

from omnistage.contract.launch import HTTP_PORT_NAME
from omnistage_operator.builders import build_orchestrator_deployment, build_stage_deployment
from omnistage_operator.config import OperatorConfig

from ..harness import example
from .test_operator_chart import CHART, helm, needs_helm, render, render_all

MONITORING_KINDS = {"PodMonitor", "PrometheusRule"}
ON = ("monitoring.enabled=true", "monitoring.labels.release=kube-prometheus-stack")


def monitoring_objects(*sets: str) -> dict[tuple[str, str], dict]:
    return {k: d for k, d in render(*sets).items() if k[0] in MONITORING_KINDS or k[1].endswith("-dashboard")}


def selects(monitor: dict, pod_template: dict) -> str | None:
    """The port a PodMonitor scrapes on a pod of this template, when it selects it."""
    labels = pod_template["metadata"]["labels"]
    if not monitor["spec"]["selector"]["matchLabels"].items() <= labels.items():
        return None
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"] for c in pod_template["spec"]["containers"] for p in c.get("ports", [])}
    return endpoint["port"] if endpoint["port"] in ports and endpoint["path"] == "/metrics" else None


@needs_helm
def test_nothing_of_monitoring_renders_by_default():
    assert monitoring_objects() == {}


@needs_helm
def test_pod_monitors_select_every_process_on_its_metrics_port():
    objs = render(*ON)
    monitors = {name: d for (kind, name), d in objs.items() if kind == "PodMonitor"}
    assert set(monitors) == {"omnistage-stages", "omnistage-orchestrators", "omnistage-operator"}
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors.values())
    p, cfg = example("qwen3-omni-tiny"), OperatorConfig()
    stage = build_stage_deployment(p, "talker", cfg)["spec"]["template"]
    orchestrator = build_orchestrator_deployment(p, cfg)["spec"]["template"]
    operator = objs[("Deployment", "omnistage")]["spec"]["template"]
    assert selects(monitors["omnistage-stages"], stage) == HTTP_PORT_NAME
    assert selects(monitors["omnistage-orchestrators"], orchestrator) == HTTP_PORT_NAME
    assert selects(monitors["omnistage-operator"], operator) == "metrics"
    # each selects its own kind of pod only
    assert selects(monitors["omnistage-stages"], orchestrator) is None
    assert selects(monitors["omnistage-orchestrators"], stage) is None
    assert selects(monitors["omnistage-operator"], stage) is None
    # stage and orchestrator series get their pipeline from the pod (their own carry none)
    relabel = monitors["omnistage-stages"]["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_omnistage_io_pipeline"], "targetLabel": "pipeline"} in relabel
    # the release namespace by default; every namespace cluster-wide
    assert monitors["omnistage-stages"]["spec"]["namespaceSelector"] == {"matchNames": ["omnistage-system"]}
    wide = monitoring_objects(*ON, "clusterWide=true")[("PodMonitor", "omnistage-stages")]
    assert wide["spec"]["namespaceSelector"] == {"any": True}
    listed = [d for d in render_all(*ON, "watchNamespaces={team-a,team-b}") if d["kind"] == "PodMonitor"]
    pipelines = [d["spec"]["namespaceSelector"] for d in listed if d["metadata"]["name"] != "omnistage-operator"]
    assert pipelines == [{"matchNames": ["team-a", "team-b"]}] * 2


@needs_helm
def test_rules_and_dashboard_are_the_files_they_come_from():
    objs = monitoring_objects(*ON)
    rule = objs[("PrometheusRule", "omnistage")]
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "rules.yaml").read_text())
    board = objs[("ConfigMap", "omnistage-dashboard")]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    shipped = json.loads((CHART / "files" / "dashboard.json").read_text())
    assert json.loads(board["data"]["omnistage-pipeline.json"]) == shipped


@needs_helm
def test_rules_and_dashboard_can_be_left_out():
    objs = monitoring_objects(*ON, "monitoring.rules.enabled=false", "monitoring.dashboard.enabled=false")
    assert {k[0] for k in objs} == {"PodMonitor"}


def notes(tmp_path, *sets: str) -> str:
    """The chart's NOTES.txt as an install prints it (helm template leaves NOTES out: a copy of the chart renders
    it into a ConfigMap with `tpl`)."""
    import shutil

    chart = tmp_path / "chart"
    shutil.rmtree(chart, ignore_errors=True)
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "install-notes.txt")
    (chart / "templates" / "install-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: install-notes}\n"
        'data: {notes: {{ tpl (.Files.Get "install-notes.txt") . | quote }}}\n')
    args = ["template", "omnistage", str(chart), "--namespace", "omnistage-system",
            "--show-only", "templates/install-notes.yaml"]
    for s in sets:
        args += ["--set", s]
    r = helm(*args)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)["data"]["notes"]


@needs_helm
def test_monitoring_without_a_way_through_the_network_policies_is_warned_of(tmp_path):
    assert "WARNING: monitoring is on" in notes(tmp_path, *ON)
    assert "WARNING" not in notes(tmp_path, *ON, "pipelinePods.metricsNamespaceLabel=kubernetes.io/metadata.name=mon")
    assert "WARNING" not in notes(tmp_path)
