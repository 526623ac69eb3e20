"""How fast the operator turns OmniPipelines into running children, and how quiet it is when nothing
changed, against the e2e control plane (Kubernetes v1.20.2 on this machine).

The node agent runs in --simulate mode here (pods are marked Running and Ready at once, as kwok does):
the figures are the operator's and the control plane's, not model start-up (see e2e for that).

    .venv/bin/python bench/operator_reconcile.py [--quick]

Figures (bench/results/operator_reconcile.json):
  apply_to_children_s    apply of examples/qwen3-omni-tiny.yaml -> all 16 children exist
  apply_to_ready_s       same apply -> status condition Ready=True
  noop_reconcile_writes  API writes (from the apiserver's audit log) per reconcile that has nothing to
                         change, averaged over several reconciles triggered by touching an annotation
  apply50_to_ready_s     50 pipelines applied at once -> all 50 Ready=True
  status.pending_reason_s  a stage pod the scheduler cannot place (it asks for more CPU than the node has),
                         from its PodScheduled=False condition first seen to the reason, with the
                         scheduler's message, in status.stages[].lastFailure (goal <= 10 s)

Then, on real containers (a kubelet with containerd and runc running the image of `make image`, in a private
network namespace: e2e/real/first_answer.py):
  e2e_real.apply_to_first_answer_s  apply of the example -> its first answer through the orchestrator's Service
  e2e_real.apply_to_ready_s         same apply -> Ready=True (four containers start, import torch, load models)
  e2e_real.image_import_s           `ctr images import` of the image's OCI archive into containerd (the image is
                                    removed from the store first; an unchanged image is never imported twice)
  e2e_real.image_archive_gb         the OCI archive's size (gzip layers); the image is built before and not timed
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from common import figure, print_table, write_results  # bench/common.py (puts the repository on sys.path)

from e2e.harness import OPERATOR_USER, Cluster, wait_for

REPO = Path(__file__).resolve().parent.parent

NS = "omnistage-bench"
EXAMPLE = yaml.safe_load((REPO / "examples" / "qwen3-omni-tiny.yaml").read_text())
CHILDREN = 16   # ConfigMap, SA, Role, RoleBinding, NetworkPolicy, 3 x (Deployment, Service, PDB), orchestrator x 2
POLL = 0.05


def pipeline(name: str) -> dict:
    d = copy.deepcopy(EXAMPLE)
    d["metadata"] = {"name": name, "namespace": NS}
    return d


def children(c: Cluster, name: str) -> int:
    sel = f"omnistage.io/pipeline={name}"
    n = len(c.core.list_namespaced_config_map(NS, label_selector=sel).items)
    n += len(c.core.list_namespaced_service(NS, label_selector=sel).items)
    n += len(c.core.list_namespaced_service_account(NS, label_selector=sel).items)
    n += len(c.apps.list_namespaced_deployment(NS, label_selector=sel).items)
    for kind in ("pdb", "networkpolicy", "role", "rolebinding"):
        n += len(json.loads(c.kubectl("get", kind, "-n", NS, "-l", sel, "-o", "json").stdout)["items"])
    return n


def ready_names(c: Cluster) -> set[str]:
    items = c.custom.list_namespaced_custom_object("omnistage.io", "v1alpha1", NS, "omnipipelines")["items"]
    return {p["metadata"]["name"] for p in items
            if any(x["type"] == "Ready" and x["status"] == "True"
                   for x in (p.get("status") or {}).get("conditions", []))}


def apply_one(c: Cluster) -> tuple[float, float]:
    t0 = time.monotonic()
    c.custom.create_namespaced_custom_object("omnistage.io", "v1alpha1", NS, "omnipipelines", pipeline("bench-one"))
    wait_for(lambda: children(c, "bench-one") >= CHILDREN, 120, "all children of bench-one", POLL)
    t_children = time.monotonic() - t0
    wait_for(lambda: "bench-one" in ready_names(c), 120, "bench-one Ready", POLL)
    return t_children, time.monotonic() - t0


def noop_writes(c: Cluster, rounds: int) -> tuple[float, int, int]:
    """(writes per no-op reconcile, writes, reconciles) over `rounds` annotation touches."""
    c.wait_condition(NS, "bench-one", "Progressing", "False", 60)
    log = c.run / "log" / "operator.log"
    mark, since = log.stat().st_size, time.time()
    for i in range(rounds):
        before = _reconciles(log, mark)
        c.kubectl("annotate", "omnip", "-n", NS, "bench-one", f"bench/touch={time.time_ns()}", "--overwrite")
        wait_for(lambda: _reconciles(log, mark) > before, 30, f"reconcile {i + 1} after the annotation", POLL)
    reconciles = _reconciles(log, mark)
    writes = len(c.audit_writes(OPERATOR_USER, since))
    return writes / max(reconciles, 1), writes, reconciles


def _reconciles(log: Path, mark: int) -> int:
    with open(log) as f:
        f.seek(mark)
        return sum(1 for line in f if f"reconciled {NS}/bench-one in " in line)


UNPLACEABLE = "bench-unplaceable"


def pending_reason(c: Cluster) -> float:
    """Seconds from a pod's Unschedulable condition first seen to the reason in the pipeline's status."""
    doc = yaml.safe_load((REPO / "examples" / "llm-tiny.yaml").read_text())
    doc["metadata"] = {"name": UNPLACEABLE, "namespace": NS}
    doc["spec"]["deployment"]["stages"]["llm"] = {"resources": {"requests": {"cpu": "5000"}}}   # the node has 1000
    c.custom.create_namespaced_custom_object("omnistage.io", "v1alpha1", NS, "omnipipelines", doc)
    selector = f"omnistage.io/pipeline={UNPLACEABLE},omnistage.io/stage=llm"

    def unplaced() -> bool:
        return any(cond.type == "PodScheduled" and cond.status == "False"
                   for p in c.core.list_namespaced_pod(NS, label_selector=selector).items
                   for cond in (p.status.conditions or ()))

    wait_for(unplaced, 120, "the stage pod to be refused by the scheduler", POLL)
    t0 = time.monotonic()

    def reported() -> bool:
        status = c.custom.get_namespaced_custom_object("omnistage.io", "v1alpha1", NS, "omnipipelines",
                                                       UNPLACEABLE).get("status") or {}
        failure = ((status.get("stages") or {}).get("llm") or {}).get("lastFailure") or {}
        return failure.get("reason") == "Unschedulable" and "Insufficient cpu" in failure.get("message", "")

    wait_for(reported, 120, "the Unschedulable reason in the status", POLL)
    took = time.monotonic() - t0
    c.custom.delete_namespaced_custom_object("omnistage.io", "v1alpha1", NS, "omnipipelines", UNPLACEABLE)
    return took


def apply_many(c: Cluster, n: int) -> float:
    names = [f"bench-{i:02d}" for i in range(n)]
    docs = yaml.safe_dump_all([pipeline(name) for name in names])
    t0 = time.monotonic()
    c.kubectl("apply", "-f", "-", input=docs)
    wait_for(lambda: set(names) <= ready_names(c), 600, f"{n} pipelines Ready", 0.25)
    return time.monotonic() - t0


def real_containers() -> tuple[list[dict], dict]:
    """The e2e_real.* figures: e2e/real/first_answer.py in a private network namespace of its own."""
    out = REPO / "e2e" / ".run" / "first-answer.json"
    out.unlink(missing_ok=True)
    subprocess.run([str(REPO / "e2e" / "cluster" / "in-netns.sh"), sys.executable, "-m", "e2e.real.first_answer",
                    "--reimport", "--json", str(out)], cwd=REPO, check=True)
    t = json.loads(out.read_text())
    figures = [figure("e2e_real.apply_to_first_answer_s", t["apply_to_first_answer_s"], "s"),
               figure("e2e_real.apply_to_ready_s", t["apply_to_ready_s"], "s"),
               figure("e2e_real.image_import_s", t["image_import_s"], "s"),
               figure("e2e_real.image_archive_gb", t["image_bytes"] / 1e9, "GB")]
    return figures, {"e2e_real": "kubelet v1.20.2 + containerd 1.6.20 + runc 1.1.5 (Debian), image of `make image`, "
                                 "examples/qwen3-omni-tiny.yaml with its requests lowered to fit 2 cores",
                     "e2e_real_image_build_cached_s": round(t["image_build_s"], 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer no-op rounds (the figures keep their meaning)")
    args = p.parse_args()
    c = Cluster(REPO / "e2e" / ".run" / "bench", simulate=True)
    load_at_start = round(os.getloadavg()[0], 2)   # everything here shares 2 cores: say how busy they were
    try:
        c.up()
        c.grant_operator_rbac()
        c.namespace(NS)
        c.start_operator([NS], OMNISTAGE_WORKERS="4")
        children_s, ready_s = apply_one(c)
        per, writes, reconciles = noop_writes(c, 3 if args.quick else 10)
        pending_s = pending_reason(c)
        many_s = apply_many(c, 50)
        figures = [figure("apply_to_children_s", children_s, "s"), figure("apply_to_ready_s", ready_s, "s"),
                   figure("noop_reconcile_writes", per, "writes/reconcile"),
                   figure("apply50_to_ready_s", many_s, "s"), figure("status.pending_reason_s", pending_s, "s")]
        notes = {"noop_reconciles": reconciles, "noop_writes_total": writes,
                 "load_average_1m_at_start_and_end": [load_at_start, round(os.getloadavg()[0], 2)],
                 "cluster_up_s": round(c.timings["up_s"], 1),
                 "cluster": "Kubernetes v1.20.2 e2e control plane; node agent --simulate (pods Ready at once)"}
    finally:
        c.stop_operator()
        c.down()
    real, real_notes = real_containers()
    figures += real
    notes.update(real_notes)
    print_table("operator reconcile (e2e control plane, simulated pods; e2e_real.*: real containers)", figures)
    print(f"  ({notes['noop_reconciles']} no-op reconciles made {notes['noop_writes_total']} writes; "
          f"control plane up in {notes['cluster_up_s']}s; load average {notes['load_average_1m_at_start_and_end']})")
    path = write_results("operator_reconcile", figures, {"notes": notes})
    print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
