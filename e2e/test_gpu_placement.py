"""A GPU stage on a cluster without GPU nodes: the API server takes every placement field the operator
writes (nodeSelector, tolerations, priorityClassName, runtimeClassName, the stage's rollout surge, the
GPU limit, a memory-backed /dev/shm), the scheduler holds the pod for a node that has what it asks for,
and the pipeline's status says the stage is not ready instead of pretending."""

from __future__ import annotations

import pytest
import yaml

from .conftest import NS
from .harness import REPO, wait_for

NAME = "gpu-placement"
STAGE = "llm"
PRIORITY_CLASS = "omnistage-e2e-gpu"
RUNTIME_CLASS = "omnistage-e2e-nvidia"
PLACEMENT = {
    "gpus": 1,
    "nodeSelector": {"omnistage.io/e2e-gpu": "h200"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": PRIORITY_CLASS,
    "runtimeClassName": RUNTIME_CLASS,
    "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
}
CLASSES = f"""
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {{name: {PRIORITY_CLASS}}}
value: 1000
---
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {{name: {RUNTIME_CLASS}}}
handler: nvidia
"""


@pytest.fixture
def gpu_pipeline(operator):
    operator.kubectl("apply", "-f", "-", input=CLASSES)
    doc = yaml.safe_load((REPO / "examples" / "llm-tiny.yaml").read_text())
    doc["metadata"]["name"] = NAME
    doc["spec"]["deployment"]["stages"][STAGE].update(PLACEMENT)
    doc["spec"]["deployment"]["orchestrator"] = {"replicas": 0}
    operator.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(doc))
    yield operator
    operator.delete_pipeline(NS, NAME, "the GPU pipeline's pods to go")
    operator.kubectl("delete", "-f", "-", "--ignore-not-found", input=CLASSES)


def test_a_gpu_stage_carries_its_placement_and_waits_for_a_gpu_node(gpu_pipeline):
    c = gpu_pipeline
    selector = f"omnistage.io/pipeline={NAME},omnistage.io/stage={STAGE}"
    dep = wait_for(lambda: next(iter(c.apps.list_namespaced_deployment(NS, label_selector=selector).items), None),
                   60, f"the {STAGE} Deployment")
    ru = dep.spec.strategy.rolling_update
    assert (ru.max_surge, ru.max_unavailable) == (0, 1)
    pod = wait_for(lambda: next(iter(c.core.list_namespaced_pod(NS, label_selector=selector).items), None),
                   60, f"a {STAGE} pod (the API server admitted its template)")
    spec = pod.spec
    assert spec.node_selector == PLACEMENT["nodeSelector"]
    assert any((t.key, t.operator, t.effect) == ("nvidia.com/gpu", "Exists", "NoSchedule") for t in spec.tolerations)
    assert (spec.priority_class_name, spec.priority, spec.runtime_class_name) == (PRIORITY_CLASS, 1000, RUNTIME_CLASS)
    (container,) = spec.containers
    assert container.resources.limits["nvidia.com/gpu"] == "1"
    shm = {v.name: v for v in spec.volumes}[next(m.name for m in container.volume_mounts if m.mount_path == "/dev/shm")]
    assert shm.empty_dir.medium == "Memory"

    def unschedulable():
        p = c.core.read_namespaced_pod(pod.metadata.name, NS)
        cond = next((x for x in p.status.conditions or [] if x.type == "PodScheduled"), None)
        return cond is not None and cond.status == "False" and cond.reason == "Unschedulable" and (p, cond)

    p, cond = wait_for(unschedulable, 60, "the scheduler to hold the GPU pod")
    assert p.spec.node_name is None and p.status.phase == "Pending"
    assert any(w in cond.message for w in ("node affinity", "node selector", "nvidia.com/gpu")), cond.message
    status = c.pipeline(NS, NAME).get("status") or {}
    assert status.get("stages", {}).get(STAGE, {}).get("readyReplicas", 0) == 0
    c.wait_condition(NS, NAME, "Ready", "False", 60)
