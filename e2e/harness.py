"""The e2e cluster as one object: build or reuse the v1.20.2 binaries, start the control plane and a node,
install the CRD, run the operator (as a local process with its own identity, bound to the chart's
ClusterRole), and poll for conditions. Used by e2e/conftest.py, e2e/real/conftest.py and
bench/operator_reconcile.py. Everything it starts is recorded by PID in the run folder and stopped by
e2e/cluster/down.sh (and node-down.sh).

Two kinds of node:
  agent  e2e/node/agent.py: pods' commands run as processes from this checkout, on loopback pod IPs (fast,
         hundreds of pods; what the control-plane scenarios and the reconcile benchmark need);
  real   a kubelet, containerd and runc running the project image (`make image`), pods on a CNI bridge and
         Services through kube-proxy, inside a private network namespace (e2e/cluster/in-netns.sh)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterator

import kubernetes
import yaml

from omnistage.contract.launch import GRPC_PORT

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "e2e" / "cluster"
CACHE = Path(os.environ.get("OMNISTAGE_CACHE", Path.home() / ".cache" / "omnistage"))
BIN = Path(os.environ.get("OMNISTAGE_K8S_BIN", CACHE / "k8s-1.20.2" / "bin"))
PYTHON = str(REPO / ".venv" / "bin" / "python")
OPERATOR_USER = "omnistage-operator"
OPERATOR_METRICS_PORT = 9464   # the local operator's Prometheus metrics (the stage planner's decisions)
PIPELINE_CA = "omnistage-pipeline-ca"  # the CA Secret of the pipelines' mTLS (the chart's is <release>-pipeline-ca)
E2E_WEBHOOK_ROLE = "omnistage-e2e-webhook-config"
REAL_NODE_IP = "10.88.0.1"     # node-up.sh's pod bridge address, inside the run's private network namespace


class Timeout(AssertionError):
    pass


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` and the last value seen."""
    end = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise
            last = f"404 {e.reason}"
        if last:
            return last
        if time.monotonic() > end:
            raise Timeout(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


@contextlib.contextmanager
def running(c: "Cluster", namespace: str) -> Iterator["Cluster"]:
    """A session's cluster: up, the operator's RBAC granted, `namespace` made; always taken down after."""
    try:
        c.up()
        c.grant_operator_rbac()
        c.namespace(namespace)
        yield c
    finally:
        c.stop_operator()
        c.down()


def outside(cmd: list[str]) -> tuple[list[str], dict]:
    """`cmd` (and subprocess.run's keywords) to run in the machine's own network namespace: a build that needs
    the network (PyPI, the Debian archive) started from inside e2e/cluster/in-netns.sh's private one."""
    fd = os.environ.get("OMNISTAGE_OUTER_NETNS_FD")
    if not fd:
        return cmd, {}
    return ["nsenter", f"--net=/proc/self/fd/{fd}", *cmd], {"pass_fds": (int(fd),)}


def project_image(log: Path) -> tuple[str, Path]:
    """`make image` (scripts/build_image.sh; every layer and the archive reused when nothing changed): the
    image's reference and its OCI archive."""
    with open(log, "ab") as out:
        cmd, kw = outside([str(REPO / "scripts" / "build_image.sh")])
        r = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, **kw)
    if r.returncode != 0:
        raise AssertionError(f"make image failed ({r.returncode}); see {log}")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return f"localhost/omnistage/omnistage:{version}", CACHE / "image" / f"omnistage-{version}-cpu.tar"


class Cluster:
    def __init__(self, run_dir: Path, simulate: bool = False, agent_env: dict[str, str] | None = None,
                 node: str = "agent"):
        if node not in ("agent", "real"):
            raise ValueError(f"node must be agent or real, not {node!r}")
        self.run = Path(run_dir)
        self.node = node
        self.image = ""               # the project image a real node runs (set by up())
        self.simulate = simulate
        self.agent_env = agent_env or {}
        self.admin_kubeconfig = self.run / "admin.kubeconfig"
        self.operator_kubeconfig = self.run / "operator.kubeconfig"
        self.api: kubernetes.client.ApiClient | None = None
        self.helm_bin: str | None = None

    # --------------------------------------------------------------------------- lifecycle

    def up(self) -> "Cluster":
        t0 = time.monotonic()
        if self.node == "real":
            self._hold_node_lock()
        cmd, kw = outside([str(CLUSTER / "build.sh"), str(BIN)])
        subprocess.run(cmd, check=True, **kw)
        self.timings = {"build_s": time.monotonic() - t0}
        self.down()                    # leftovers of an interrupted run in the same folder
        for leftover in ("etcd", "pods", "kubelet", "containerd", "log/pods"):
            shutil.rmtree(self.run / leftover, ignore_errors=True)
        (self.run / "log").mkdir(parents=True, exist_ok=True)
        archive = None
        if self.node == "real":
            t = time.monotonic()
            self.image, archive = project_image(self.run / "log" / "image.log")
            self.timings["image_build_s"] = time.monotonic() - t
            self.timings["image_bytes"] = archive.stat().st_size
        t1 = time.monotonic()
        # A real node: pods reach the API (the `kubernetes` Service) at the node's bridge address, and the
        # apiserver reaches the kubelet (logs, exec) at the node's InternalIP (there is no cluster DNS).
        env = {**os.environ, "KUBELET_ADDRESS_TYPES": "InternalIP,Hostname", "APISERVER_BIND": "0.0.0.0",
               "APISERVER_ADVERTISE": REAL_NODE_IP} if self.node == "real" else None
        subprocess.run([str(CLUSTER / "up.sh"), str(BIN), str(self.run)], check=True, env=env)
        self.api = kubernetes.config.new_client_from_config(str(self.admin_kubeconfig))
        if self.node == "real":
            t = time.monotonic()
            out = subprocess.run([str(CLUSTER / "node-up.sh"), str(BIN), str(self.run), str(archive)],
                                 check=True, capture_output=True, text=True).stdout
            print(out, end="")
            self.timings["node_up_s"] = time.monotonic() - t
            self.timings["image_import_s"] = sum(float(w[:-1]) for line in out.splitlines()
                                                 if line.startswith("[node] imported") for w in line.split()[-1:])
        else:
            self._start_node_agent()
        wait_for(self._node_ready, 120, "the e2e node to be Ready")
        wait_for(lambda: self._default_service_account(), 60, "the default ServiceAccount token")
        self.kubectl("apply", "-f", str(REPO / "crds" / "omnipipelines.yaml"))
        self.kubectl("wait", "--for=condition=established", "crd/omnipipelines.omnistage.io", "--timeout=60s")
        shutil.rmtree(self.run / "kubectl-cache", ignore_errors=True)   # discovery from before the CRD
        self.timings["up_s"] = time.monotonic() - t1
        return self

    def down(self) -> None:
        if self.node == "real":
            subprocess.run([str(CLUSTER / "node-down.sh"), str(BIN), str(self.run)], check=False)
        subprocess.run([str(CLUSTER / "down.sh"), str(self.run)], check=False)

    def _hold_node_lock(self) -> None:
        """One real node per machine: it shares the cgroup parent, containerd's store and the kubelet's log
        folders with any other. Held until this process exits."""
        if getattr(self, "_node_lock", None) is not None:
            return
        CACHE.mkdir(parents=True, exist_ok=True)
        f = open(CACHE / "real-node.lock", "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise AssertionError(f"another real e2e node runs on this machine ({CACHE / 'real-node.lock'} is held): "
                                 "one at a time (they share cgroups and containerd's store)") from None
        self._node_lock = f

    def _start_node_agent(self) -> None:
        cmd = [PYTHON, "-m", "e2e.node.agent", "--kubeconfig", str(self.admin_kubeconfig),
               "--run-dir", str(self.run), "--python", PYTHON]
        if self.simulate:
            cmd.append("--simulate")
        for key, value in self.agent_env.items():
            cmd += ["--env", f"{key}={value}"]
        self._spawn("node-agent", cmd)

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.run / "log" / f"{name}.log", "ab")
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
        (self.run / f"{name}.pid").write_text(str(proc.pid))
        return proc

    def _node_ready(self) -> bool:
        for n in self.core.list_node().items:
            if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or ()):
                return True
        return False

    def _default_service_account(self) -> bool:
        sa = self.core.read_namespaced_service_account("default", "default")
        return bool(sa.secrets)

    # ------------------------------------------------------------------------------ clients

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api)

    @property
    def apps(self) -> kubernetes.client.AppsV1Api:
        return kubernetes.client.AppsV1Api(self.api)

    @property
    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.api)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        # A discovery cache per run: kubectl's shared one (~/.kube/cache, keyed by host:port) may hold
        # another cluster's API list, and kubectl 1.20 does not refresh it on an unknown short name.
        r = subprocess.run([str(BIN / "kubectl"), f"--kubeconfig={self.admin_kubeconfig}",
                            f"--cache-dir={self.run / 'kubectl-cache'}", *args],
                           input=input, capture_output=True, text=True)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        if self.helm_bin is None:
            out = subprocess.run([str(CLUSTER / "get-helm.sh")], capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHON": PYTHON})
            self.helm_bin = out.stdout.strip().splitlines()[-1]
        r = subprocess.run([self.helm_bin, f"--kubeconfig={self.admin_kubeconfig}", *args],
                           capture_output=True, text=True)
        if check and r.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def namespace(self, name: str) -> str:
        self.kubectl("create", "namespace", name, check=False)
        wait_for(lambda: self.core.read_namespaced_service_account("default", name).secrets, 60,
                 f"the default ServiceAccount in {name}")
        return name

    # ----------------------------------------------------------------------------- operator

    def grant_operator_rbac(self) -> None:
        """Bind the operator's identity to the chart's own ClusterRole (so a missing verb fails the
        e2e), plus what only a locally run operator needs: writing its webhook configuration."""
        rendered = self.helm("template", "omnistage", str(REPO / "charts" / "omnistage"),
                             "--show-only", "templates/rbac.yaml", "--set", "clusterWide=true").stdout
        docs = [d for d in yaml.safe_load_all(rendered) if d]
        role = next(d for d in docs if d["kind"] == "ClusterRole")
        role["metadata"]["name"] = OPERATOR_USER
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": OPERATOR_USER},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": OPERATOR_USER},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": OPERATOR_USER}]}
        webhook_role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                        "metadata": {"name": E2E_WEBHOOK_ROLE},
                        "rules": [{"apiGroups": ["admissionregistration.k8s.io"],
                                   "resources": ["validatingwebhookconfigurations", "mutatingwebhookconfigurations"],
                                   "verbs": ["get", "list", "watch", "create", "patch", "delete"]}]}
        webhook_binding = {**binding, "metadata": {"name": E2E_WEBHOOK_ROLE},
                           "roleRef": {**binding["roleRef"], "name": E2E_WEBHOOK_ROLE}}
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role, binding, webhook_role, webhook_binding]))

    def pipeline_ca(self, namespace: str, name: str = PIPELINE_CA) -> str:
        """The CA Secret the operator signs the pipelines' mTLS leaves with (as the chart keeps one), made once;
        returns NAMESPACE/NAME as OMNISTAGE_TLS_CA_SECRET takes it."""
        from omnistage import tls  # the operator's own issuing code reads it

        try:
            self.core.read_namespaced_secret(name, namespace)
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise
            cert, key = tls.new_ca("omnistage e2e pipeline CA")
            self.core.create_namespaced_secret(namespace, kubernetes.client.V1Secret(
                metadata=kubernetes.client.V1ObjectMeta(name=name), type="kubernetes.io/tls",
                string_data={"tls.crt": cert.decode(), "tls.key": key.decode()}))
        return f"{namespace}/{name}"

    def start_operator(self, namespaces: list[str], webhook: str = "managed", tls: bool = True,
                       **env: str) -> subprocess.Popen:
        """`kopf run` of omnistage_operator as user omnistage-operator; waits for its webhook when managed.
        `tls`: the pipelines' processes talk mutual TLS, with leaves the operator issues from pipeline_ca."""
        self.delete_webhook_configurations()  # a killed operator leaves a failurePolicy=Fail webhook behind
        if tls:
            env = {"OMNISTAGE_TLS_ISSUER": "chart", "OMNISTAGE_TLS_CA_SECRET": self.pipeline_ca(namespaces[0]), **env}
        if self.node == "real":
            env = {"OMNISTAGE_IMAGE": self.image, **env}
        settings = {"KUBECONFIG": str(self.operator_kubeconfig), "OMNISTAGE_WEBHOOK": webhook,
                    "OMNISTAGE_MODEL_VOLUME": f"hostPath:{REPO / 'models'}", "OMNISTAGE_RESYNC_SECONDS": "60",
                    "OMNISTAGE_WEBHOOK_CERT": str(self.run / "pki" / "webhook.crt"),
                    "OMNISTAGE_WEBHOOK_KEY": str(self.run / "pki" / "webhook.key"),
                    "OMNISTAGE_WEBHOOK_ADDR": "127.0.0.1", "OMNISTAGE_WEBHOOK_PORT": "9443",
                    "OMNISTAGE_METRICS_ADDR": "127.0.0.1", "OMNISTAGE_METRICS_PORT": str(OPERATOR_METRICS_PORT), **env}
        cmd = [PYTHON, "-m", "kopf", "run", "-m", "omnistage_operator.handlers",
               *[f"--namespace={ns}" for ns in namespaces]]
        proc = self._spawn("operator", cmd, settings)
        if webhook == "managed":
            wait_for(lambda: self._webhook_registered(), 60, "the operator's webhook configuration")
        return proc

    def stop_operator(self) -> None:
        pid_file = self.run / "operator.pid"
        if not pid_file.exists():
            return
        pid = int(pid_file.read_text())
        try:
            os.kill(pid, 15)
            wait_for(lambda: not _alive(pid), 30, f"the operator (pid {pid}) to exit")
        except ProcessLookupError:
            pass
        pid_file.unlink()

    def _webhook_registered(self) -> bool:
        api = kubernetes.client.AdmissionregistrationV1Api(self.api)
        # A cleanly stopped kopf empties its configuration rather than deleting it.
        return any(w.metadata.name == "omnipipelines.omnistage.io" and w.webhooks
                   for w in api.list_validating_webhook_configuration().items)

    def delete_webhook_configurations(self, name: str = "omnipipelines.omnistage.io") -> None:
        api = kubernetes.client.AdmissionregistrationV1Api(self.api)
        for delete in (api.delete_validating_webhook_configuration, api.delete_mutating_webhook_configuration):
            try:
                delete(name)
            except kubernetes.client.ApiException as e:
                if e.status != 404:
                    raise

    def delete_pipeline(self, namespace: str, name: str, what: str, timeout: float = 120) -> None:
        """Delete a pipeline and wait until none of its pods is left (`what`: what the wait says it waited for)."""
        self.kubectl("delete", "omnip", "-n", namespace, name, "--ignore-not-found", "--wait=true")
        wait_for(lambda: not self.core.list_namespaced_pod(
            namespace, label_selector=f"omnistage.io/pipeline={name}").items, timeout, what)

    # ------------------------------------------------------------------------ observations

    def pipeline(self, namespace: str, name: str) -> dict:
        return self.custom.get_namespaced_custom_object("omnistage.io", "v1alpha1", namespace, "omnipipelines", name)

    def condition(self, namespace: str, name: str, type_: str) -> dict:
        conds = (self.pipeline(namespace, name).get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == type_), {})

    def wait_condition(self, namespace: str, name: str, type_: str, status: str, timeout: float,
                       reason: str | None = None) -> dict:
        def check():
            c = self.condition(namespace, name, type_)
            ok = c.get("status") == status and (reason is None or c.get("reason") == reason)
            return c if ok else None
        return wait_for(check, timeout, f"{namespace}/{name} {type_}={status}" + (f" ({reason})" if reason else ""))

    def service_endpoint(self, namespace: str, pipeline: str, port: int = GRPC_PORT) -> str:
        """The orchestrator Service's virtual IP (a real node: kube-proxy routes it to a ready pod)."""
        svc = self.core.read_namespaced_service(f"{pipeline}-orchestrator", namespace)
        return f"{svc.spec.cluster_ip}:{port}"

    def orchestrator_endpoint(self, namespace: str, pipeline: str) -> str:
        """The orchestrator pod's own IP (the agent node has no kube-proxy for the Service's virtual IP)."""
        pods = self.core.list_namespaced_pod(namespace, label_selector=(
            f"omnistage.io/pipeline={pipeline},omnistage.io/component=orchestrator")).items
        ready = [p for p in pods if p.status.pod_ip and not p.metadata.deletion_timestamp and
                 any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or ())]
        assert ready, f"no ready orchestrator pod for {namespace}/{pipeline}"
        return f"{ready[0].status.pod_ip}:{GRPC_PORT}"

    def audit_writes(self, user: str, since: float) -> list[dict]:
        """Write requests (create/update/patch/delete) `user` made after `since` (epoch seconds)."""
        out = []
        path = self.run / "log" / "audit.log"
        with open(path) as f:
            for line in f:
                ev = json.loads(line)
                if ev.get("user", {}).get("username") != user:
                    continue
                t = _epoch(ev.get("requestReceivedTimestamp", ""))
                if t >= since:
                    out.append(ev)
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of ours counts as gone
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def _epoch(ts: str) -> float:
    from datetime import datetime
    if not ts:
        return 0.0
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


if __name__ == "__main__":   # python -m e2e.harness up|down RUN_DIR: a cluster to poke at by hand
    action, run = sys.argv[1], Path(sys.argv[2] if len(sys.argv) > 2 else REPO / "e2e" / ".run" / "manual")
    c = Cluster(run)
    if action == "up":
        c.up()
        print(f"export KUBECONFIG={c.admin_kubeconfig}; kubectl is {BIN / 'kubectl'}")
    else:
        c.down()
