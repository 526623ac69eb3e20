"""One pod on the e2e node, run as a kubelet would run it, minus images and cgroups: its container's
command becomes a local process in a private mount namespace (volumes bind-mounted at their
mountPaths, root read-only when asked, the pod's uid/gid, no new privileges), bound to the pod's own
loopback IP. Status follows the process and the pod's own readiness probe; an exited container's
termination message is read as the kubelet reads it (terminationMessagePath, then the log tail under
FallbackToLogsOnError); deletion runs the preStop hook, then SIGTERM, then SIGKILL when the grace
period is over."""

from __future__ import annotations

import datetime
import logging
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .podspec import PodSpecError, command_line, container_env, kubernetes_service_env, named_port
from .volumes import materialize

if TYPE_CHECKING:   # pragma: no cover
    from .agent import Agent

log = logging.getLogger("e2e.node")
BACKOFF_START, BACKOFF_MAX = 10.0, 300.0   # the kubelet's crash-loop back-off
# The kubelet's bounds on a termination message (pkg/kubelet/container): the end of the file the
# container wrote, else (FallbackToLogsOnError, non-zero exit) the end of its last log lines.
MAX_TERMINATION_MESSAGE_BYTES = 4096
MAX_TERMINATION_LOG_BYTES, MAX_TERMINATION_LOG_LINES = 2048, 80


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Probe:
    """A readiness or liveness probe with the kubelet's defaults and thresholds."""
    spec: dict
    successes: int = 0
    failures: int = 0
    due: float = 0.0

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    @property
    def timeout(self) -> float:
        return float(self.spec.get("timeoutSeconds", 1))

    def record(self, ok: bool) -> None:
        self.successes, self.failures = (self.successes + 1, 0) if ok else (0, self.failures + 1)


class PodWorker(threading.Thread):
    def __init__(self, agent: "Agent", pod: dict):
        super().__init__(name=f"pod-{pod['metadata']['name']}", daemon=True)
        self.agent = agent
        self.pod = pod
        self.ns, self.name, self.uid = (pod["metadata"][k] for k in ("namespace", "name", "uid"))
        self.dir = agent.run_dir / "pods" / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.ip = agent.ips.allocate()
        self.pod.setdefault("status", {})["podIP"] = self.ip
        self.pod["status"]["hostIP"] = "127.0.0.1"
        self.container = self._the_container()
        self.proc: subprocess.Popen | None = None
        self.started_at = ""
        self.termination_file: Path | None = None   # host side of terminationMessagePath, this run's
        self.log_from = 0                            # where this run's output starts in the log
        self.restarts = 0
        self.last_state: dict = {}
        self.ready = False
        self.terminate_grace: float | None = None
        self.killed = threading.Event()       # the pod is gone from the API: stop at once
        self.wake = threading.Event()
        self.finished = threading.Event()

    # -------------------------------------------------------------------------- requests

    def request_termination(self, grace: float) -> None:
        if self.terminate_grace is None:
            self.terminate_grace = grace
            self.wake.set()

    def kill_now(self) -> None:
        self.killed.set()
        self.wake.set()

    # ------------------------------------------------------------------------------ life

    def run(self) -> None:
        try:
            self._live()
        except Exception:
            log.exception("pod %s/%s: agent error", self.ns, self.name)
        finally:   # a forced deletion still gets SIGTERM and the kubelet's 2 s minimum
            self._stop_process(2.0)
            self.agent.ips.release(self.ip)
            self.finished.set()

    def _live(self) -> None:
        if self.agent.simulate:
            self._status("Running", ready=True, state={"running": {"startedAt": now()}})
            self._wait_for_termination_request()
            self._delete_from_api()
            return
        backoff, next_start = BACKOFF_START, 0.0
        readiness = Probe(self.container["readinessProbe"]) if self.container.get("readinessProbe") else None
        liveness = Probe(self.container["livenessProbe"]) if self.container.get("livenessProbe") else None
        while True:
            if self.killed.is_set():
                return
            if self.terminate_grace is not None:
                self._terminate(self.terminate_grace)
                self._delete_from_api()
                return
            if self.proc is None and time.monotonic() >= next_start:
                if not self._start(readiness, liveness):
                    next_start = time.monotonic() + 2   # waiting on a ConfigMap, Secret or claim
            elif self.proc is not None and self.proc.poll() is not None:
                self._exited(self.proc.returncode)
                next_start = time.monotonic() + backoff
                backoff = min(backoff * 2, BACKOFF_MAX)
                self._status("Running", ready=False,
                             state={"waiting": {"reason": "CrashLoopBackOff",
                                                "message": f"back-off {backoff / 2:.0f}s restarting failed container"}})
            elif self.proc is not None:
                self._probe(readiness, liveness)
                if self.started_at and time.monotonic() - self._started_mono > 600:
                    backoff = BACKOFF_START
            self.wake.wait(0.5)
            self.wake.clear()

    def _wait_for_termination_request(self) -> None:
        while self.terminate_grace is None and not self.killed.is_set():
            self.wake.wait(1)
            self.wake.clear()

    # --------------------------------------------------------------------------- starting

    def _start(self, readiness: Probe | None, liveness: Probe | None) -> bool:
        try:
            env = container_env(self.pod, self.container, self.agent.lookup, self._base_env())
            argv = command_line(self.container, env, self.agent.python)
            mounts = self._mounts() + self._termination_mount()
            launcher = self._launcher(sorted(mounts, key=lambda m: m[1].count("/")), argv)
        except PodSpecError as e:
            self._status("Pending", ready=False, state={"waiting": {"reason": "CreateContainerConfigError",
                                                                   "message": str(e)}})
            log.warning("pod %s/%s cannot start: %s", self.ns, self.name, e)
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        out = open(self.dir / f"{self.container['name']}.log", "ab")
        out.write(f"--- {now()} start: {shlex.join(argv)}\n".encode())
        out.flush()
        self.log_from = out.tell()
        self.proc = subprocess.Popen(launcher, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=self.container.get("workingDir") or "/", start_new_session=True)
        out.close()
        self.started_at, self._started_mono = now(), time.monotonic()
        for probe in (readiness, liveness):
            if probe:
                probe.successes = probe.failures = 0
                probe.due = time.monotonic() + float(probe.spec.get("initialDelaySeconds", 0))
        self.ready = readiness is None
        self._status("Running", ready=self.ready, state={"running": {"startedAt": self.started_at}})
        log.info("pod %s/%s started on %s (pid %d)", self.ns, self.name, self.ip, self.proc.pid)
        return True

    def _base_env(self) -> dict[str, str]:
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOSTNAME": self.name}
        env.update(kubernetes_service_env(self.agent.apiserver_host, self.agent.apiserver_port))
        env.update(self.agent.extra_env)
        return env

    def _mounts(self) -> list[tuple[str, str, bool]]:
        """(host source, mountPath, read-only) for every volume mount, parents before children."""
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes") or ()}
        out = []
        for m in self.container.get("volumeMounts") or ():
            if m.get("subPath") or m.get("subPathExpr"):
                raise PodSpecError(f"volumeMount {m['name']!r}: subPath is not supported by the e2e node agent")
            if m["name"] not in volumes:
                raise PodSpecError(f"volumeMount {m['name']!r}: no such volume")
            source = materialize(self.pod, volumes[m["name"]], self.dir, self.agent.lookup)
            out.append((source, m["mountPath"], bool(m.get("readOnly"))))
        return out

    def _termination_mount(self) -> list[tuple[str, str, bool]]:
        """As the kubelet: a fresh empty file per container run, writable by any pod user, mounted at
        terminationMessagePath (the apiserver defaults it to /dev/termination-log)."""
        path = self.container.get("terminationMessagePath")
        if not path:
            self.termination_file = None
            return []
        self.dir.mkdir(parents=True, exist_ok=True)
        self.termination_file = self.dir / f"{self.container['name']}.termination-log.{self.restarts}"
        self.termination_file.write_bytes(b"")
        os.chmod(self.termination_file, 0o666)
        return [(str(self.termination_file), path, False)]

    def _launcher(self, mounts: list[tuple[str, str, bool]], argv: list[str]) -> list[str]:
        pod_sc = self.pod["spec"].get("securityContext") or {}
        sc = {**pod_sc, **(self.container.get("securityContext") or {})}
        uid, gid = sc.get("runAsUser"), sc.get("runAsGroup", sc.get("runAsUser"))
        if sc.get("runAsNonRoot") and (uid is None or uid == 0):
            raise PodSpecError("runAsNonRoot is set but runAsUser is not a non-root uid (no image user here)")
        lines = ["set -e"]
        for hidden, child, staging in self.agent.exposed:
            # The interpreter lives below a folder only root may enter (e.g. /root/.pyenv): show the pod
            # that one child on a fresh tmpfs, as an image would have it, and nothing else of the folder.
            lines += [f"mount --bind {shlex.quote(child)} {shlex.quote(staging)}",
                      f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(hidden)}",
                      f"mkdir -p {shlex.quote(child)}",
                      f"mount --bind {shlex.quote(staging)} {shlex.quote(child)}"]
        # Volume sources (and this checkout, the pod's "image") may lie below another volume's mountPath:
        # a checkout under /tmp is hidden once the pod's own /tmp is mounted. A kubelet never meets this
        # (images and volumes are separate file systems), so bind from a view of the host taken before
        # any volume is mounted, and show the image again where a volume covers it.
        host = self.agent.host_view
        self.agent.mountpoint(host)
        lines.append(f"mount --rbind / {shlex.quote(host)}")
        for source, target, read_only in mounts:
            self.agent.mountpoint(target, file=os.path.isfile(source))
            lines.append(f"mount --bind {shlex.quote(host + source)} {shlex.quote(target)}")
            if read_only:
                lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        for path in self.agent.image_dirs:
            if any(path == t or path.startswith(t.rstrip("/") + "/") for _, t, _ in mounts):
                lines += [f"mkdir -p {shlex.quote(path)}",
                          f"mount --rbind {shlex.quote(host + path)} {shlex.quote(path)}"]
        if sc.get("readOnlyRootFilesystem"):
            lines.append("mount -o remount,bind,ro /")
        priv = ["setpriv"]
        if uid is not None:
            groups = [str(g) for g in [pod_sc.get("fsGroup"), *(pod_sc.get("supplementalGroups") or ())]
                      if g is not None]
            priv += [f"--reuid={uid}", f"--regid={gid}"]
            priv += [f"--groups={','.join(groups)}"] if groups else ["--clear-groups"]
        if sc.get("allowPrivilegeEscalation") is False:
            priv.append("--no-new-privs")
        if "ALL" in ((sc.get("capabilities") or {}).get("drop") or ()):
            priv += ["--inh-caps=-all", "--bounding-set=-all"]
        lines.append("exec " + shlex.join([*priv, "--", *argv]))
        return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", "\n".join(lines)]

    # ---------------------------------------------------------------------------- probing

    def _probe(self, readiness: Probe | None, liveness: Probe | None) -> None:
        t = time.monotonic()
        if readiness and t >= readiness.due:
            readiness.due = t + readiness.period
            readiness.record(self._check(readiness))
            spec = readiness.spec
            if not self.ready and readiness.successes >= int(spec.get("successThreshold", 1)):
                self._set_ready(True)
            elif self.ready and readiness.failures >= int(spec.get("failureThreshold", 3)):
                self._set_ready(False)
        if liveness and t >= liveness.due:
            liveness.due = t + liveness.period
            liveness.record(self._check(liveness))
            if liveness.failures >= int(liveness.spec.get("failureThreshold", 3)):
                log.warning("pod %s/%s: liveness probe failed: restarting the container", self.ns, self.name)
                self._stop_process(float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)))

    def _check(self, probe: Probe) -> bool:
        spec = probe.spec
        try:
            if "httpGet" in spec:
                return self._http(spec["httpGet"], probe.timeout)
            if "tcpSocket" in spec:
                port = named_port(self.container, spec["tcpSocket"]["port"])
                with socket.create_connection((spec["tcpSocket"].get("host") or self.ip, port), probe.timeout):
                    return True
            if "exec" in spec:
                return self._exec(spec["exec"]["command"], probe.timeout) == 0
        except (OSError, PodSpecError, subprocess.TimeoutExpired):
            return False
        return False

    def _http(self, get: dict, timeout: float) -> bool:
        port = named_port(self.container, get["port"])
        url = f"http://{get.get('host') or self.ip}:{port}{get.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return 200 <= r.status < 400
        except urllib.error.HTTPError as e:
            return 200 <= e.code < 400

    def _exec(self, command: list[str], timeout: float) -> int:
        """A probe or hook command, run inside the pod's mount namespace."""
        if self.proc is None or self.proc.poll() is not None:
            return 1
        argv = ["nsenter", "-t", str(self.proc.pid), "-m", "--", *command]
        if argv[4] in ("python", "python3"):
            argv[4] = self.agent.python
        return subprocess.run(argv, timeout=timeout, capture_output=True).returncode

    # ------------------------------------------------------------------------ stopping

    def _terminate(self, grace: float) -> None:
        """The kubelet's order: preStop hook (within the grace period), SIGTERM, SIGKILL at the end."""
        deadline = time.monotonic() + grace
        hook = ((self.container.get("lifecycle") or {}).get("preStop")) or {}
        if self.proc is not None and self.proc.poll() is None and hook and grace > 0:
            t0 = time.monotonic()
            try:
                if "httpGet" in hook:
                    self._http(hook["httpGet"], max(grace, 1))
                elif "exec" in hook:
                    self._exec(hook["exec"]["command"], max(grace, 1))
            except (OSError, subprocess.TimeoutExpired, PodSpecError) as e:
                log.info("pod %s/%s: preStop hook: %s", self.ns, self.name, e)
            log.info("pod %s/%s: preStop took %.1fs", self.ns, self.name, time.monotonic() - t0)
        # As the kubelet: at least 2 more seconds after SIGTERM when the hook used up the grace period.
        self._stop_process(max(deadline - time.monotonic(), 2.0 if grace > 0 else 0.0))

    def _stop_process(self, grace: float) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log.warning("pod %s/%s: still running after %.0fs: SIGKILL", self.ns, self.name, grace)
                proc.kill()
                proc.wait()
            except ProcessLookupError:
                pass
        try:   # anything the container left behind in its session
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._exited(proc.returncode)

    def _exited(self, code: int | None) -> None:
        if self.proc is None:
            return
        # A signal is reported as 128 + its number, as container runtimes do (SIGKILL: 137).
        code = -1 if code is None else code if code >= 0 else 128 - code
        ended = {"exitCode": code, "startedAt": self.started_at, "finishedAt": now(),
                 "reason": "Completed" if code == 0 else "Error"}
        message = self._termination_message(code)
        if message:
            ended["message"] = message
        self.last_state = {"terminated": ended}
        log.info("pod %s/%s: container exited with %s", self.ns, self.name, code)
        self.proc = None
        self.restarts += 1
        self.ready = False

    def _termination_message(self, code: int) -> str:
        """The kubelet's rule: the end of the termination file; when that is empty, the policy is
        FallbackToLogsOnError and the exit code is not 0, the end of this run's last log lines."""
        fallback = self.container.get("terminationMessagePolicy") == "FallbackToLogsOnError" and code != 0
        data = b""
        if self.termination_file is not None:
            try:
                data = _read_end(self.termination_file, MAX_TERMINATION_MESSAGE_BYTES)
            except FileNotFoundError:
                pass
            except OSError as e:
                return f"Error on reading termination log {self.termination_file}: {e}"
        if not data and fallback:
            try:
                with open(self.dir / f"{self.container['name']}.log", "rb") as f:
                    f.seek(self.log_from)
                    lines = f.read().splitlines(keepends=True)[-MAX_TERMINATION_LOG_LINES:]
                data = b"".join(lines)[-MAX_TERMINATION_LOG_BYTES:]
            except OSError as e:
                return f"Error on reading termination message from logs: {e}"
        return data.decode("utf-8", errors="replace")

    def _delete_from_api(self) -> None:
        """The kubelet's last word: the containers are gone, remove the pod object now."""
        self.agent.delete_pod(self.ns, self.name, self.uid)

    # ----------------------------------------------------------------------------- status

    def _set_ready(self, ready: bool) -> None:
        self.ready = ready
        self._status("Running", ready=ready, state={"running": {"startedAt": self.started_at}})
        log.info("pod %s/%s ready=%s", self.ns, self.name, ready)

    def _status(self, phase: str, ready: bool, state: dict) -> None:
        t = now()
        r = "True" if ready else "False"
        conds = [{"type": "Initialized", "status": "True", "lastTransitionTime": t},
                 {"type": "PodScheduled", "status": "True", "lastTransitionTime": t},
                 {"type": "ContainersReady", "status": r, "lastTransitionTime": t},
                 {"type": "Ready", "status": r, "lastTransitionTime": t}]
        c = self.container
        cs = {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": ready,
              "started": "running" in state, "restartCount": self.restarts,
              "state": state, "lastState": self.last_state}
        if self.proc is not None:
            cs["containerID"] = f"e2e-agent://{self.proc.pid}"
        self.agent.patch_pod_status(self.ns, self.name, {
            "phase": phase, "conditions": conds, "containerStatuses": [cs], "hostIP": "127.0.0.1",
            "podIP": self.ip, "podIPs": [{"ip": self.ip}], "startTime": self.pod["status"].get("startTime") or t})

    def _the_container(self) -> dict[str, Any]:
        containers = self.pod["spec"]["containers"]
        if len(containers) != 1 or self.pod["spec"].get("initContainers"):
            raise PodSpecError("the e2e node agent runs pods with exactly one container and no init containers")
        return containers[0]


def ensure_mountpoint(path: str, file: bool = False) -> list[str]:
    """Create a mount point on the host (a folder, or an empty file to bind a file onto); return the
    paths created, parents first (to remove them afterwards)."""
    created = []
    p = Path(path)
    for parent in reversed(p.parents):
        if not parent.exists():
            parent.mkdir()
            created.append(str(parent))
    if not p.exists():
        p.touch() if file else p.mkdir()
        created.append(str(p))
    return created


def _read_end(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(max(os.fstat(f.fileno()).st_size - limit, 0))
        return f.read(limit)
