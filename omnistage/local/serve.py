"""`omnistage serve`: every stage replica and the orchestrator as local processes on loopback.

Stages start in parallel (each in its own process group, so engine helper
processes go with it), the orchestrator once every stage is SERVING. On
Ctrl-C or SIGTERM every process gets SIGTERM, then SIGKILL after a bound: no
process is left behind. A process that dies while serving is restarted, as a
Deployment restarts a container (`supervise`, `omnistage.local.restarts`: crash-loop
backoff): a stage replica leaves the orchestrator's endpoints at once and joins
them again once its replacement is ready, the other replicas serve meanwhile; the
orchestrator comes back on the ports it had. Each process's log file is bounded
(`restarts.rotate_log`).

Every process serves its HTTP status port (metrics, readiness, liveness) on a
free port, and the orchestrator the OpenAI-compatible API when asked; each
process's ready file says which ports it bound. `prometheus-targets.json` in
the log folder lists every status port for a Prometheus `file_sd_configs`.

The hops between the orchestrator and the stages are mutual TLS unless `tls=False`: at start a throwaway
CA (its key never written) issues a leaf for the orchestrator and one per stage (namespace "local", the
pipeline's name) into a private temporary folder (0700), deleted at stop. The client-facing ports stay
plaintext unless a `client_tls_dir` (tls.crt, tls.key) is given.

GPUs: before anything starts, each stage replica is given its GPUs (`omnistage.local.gpu_placement`) from the
machine's; a file that asks for more than the machine has is refused then. Each stage process sees only its
GPUs in CUDA_VISIBLE_DEVICES; a CPU stage, and the orchestrator, see none ("").
Then each stage's memory plan (`omnistage.checkpoints.plan`, read from the checkpoints' configs and headers)
must fit its share of its GPUs (their memory from nvidia-smi, or OMNISTAGE_GPU_MEMORY) or its
`resources.limits.memory`; a stage that does not is refused with the numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from omnistage import tls as certificates
from omnistage.api import Pipeline
from omnistage.api.model import JOBS_MODALITY
from omnistage.contract.devices import uses_gpus
from omnistage.contract.launch import (
    API_PATH,
    ENV_API_KEYS,
    ENV_CLIENT_TLS_DIR,
    ENV_DATA_PLANE_KEY,
    ENV_JOBS_CONTENT,
    ENV_JOBS_STORE,
    ENV_TLS_DIR,
    ReadyPorts,
    http_url,
    model_dir,
    orchestrator_command,
    read_ready,
    service_env,
    stage_command,
)
from omnistage.local import gpu_placement
from omnistage.local.process_group import signal_group
from omnistage.local.restarts import (
    LOG_BACKUPS,
    LOG_MAX_BYTES,
    failures_after_death,
    log_tail,
    restart_delay,
    rotate_log,
)
from omnistage.store_url import redacted_url, sqlite_file

TARGETS_FILE = "prometheus-targets.json"   # in the log folder: Prometheus file-based service discovery
ENDPOINTS_FILE = "endpoints.json"           # in the log folder: the orchestrator's stage replicas (--discovery file)
# A drained replica is told to stop this long after the orchestrator's endpoints file dropped it (a few of the
# orchestrator's polls): no new call reaches it by then, and the ones it has it finishes (its drain contract).
DRAIN_AFTER_UNLISTED_S = 1.0
DRAIN_KILL_MARGIN_S = 10.0   # past its drainSeconds and this, a drained replica that has not exited is killed
SCRAPE_JOB = "omnistage"
LOCAL_NAMESPACE = "local"           # the namespace part of every local process's identity
# The job store of a pipeline with a video output, by default: SQLite and a content folder under the working
# directory (not the log folder, a temporary one), so jobs and their videos outlive a restart of serve.
JOBS_DIR = Path(".omnistage") / "jobs"
JOBS_DB_FILE = "jobs.db"
JOBS_CONTENT_DIR = "content"


@dataclass(frozen=True)
class LocalJobs:
    """Where the orchestrator keeps its durable jobs (/v1/videos): the store's URL and the content folder."""
    store: str
    content: Path
    root: Path      # JOBS_DIR under the working directory: made private when a default lives there


def local_jobs(pipeline: Pipeline, work_dir: Path, store: str | None = None,
               content: Path | None = None) -> LocalJobs | None:
    """The job store `omnistage serve` gives the orchestrator: `store` (--jobs-store), else the pipeline's
    jobs.store.url, else, for a pipeline with a video output, SQLite in JOBS_DIR under `work_dir`; content in
    `content` (--jobs-content), else JOBS_DIR's content folder. None: no store (the job API refuses jobs). A
    store the pipeline names by Secret (secretRef) is the cluster's: locally it is not read."""
    store = store or pipeline.deployment.orchestrator.jobs.store.url or None
    if store is None and not any(o.modality == JOBS_MODALITY for o in pipeline.outputs):
        return None
    root = (work_dir / JOBS_DIR).resolve()
    return LocalJobs(store or f"sqlite://{root / JOBS_DB_FILE}", (content or root / JOBS_CONTENT_DIR).resolve(), root)


class LaunchError(RuntimeError):
    pass


def sqlite_folder(folder: Path, store: str) -> None:
    """Make the folder of a SQLite job store's file (private: the jobs' prompts are the users'), or refuse to
    start naming it: the orchestrator would start and answer every job creation 503."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"{folder} is not writable by this user")
    except OSError as e:
        raise LaunchError(f"job store {redacted_url(store)}: the folder of its SQLite file, {folder}, cannot be made "
                          f"or written ({e.strerror or e}); choose another --jobs-store") from None


@dataclass
class Proc:
    name: str            # "stage thinker[0]" or "orchestrator"
    argv: list[str]
    log_path: Path
    ready_file: Path
    stage: str | None = None        # None: the orchestrator
    gpus: tuple[str, ...] = ()      # the GPU ids its CUDA_VISIBLE_DEVICES names (none: the CPU)
    popen: subprocess.Popen | None = None
    ports: ReadyPorts | None = None  # once ready
    started: float = 0.0
    ready_after: float | None = None
    stop_at: float | None = None     # a replica being drained: when it gets SIGTERM
    kill_at: float | None = None     # ... and SIGKILL, when its drain bound has passed and it is still there
    env: dict[str, str] = field(default_factory=dict)   # what it was started with (a restart gets the same)
    failures: int = 0                # deaths in a row (crash-loop backoff; reset by a long enough run)
    restart_at: float | None = None  # dead: when it is started again

    @property
    def port(self) -> int | None:
        """The gRPC port, once ready."""
        return self.ports.grpc if self.ports else None

    def tail(self, lines: int = 15) -> str:
        return log_tail(self.log_path, lines)


@dataclass
class LocalPipeline:
    pipeline_file: Path
    pipeline: Pipeline
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    log_dir: Path | None = None
    replicas: dict[str, int] = field(default_factory=dict)  # overrides spec.deployment replicas
    progress: Callable[[str], None] = lambda m: print(m, flush=True)
    extra_env: dict[str, str] = field(default_factory=dict)
    api_port: int | None = None     # the orchestrator's OpenAI-compatible API (0: any free port; None: none)
    api_keys: Sequence[str] = ()    # bearer keys the API takes (none: no key needed)
    tls: bool = True                # mutual TLS between the orchestrator and the stages (throwaway CA)
    client_tls_dir: Path | None = None  # tls.crt + tls.key: the orchestrator's client ports serve TLS
    log_max_bytes: int = LOG_MAX_BYTES  # each process's log file is rotated past this (restarts.rotate_log)
    log_backups: int = LOG_BACKUPS      # ... keeping this many old copies
    jobs_store: str | None = None       # the job store's URL (default: local_jobs)
    jobs_content: Path | None = None    # its content folder (default: local_jobs)
    work_dir: Path = field(default_factory=Path.cwd)   # where the default job store lives

    def __post_init__(self):
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix=f"omnistage-{self.pipeline.name}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.stages: list[Proc] = []
        self.orchestrator: Proc | None = None
        self.endpoint: str | None = None
        self.targets_file = self.log_dir / TARGETS_FILE
        self.tls_root: Path | None = None   # the private folder of this run's certificates, while running
        self.gpu_assignment: dict[gpu_placement.ReplicaKey, tuple[str, ...]] = {}   # once placed
        self.endpoints_file = self.log_dir / ENDPOINTS_FILE
        self.starting: list[Proc] = []   # replicas added while serving, not ready yet
        self.draining: list[Proc] = []   # replicas taken out of service, finishing what they hold
        self._env: dict[str, str] = {}
        self._tls_dirs: dict[str | None, Path] = {}
        self._added = 0
        self.jobs = local_jobs(self.pipeline, self.work_dir, self.jobs_store, self.jobs_content)

    def replica_counts(self) -> dict[str, int]:
        """Replicas each stage runs here, in stage order (a stage scaled to 0 in the file still runs one)."""
        return {st.name: self.replicas.get(st.name, self.pipeline.deployment.stages[st.name].replicas) or 1
                for st in self.pipeline.stages}

    def place_gpus(self, env: dict[str, str]) -> gpu_placement.MachineGpus:
        """Every stage replica's GPUs from those of the machine (as `env` shows them); LaunchError when the
        file asks for more than there are. Prints the assignment when some stage has GPUs."""
        deployments = {st.name: self.pipeline.deployment.stages[st.name] for st in self.pipeline.stages}
        try:
            machine = gpu_placement.machine_gpus(env)
            self.gpu_assignment = gpu_placement.assign_gpus(deployments, machine, self.replica_counts())
        except gpu_placement.GpuPlacementError as e:
            raise LaunchError(str(e)) from None
        lines = gpu_placement.assignment_lines(deployments, self.gpu_assignment)
        if lines:
            self.progress(f"GPUs: {machine.describe()}")
            for line in lines:
                self.progress(line)
        return machine

    def check_memory(self, env: dict[str, str]) -> None:
        """Refuse, before anything loads, a stage whose memory plan does not fit its GPUs' share or its memory
        limit (`omnistage.checkpoints.fit`). Stages the plan cannot read are left to report it themselves."""
        from omnistage.checkpoints.fit import misfit, room
        from omnistage.checkpoints.plan import plan_pipeline

        deployments = self.pipeline.deployment.stages
        try:
            gpu_bytes = gpu_placement.gpu_memory(env) if any(uses_gpus(d) for d in deployments.values()) else None
        except gpu_placement.GpuPlacementError as e:
            raise LaunchError(str(e)) from None
        if not any(room(st, deployments[st.name], gpu_bytes) for st in self.pipeline.stages):
            return  # nothing to check: no GPU memory known, no memory limit set
        plans, _ = plan_pipeline(self.pipeline, self.model_dir)
        refused = [m for p in plans if (m := misfit(p, self.pipeline.stage(p.stage), deployments[p.stage], gpu_bytes))]
        if refused:
            raise LaunchError("the memory plan does not fit: " + "; ".join(refused) +
                              " (`omnistage models check --plan` prints the plan)")

    # ------------------------------------------------------------ start
    def check_models(self) -> None:
        missing = [f"{s.name}: {model_dir(s, self.model_dir)}" for s in self.pipeline.stages
                   if not model_dir(s, self.model_dir).exists()]
        if missing:
            raise LaunchError("model not found for " + "; ".join(missing) +
                              f" (build the tiny models with `omnistage models build {self.model_dir}`)")

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # every stage runs on this host: `auto` edges may use shared memory between them
        env.update(service_env(self.model_dir, same_host=True))
        env.update({"UCX_TLS": env.get("UCX_TLS", "tcp"), "UCX_WARN_UNUSED_ENV_VARS": "n"})
        # serve decides: its own certificates and data-plane key, or none (--no-tls)
        for key in (ENV_TLS_DIR, ENV_CLIENT_TLS_DIR, ENV_DATA_PLANE_KEY, ENV_JOBS_STORE, ENV_JOBS_CONTENT):
            env.pop(key, None)
        env.update(self.extra_env)
        return env

    def _spawn(self, proc: Proc, env: dict[str, str]) -> None:
        proc.ready_file.unlink(missing_ok=True)
        proc.env, proc.ports = env, None
        # Appended to (a restart keeps the last one's lines), in append mode: `rotate_log` empties it in place.
        log = open(proc.log_path, "ab")
        proc.popen = subprocess.Popen(proc.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        log.close()
        proc.started = time.monotonic()

    def start(self, timeout: float = 600.0) -> str:
        """Start everything; returns the orchestrator endpoint. Raises LaunchError naming what failed."""
        self.check_models()
        env = self.env()
        # refused keys and GPU placements: before anything starts; the orchestrator never uses a GPU
        orchestrator_env = {**env, **self._api_key_env(), **self._jobs_env(), **gpu_placement.replica_env()}
        machine = self.place_gpus(env)
        self.check_memory(env)
        self._tls_dirs = self._issue_certificates() if self.tls else {}
        self._env = env
        for (stage, i), gpus in self.gpu_assignment.items():   # every stage replica, in stage order
            proc = self._stage_proc(stage, f"{stage}-{i}", f"stage {stage}[{i}]", gpus)
            self._spawn(proc, {**env, **gpu_placement.replica_env(gpus, machine)})
            self.stages.append(proc)
        self.progress(f"starting {len(self.stages)} stage process(es) for {self.pipeline.name} "
                      f"(logs in {self.log_dir})")
        self._wait_ready(self.stages, timeout)
        self.write_endpoints()
        self.orchestrator = self._orchestrator_proc(self.port, 0, self.api_port)
        self._spawn(self.orchestrator, orchestrator_env)
        self._wait_ready([self.orchestrator], 60)
        self.endpoint = f"{self.host}:{self.orchestrator.port}"
        self.write_targets()
        return self.endpoint

    def _orchestrator_proc(self, port: int, http_port: int, api_port: int | None) -> Proc:
        ready_file = self.log_dir / "orchestrator.ready"
        argv = orchestrator_command(self.pipeline_file, host=self.host, port=port, http_port=http_port,
                                    api_port=api_port, discovery="file", endpoints_file=self.endpoints_file,
                                    wait_for_stages=30, ready_file=ready_file, tls_dir=self._tls_dirs.get(None),
                                    client_tls_dir=self.client_tls_dir, **self._jobs_flags())
        return Proc("orchestrator", argv, self.log_dir / "orchestrator.log", ready_file)

    def _stage_proc(self, stage: str, tag: str, name: str, gpus: tuple[str, ...] = ()) -> Proc:
        ready_file = self.log_dir / f"{tag}.ready"
        argv = stage_command(self.pipeline_file, stage, host=self.host, port=0, http_port=0,
                             model_dir=self.model_dir, ready_file=ready_file, tls_dir=self._tls_dirs.get(stage),
                             data_plane_key=self._data_plane_key(stage))
        argv.insert(1, "-P")  # the user's cwd (./models and all) off sys.path: a checkpoint cannot plant a module
        return Proc(name, argv, self.log_dir / f"{tag}.log", ready_file, stage=stage, gpus=gpus)

    def write_endpoints(self) -> None:
        """The ready replicas in service, as the orchestrator reads them (`--discovery file`); written whole
        and renamed into place, so a reader never sees half of it."""
        endpoints: dict[str, list[str]] = {st.name: [] for st in self.pipeline.stages}
        for p in self.stages:
            endpoints[p.stage].append(f"{self.host}:{p.port}")
        tmp = self.endpoints_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(endpoints, indent=2) + "\n")
        os.replace(tmp, self.endpoints_file)
        if self.orchestrator is not None:  # once serving, the scrape targets follow the replicas too
            self.write_targets()

    def write_targets(self) -> None:
        """Prometheus's `file_sd_configs` file, replaced whole as the endpoints file is (a reader of it never
        sees half)."""
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.scrape_targets(), indent=2) + "\n")
        os.replace(tmp, self.targets_file)

    # ------------------------------------------------------------ scaling while serving
    def add_replica(self, stage: str) -> Proc:
        """Start one more replica of a CPU stage; it joins the orchestrator's replicas once ready
        (`poll_scaling`). A GPU stage keeps the replicas it started with (its GPUs were placed then)."""
        if any(p.gpus for p in self.stages if p.stage == stage):
            raise LaunchError(f"stage {stage} runs on GPUs: serve places GPUs at start and does not add replicas")
        self._added += 1
        proc = self._stage_proc(stage, f"{stage}-added{self._added}", f"stage {stage}[+{self._added}]")
        self._spawn(proc, {**self._env, **gpu_placement.replica_env()})
        self.starting.append(proc)
        return proc

    def cancel_starting(self, stage: str) -> Proc | None:
        """Stop the newest replica of a stage that is still starting (it serves nothing yet), if any."""
        mine = [p for p in self.starting if p.stage == stage]
        if not mine:
            return None
        proc = max(mine, key=lambda p: p.started)
        self.starting.remove(proc)
        if proc.restart_at is not None:   # dead, waiting for its restart: nothing to stop
            return proc
        signal_group(proc.popen, signal.SIGTERM)
        proc.stop_at, proc.kill_at = None, time.monotonic() + DRAIN_KILL_MARGIN_S
        self.draining.append(proc)   # reaped (or killed) there
        return proc

    def drain_replica(self, stage: str) -> Proc | None:
        """Take the newest ready replica of a stage out of service (never its last): it leaves the
        orchestrator's endpoints now and gets SIGTERM (its drain) shortly after, in `poll_scaling`."""
        mine = [p for p in self.stages if p.stage == stage]
        if len(mine) < 2:
            return None
        proc = max(mine, key=lambda p: p.started)
        self.stages.remove(proc)
        self.write_endpoints()
        proc.stop_at = time.monotonic() + DRAIN_AFTER_UNLISTED_S
        self.draining.append(proc)
        return proc

    def poll_scaling(self) -> list[str]:
        """Advance the replicas being added and drained; returns what happened, one line each."""
        events = []
        for p in list(self.starting):
            if p.restart_at is not None:   # dead, its restart due later
                if time.monotonic() >= p.restart_at:
                    p.restart_at = None
                    self._spawn(p, p.env)
                    events.append(f"{p.name}: restarted (pid {p.popen.pid})")
                continue
            p.ports = read_ready(p.ready_file)
            if p.ports is not None:
                p.ready_after = time.monotonic() - p.started
                self.starting.remove(p)
                self.stages.append(p)
                self.write_endpoints()
                events.append(f"{p.name}: ready on {self.host}:{p.port} after {p.ready_after:.1f}s, in service")
            elif p.popen.poll() is not None:
                events.append(self._restart_later(p, "while starting"))
        for p in list(self.draining):
            now = time.monotonic()
            if p.stop_at is not None and now >= p.stop_at:
                signal_group(p.popen, signal.SIGTERM)
                p.stop_at = None
                p.kill_at = now + self.pipeline.deployment.stages[p.stage].drain_seconds + DRAIN_KILL_MARGIN_S
            elif p.popen.poll() is not None:
                self.draining.remove(p)
                events.append(f"{p.name}: drained, exited with code {p.popen.returncode}")
            elif p.kill_at is not None and now >= p.kill_at:
                signal_group(p.popen, signal.SIGKILL)
                p.kill_at = None
                events.append(f"{p.name}: still there past its drain bound; killed")
        return events

    def _data_plane_key(self, stage: str) -> Path | None:
        """The UCX data-plane key written beside the stage's certificate (none without TLS: loopback only)."""
        folder = self._tls_dirs.get(stage)
        return folder / certificates.DATA_PLANE_KEY_FILE if folder else None

    def _issue_certificates(self) -> dict[str | None, Path]:
        """A throwaway CA and a leaf for the orchestrator (key None) and each stage, each in its own folder
        under a private temporary one. The CA's key stays in memory: nothing else can be issued from it."""
        self.tls_root = Path(tempfile.mkdtemp(prefix=f"omnistage-tls-{self.pipeline.name}-"))  # 0700
        ca, ca_key = certificates.new_ca(f"omnistage serve {self.pipeline.name} (throwaway)")
        dirs = certificates.write_pipeline_dirs(self.tls_root, ca, ca_key, LOCAL_NAMESPACE, self.pipeline.name,
                                                [st.name for st in self.pipeline.stages])
        return {who: files.folder for who, files in dirs.items()}

    def _jobs_env(self) -> dict[str, str]:
        """The job store's URL for the orchestrator, by environment (a PostgreSQL URL holds a password the
        process list would show); its folders made (private: the jobs' prompts and videos are the users')."""
        if self.jobs is None:
            return {}
        if self.jobs.content.is_relative_to(self.jobs.root) or self.jobs.store.startswith(f"sqlite://{self.jobs.root}"):
            self.jobs.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.jobs.content.mkdir(mode=0o700, parents=True, exist_ok=True)
        if (db := sqlite_file(self.jobs.store)) is not None:
            sqlite_folder(Path(db).parent, self.jobs.store)
        return {ENV_JOBS_STORE: self.jobs.store}

    def _jobs_flags(self) -> dict[str, Any]:
        """The orchestrator's --jobs-* flags: the content folder and the pipeline's jobs settings."""
        if self.jobs is None:
            return {}
        spec = self.pipeline.deployment.orchestrator.jobs
        return {"jobs_content": self.jobs.content, "jobs_ttl_s": spec.ttl_seconds,
                "jobs_concurrency": spec.concurrency, "jobs_max_queued_per_key": spec.max_queued_per_key}

    def _api_key_env(self) -> dict[str, str]:
        """The keys reach the orchestrator in its environment, not its command line (which `ps` shows)."""
        if not self.api_keys:
            return {}
        if any(not k or "," in k or k != k.strip() for k in self.api_keys):
            raise LaunchError("an API key must be non-empty, without commas or surrounding spaces")
        return {ENV_API_KEYS: ",".join(self.api_keys)}

    def _wait_ready(self, procs: list[Proc], timeout: float) -> None:
        end = time.monotonic() + timeout
        waiting = list(procs)
        last_note = time.monotonic()
        while waiting:
            for p in list(waiting):
                p.ports = read_ready(p.ready_file)
                if p.ports is not None:
                    p.ready_after = time.monotonic() - p.started
                    self.progress(f"  {p.name}: ready on {self.host}:{p.port} after {p.ready_after:.1f}s "
                                  f"(pid {p.popen.pid})")
                    waiting.remove(p)
                elif p.popen.poll() is not None:
                    raise LaunchError(f"{p.name} exited with code {p.popen.returncode} while starting; "
                                      f"last log lines ({p.log_path}):\n{p.tail()}")
            if waiting and time.monotonic() > end:
                raise LaunchError(f"{', '.join(p.name for p in waiting)} not ready after {timeout:.0f}s")
            if waiting and time.monotonic() - last_note > 10:
                self.progress(f"  waiting for {', '.join(p.name for p in waiting)} "
                              f"({time.monotonic() - waiting[0].started:.0f}s: loading models)")
                last_note = time.monotonic()
            time.sleep(0.05)

    # ------------------------------------------------------- where to reach it
    @property
    def api_url(self) -> str | None:
        """The OpenAI-compatible API's base URL (`http://HOST:PORT/v1`, https with a client_tls_dir); None
        when it is not served."""
        ports = self.orchestrator.ports if self.orchestrator else None
        if not ports or ports.api is None:
            return None
        url = http_url(self.host, ports.api, API_PATH)
        return certificates.https(url) if self.client_tls_dir else url

    @property
    def status_urls(self) -> dict[str, str]:
        """Process name -> the base URL of its HTTP status port (append launch.METRICS_PATH, READY_PATH, ...)."""
        return {p.name: http_url(self.host, p.ports.http) for p in self.all_procs()
                if p.ports is not None and p.ports.http is not None}

    def scrape_targets(self) -> list[dict]:
        """Every status port, as Prometheus file-based service discovery lists targets."""
        return [{"targets": [f"{self.host}:{p.ports.http}"],
                 "labels": {"job": SCRAPE_JOB, "pipeline": self.pipeline.name, "process": p.name}}
                for p in self.all_procs() if p.ports is not None and p.ports.http is not None]

    # ------------------------------------------------------------- run
    def all_procs(self) -> list[Proc]:
        return self.stages + ([self.orchestrator] if self.orchestrator else [])

    def supervise(self) -> list[str]:
        """Restart what died, as a Deployment does; returns one line per event. A dead stage replica leaves
        the orchestrator's endpoints at once (the others serve its stage) and waits its backoff among the
        replicas starting, where `poll_scaling` starts it again and puts it back once ready. A dead
        orchestrator is started again on the ports it had, so the address clients were given stays good.
        Also bounds every process's log file (`rotate_log`)."""
        events = []
        for p in list(self.stages):
            if p.popen is not None and p.popen.poll() is not None:
                self.stages.remove(p)
                self.write_endpoints()
                self.starting.append(p)   # counted as a replica on its way (the autoscaler's count)
                events.append(self._restart_later(p, "while serving"))
        events += self.poll_scaling()
        orch = self.orchestrator
        if orch is not None and orch.popen is not None:
            now = time.monotonic()
            if orch.restart_at is None and orch.ports is None and orch.popen.poll() is None:
                orch.ports = read_ready(orch.ready_file)   # a restarted orchestrator, not ready yet
                if orch.ports is not None:
                    self.write_targets()   # its status port, as it bound it this time
                    events.append(f"{orch.name}: ready again on {self.endpoint} after "
                                  f"{now - orch.started:.1f}s (pid {orch.popen.pid})")
            elif orch.restart_at is None and orch.popen.poll() is not None:
                events.append(self._restart_later(orch, "while serving" if orch.ports else "while starting"))
                if orch.ports is not None:   # the same ports again: clients were given this address
                    self.orchestrator = orch = self._restarted_orchestrator(orch)
            elif orch.restart_at is not None and now >= orch.restart_at:
                orch.restart_at = None
                self._spawn(orch, orch.env)
                events.append(f"{orch.name}: restarted (pid {orch.popen.pid})")
        for p in [*self.all_procs(), *self.starting, *self.draining]:
            rotate_log(p.log_path, self.log_max_bytes, self.log_backups)
        return events

    def _restart_later(self, p: Proc, when: str) -> str:
        """Schedule the restart of a process that died; the line that says so."""
        signal_group(p.popen, signal.SIGKILL)   # helper processes of its group go with it
        now = time.monotonic()
        p.failures = failures_after_death(p.failures, now - p.started)
        delay = restart_delay(p.failures)
        p.restart_at = now + delay
        where = "out of service, " if p.stage is not None and when == "while serving" else ""
        return (f"{p.name} (pid {p.popen.pid}) exited with code {p.popen.returncode} {when}; {where}"
                f"restart {p.failures} in {delay:g}s (log: {p.log_path})")

    def _restarted_orchestrator(self, dead: Proc) -> Proc:
        """The orchestrator's next process: the ports the dead one bound, its restart already scheduled."""
        assert dead.ports is not None
        proc = self._orchestrator_proc(dead.ports.grpc, dead.ports.http or 0,
                                       dead.ports.api if self.api_port is not None else None)
        proc.popen, proc.env, proc.started = dead.popen, dead.env, dead.started
        proc.failures, proc.restart_at = dead.failures, dead.restart_at
        return proc

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM every process group, wait up to `grace`, then SIGKILL what is left. A process that died and
        waits for its restart is left out: its group was killed when it died, and its number may be another's."""
        procs = [p for p in [*self.all_procs(), *self.starting, *self.draining]
                 if p.popen is not None and p.restart_at is None]
        for p in procs:
            signal_group(p.popen, signal.SIGTERM)
        end = time.monotonic() + grace
        for p in procs:
            try:
                p.popen.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:  # the group too: engine helper processes must not outlive their stage
            signal_group(p.popen, signal.SIGKILL)
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self.tls_root is not None:  # the keys go with the processes that used them
            shutil.rmtree(self.tls_root, ignore_errors=True)
            self.tls_root = None

    def __enter__(self) -> "LocalPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
