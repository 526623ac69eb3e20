"""The e2e node agent: a stand-in for a kubelet (see e2e/README.md for what it does and does not do).
It registers one Node, keeps its status and Lease fresh, and runs every pod bound to it as a local
process on its own loopback IP (pod.py). `--simulate` marks pods Running and Ready without running
anything, as kwok does, for control-plane benchmarks with many pods.

usage: python -m e2e.node.agent --kubeconfig FILE --run-dir DIR [--node NAME] [--python PATH] [--simulate]
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from kubernetes import client, config, watch

from .pod import PodWorker, ensure_mountpoint
from .podspec import PodSpecError

log = logging.getLogger("e2e.node")
REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_SECONDS = 10


class PodIPs:
    """Pod IPs from 127.0.1.2 up: all of 127.0.0.0/8 reaches loopback, so each pod binds its own."""

    def __init__(self, first: str = "127.0.1.2", last: str = "127.0.254.254"):
        self.first, self.last = int(ipaddress.IPv4Address(first)), int(ipaddress.IPv4Address(last))
        self.next = self.first
        self.used: set[int] = set()
        self.lock = threading.Lock()

    def allocate(self) -> str:
        with self.lock:   # round robin: an address freed just now is not handed out again soon
            for _ in range(self.last - self.first + 1):
                ip, self.next = self.next, self.next + 1 if self.next < self.last else self.first
                if ip not in self.used and ip % 256 not in (0, 255):
                    self.used.add(ip)
                    return str(ipaddress.IPv4Address(ip))
        raise RuntimeError("no pod IP left")

    def release(self, ip: str) -> None:
        with self.lock:
            self.used.discard(int(ipaddress.IPv4Address(ip)))


class Agent:
    def __init__(self, node: str, run_dir: Path, python: str, simulate: bool, extra_env: dict[str, str] | None = None):
        self.node, self.run_dir, self.python, self.simulate = node, run_dir, python, simulate
        self.extra_env = dict(extra_env or {})
        self.core = client.CoreV1Api()
        self.coord = client.CoordinationV1Api()
        host = client.Configuration.get_default_copy().host   # https://127.0.0.1:6443
        self.apiserver_host, _, port = host.split("://", 1)[1].partition(":")
        self.apiserver_port = int(port or 443)
        self.ips = PodIPs()
        self.workers: dict[str, PodWorker] = {}
        self.created_mountpoints: list[str] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.exposed = self._hidden_interpreter_dirs()
        # The host as it is, seen from inside a pod's mount namespace before its volumes are mounted, and
        # what plays the pod's image here: this checkout (code and virtual environment).
        self.host_view = f"/run/omnistage-node-{os.getpid()}"
        venv = Path(python).absolute().parent.parent
        self.image_dirs = [str(REPO)] + ([] if venv.is_relative_to(REPO) else [str(venv)])

    def _hidden_interpreter_dirs(self) -> list[tuple[str, str, str]]:
        """(folder others may not enter, its child holding the interpreter, a staging mount point)."""
        real = Path(os.path.realpath(self.python))
        out = []
        for parent in reversed(real.parents):
            if parent != Path("/") and not os.stat(parent).st_mode & 0o001:
                child = real.relative_to(parent).parts[0]
                staging = self.run_dir / "expose" / str(len(out))
                staging.mkdir(parents=True, exist_ok=True)
                out.append((str(parent), str(parent / child), str(staging)))
                break
        return out

    # ------------------------------------------------------------------------------ node

    def node_status(self) -> dict:
        t = _now()
        conds = [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "e2e node agent",
                  "lastHeartbeatTime": t, "lastTransitionTime": t}]
        conds += [{"type": c, "status": "False", "reason": f"KubeletHasNo{c}", "lastHeartbeatTime": t,
                   "lastTransitionTime": t} for c in ("MemoryPressure", "DiskPressure", "PIDPressure")]
        # Large on purpose: nothing is isolated here, so requests must never keep a pod from scheduling.
        capacity = {"cpu": "1000", "memory": "4Ti", "pods": "1000", "ephemeral-storage": "10Ti"}
        return {"conditions": conds, "capacity": capacity, "allocatable": capacity,
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                              {"type": "Hostname", "address": self.node}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
                "nodeInfo": {"kubeletVersion": "v1.20.2", "kubeProxyVersion": "v1.20.2",
                             "containerRuntimeVersion": "e2e-agent://1", "architecture": "amd64",
                             "operatingSystem": "linux", "osImage": "omnistage e2e node agent", "kernelVersion": "",
                             "machineID": "", "systemUUID": "", "bootID": ""}}

    def register(self) -> None:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node, "labels": {
            "kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "omnistage.io/e2e-node": "true"}}}
        try:
            self.core.create_node(body)
        except client.ApiException as e:
            if e.status != 409:
                raise
        self.core.patch_node_status(self.node, {"status": self.node_status()})

    def heartbeat(self) -> None:
        while not self.stopping.wait(HEARTBEAT_SECONDS):
            try:
                self.core.patch_node_status(self.node, {"status": self.node_status()})
                self._renew_lease()
            except Exception as e:   # noqa: BLE001 - keep beating
                log.warning("heartbeat: %s", e)

    def _renew_lease(self) -> None:
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": 40,
                "renewTime": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        try:
            self.coord.patch_namespaced_lease(self.node, "kube-node-lease", {"spec": spec})
        except client.ApiException as e:
            if e.status != 404:
                raise
            self.coord.create_namespaced_lease("kube-node-lease", {"metadata": {"name": self.node}, "spec": spec})

    # -------------------------------------------------------------------------- services

    def lookup(self, kind: str, namespace: str, name: str) -> dict | None:
        read = {"ConfigMap": self.core.read_namespaced_config_map, "Secret": self.core.read_namespaced_secret,
                "PersistentVolumeClaim": self.core.read_namespaced_persistent_volume_claim}
        try:
            if kind == "PersistentVolume":
                obj = self.core.read_persistent_volume(name)
            else:
                obj = read[kind](name, namespace)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        return client.ApiClient().sanitize_for_serialization(obj)

    def mountpoint(self, path: str, file: bool = False) -> None:
        with self.lock:
            self.created_mountpoints += ensure_mountpoint(path, file)

    def patch_pod_status(self, namespace: str, name: str, status: dict) -> None:
        try:
            self.core.patch_namespaced_pod_status(name, namespace, {"status": status})
        except client.ApiException as e:
            if e.status != 404:
                log.warning("pod %s/%s status: %s", namespace, name, e.reason)

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0,
                                            body=client.V1DeleteOptions(grace_period_seconds=0,
                                                                        preconditions={"uid": uid}))
        except client.ApiException as e:
            if e.status not in (404, 409):
                log.warning("pod %s/%s delete: %s", namespace, name, e.reason)

    # ------------------------------------------------------------------------------ pods

    def sync(self, kind: str, pod: dict) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        with self.lock:
            worker = self.workers.get(uid)
        if kind == "DELETED":
            if worker:
                worker.kill_now()
            return
        if meta.get("deletionTimestamp"):
            grace = float(meta.get("deletionGracePeriodSeconds") or 0)
            if worker:
                worker.request_termination(grace)
            else:
                self.delete_pod(meta["namespace"], meta["name"], uid)
            return
        if worker or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return
        try:
            worker = PodWorker(self, pod)
        except PodSpecError as e:
            log.error("pod %s/%s refused: %s", meta["namespace"], meta["name"], e)
            self.patch_pod_status(meta["namespace"], meta["name"], {"phase": "Failed", "reason": "Unsupported",
                                                                    "message": str(e)})
            return
        with self.lock:
            self.workers[uid] = worker
        worker.start()

    def reap(self) -> None:
        with self.lock:
            for uid in [u for u, w in self.workers.items() if w.finished.is_set()]:
                del self.workers[uid]

    def watch_pods(self) -> None:
        selector = f"spec.nodeName={self.node}"
        while not self.stopping.is_set():
            try:
                listed = self.core.list_pod_for_all_namespaces(field_selector=selector)
                seen = set()
                for p in listed.items:
                    pod = client.ApiClient().sanitize_for_serialization(p)
                    seen.add(pod["metadata"]["uid"])
                    self.sync("LISTED", pod)
                with self.lock:
                    vanished = [w for u, w in self.workers.items() if u not in seen]
                for w in vanished:
                    w.kill_now()
                stream = watch.Watch().stream(self.core.list_pod_for_all_namespaces, field_selector=selector,
                                              resource_version=listed.metadata.resource_version,
                                              timeout_seconds=120, _request_timeout=150)
                for ev in stream:
                    if self.stopping.is_set():
                        return
                    self.sync(ev["type"], client.ApiClient().sanitize_for_serialization(ev["object"]))
                    self.reap()
            except Exception as e:   # noqa: BLE001 - re-list and carry on, as a kubelet would
                if not self.stopping.is_set():
                    log.warning("pod watch: %s; listing again", e)
                    time.sleep(1)

    def shutdown(self) -> None:
        """Stop every pod process (SIGTERM, short grace) and remove the mount points we created."""
        self.stopping.set()
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.request_termination(0)
            w.kill_now()
        for w in workers:
            w.finished.wait(15)
        for path in reversed(self.created_mountpoints):
            try:
                os.rmdir(path) if os.path.isdir(path) else os.unlink(path)
            except OSError:
                pass


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m e2e.node.agent", description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--node", default="e2e-node")
    p.add_argument("--python", default=sys.executable, help="what a container's `python` runs")
    p.add_argument("--simulate", action="store_true", help="mark pods Running and Ready without running them")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="added to every container's environment (as a runtime's defaults; the pod's env wins)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config.load_kube_config(args.kubeconfig)
    extra = dict(e.split("=", 1) for e in args.env)
    agent = Agent(args.node, args.run_dir, args.python, args.simulate, extra)
    agent.register()
    threading.Thread(target=agent.heartbeat, daemon=True, name="heartbeat").start()
    done = threading.Event()

    def on_signal(*_):
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=agent.watch_pods, daemon=True, name="pods").start()
    log.info("node %s registered (%s)", args.node,
             "simulated pods" if args.simulate else f"pods run with {args.python}")
    done.wait()
    agent.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
