"""From `kubectl apply` to the first answer through the orchestrator's Service, on real containers: the
scenario e2e/real/test_containers.py runs and bench/operator_reconcile.py times (`e2e_real.*`).

    e2e/cluster/in-netns.sh .venv/bin/python -m e2e.real.first_answer [--json OUT]

brings up its own cluster with a real node (e2e/harness.py, node="real"), runs the operator, applies
examples/qwen3-omni-tiny.yaml, waits for the first generated answer through the Service, and takes it all down."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import grpc
import yaml

from omnistage.client import GenerateResult, OmniClient

from ..harness import REPO, Cluster, wait_for

PIPE = "qwen3-omni-tiny"
EXAMPLE = REPO / "examples" / f"{PIPE}.yaml"
READY_TIMEOUT = 420      # first start of four containers importing torch and loading models on 2 cores
REQUEST = {"max_tokens": 8, "max_codec_frames": 25}
# The example asks for 2.5 CPUs of requests; a 2-core e2e node has less. 300m each leaves room for a rollout's
# surge pod and a fifth pod (1.5 CPUs) and gives each container a fair cgroup share against the machine's other
# processes. Everything else is the example's.
SMALL_REQUESTS = {"cpu": "300m", "memory": "512Mi"}


def private_network() -> bool:
    """Only loopback, a pod bridge and pods' veths here: a namespace with no way out of the machine."""
    return all(name == "lo" or name == "cni0" or name.startswith("veth") for _, name in socket.if_nameindex())


def example_for_the_node(name: str = PIPE) -> str:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    for stage in doc["spec"]["deployment"]["stages"].values():
        stage["resources"] = {"requests": dict(SMALL_REQUESTS)}
    doc["spec"]["deployment"]["orchestrator"]["resources"] = {"requests": dict(SMALL_REQUESTS)}
    return yaml.safe_dump(doc)


def generate(endpoint: str, prompt: str = "Hello there") -> GenerateResult:
    with OmniClient(endpoint) as client:
        return client.generate(prompt, timeout=60, **REQUEST)


def apply_to_first_answer(c: Cluster, namespace: str, name: str = PIPE) -> tuple[GenerateResult, dict[str, float]]:
    """Apply the example, then ask through the Service until it answers. Returns the answer and the times
    from the apply to Ready and to the first answer."""
    t0 = time.monotonic()
    c.kubectl("apply", "-n", namespace, "-f", "-", input=example_for_the_node(name))
    c.wait_condition(namespace, name, "Ready", "True", READY_TIMEOUT)
    ready = time.monotonic() - t0
    endpoint = c.service_endpoint(namespace, name)

    def answer() -> GenerateResult | None:
        try:
            return generate(endpoint)
        except grpc.RpcError as e:   # kube-proxy's rules for a new Service come a moment after Ready
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return None
    result = wait_for(answer, 60, f"a first answer from {endpoint}", interval=0.5)
    return result, {"apply_to_ready_s": ready, "apply_to_first_answer_s": time.monotonic() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the timings here")
    ap.add_argument("--run", type=Path, default=REPO / "e2e" / ".run" / "first-answer")
    ap.add_argument("--reimport", action="store_true",
                    help="import the image into containerd again (removed first), to time it")
    args = ap.parse_args()
    if not private_network():
        print("run it through e2e/cluster/in-netns.sh", file=sys.stderr)
        return 2
    if args.reimport:
        os.environ["NODE_REIMPORT"] = "1"
    c = Cluster(args.run, node="real")
    namespace = "omnistage-first-answer"
    try:
        c.up()
        c.grant_operator_rbac()
        c.namespace(namespace)
        c.start_operator([namespace])
        result, times = apply_to_first_answer(c, namespace)
        out = {**times, **{k: v for k, v in c.timings.items()}, "text_chars": len(result.text)}
        print(json.dumps(out, indent=1))
        if args.json:
            args.json.write_text(json.dumps(out))
        return 0
    finally:
        c.stop_operator()
        c.down()


if __name__ == "__main__":
    sys.exit(main())
