"""The process contract: how a stage or an orchestrator process is started and probed.

Whoever starts one (the operator's builders, `omnistage serve`, the test harness, benchmarks) builds
its command line with `stage_command` / `orchestrator_command` and its environment with `service_env`;
the process parses that command line with `stage_parser` / `orchestrator_parser`. Both sides read the
same flag tables, so a flag one side writes is a flag the other side reads. Also here: the environment
variable names the services read, the model store's default and layout, ports and probe paths.
Also the ready file: how a launched process tells its launcher, once serving, which ports it bound
(`write_ready` / `read_ready`).
Pure: no imports from the services, nothing read from the environment at import time.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from omnistage.api.model_sources import local_path
from omnistage.api.ports import (  # noqa: F401
    API_PORT,
    API_PORT_NAME,
    ENV_API_KEYS,
    GRPC_PORT,
    GRPC_PORT_NAME,
    HTTP_PORT,
    HTTP_PORT_NAME,
)
from omnistage.logs import (
    ACCESS_LOGGER,
    DEFAULT_LOG_FORMAT,
    ENV_ACCESS_LOG,
    ENV_LOG_FORMAT,
    LOG_FORMATS,
    POD_LOG_FORMAT,
    access_log_switch,
    log_format,
)

if TYPE_CHECKING:
    from omnistage.api import Stage

STAGE_MODULE = "stage_service"
ORCHESTRATOR_MODULE = "orchestrator_service"

# Environment variables the services read.
ENV_MODEL_DIR = "OMNISTAGE_MODEL_DIR"        # root of the model store
ENV_HOST = "OMNISTAGE_HOST"                  # the address to bind when --host is not given
# Domain names the OpenAI API answers in a request's Host when bound to loopback, besides localhost (a local
# proxy's), comma separated: `omnistage serve --allowed-host` sets it for the orchestrator.
ENV_ALLOWED_HOSTS = "OMNISTAGE_ALLOWED_HOSTS"
ENV_SAME_HOST = "OMNISTAGE_PEERS_SAME_HOST"  # "1": every stage of the pipeline runs on this host (local mode)
ENV_HOST_ID = "OMNISTAGE_HOST_ID"            # the shared-memory domain's name (default: the host name)
ENV_TRANSPORTS = "OMNISTAGE_TRANSPORTS"      # override the stores a stage enables, e.g. "shm" or "shm,ucx"
ENV_POD_IP = "POD_IP"                        # on a cluster, from the downward API
ENV_POD_NAMESPACE = "POD_NAMESPACE"          # on a cluster, from the downward API
ENV_CLIENT_API_KEY = "OMNISTAGE_API_KEY"     # the one key a client (`omnistage generate`) sends
# The process's mTLS identity: a folder in the Kubernetes TLS Secret layout (ca.crt, tls.crt, tls.key; see
# omnistage/tls.py). Given: stages accept only the pipeline's own peers and the orchestrator dials them over TLS.
ENV_TLS_DIR = "OMNISTAGE_TLS_DIR"
TLS_MOUNT = "/etc/omnistage-tls"             # where the operator mounts a pod's certificate Secret (beside, not inside,
                                             # the pipeline ConfigMap's read-only /etc/omnistage: no mount point
                                             # within it)
# A stage's UCX data-plane key: the file (hex; omnistage/connector/ucx_auth.py) its --data-plane-key flag
# names. The operator mounts each pipeline's key Secret at DATA_PLANE_KEY_MOUNT in every stage pod, in every
# TLS mode; `omnistage serve` names the key it writes beside each stage's certificate.
ENV_DATA_PLANE_KEY = "OMNISTAGE_DATA_PLANE_KEY"
DATA_PLANE_KEY_MOUNT = "/etc/omnistage-data-plane"
# The orchestrator's client-facing certificate (tls.crt, tls.key): its gRPC and HTTP API ports serve TLS.
ENV_CLIENT_TLS_DIR = "OMNISTAGE_CLIENT_TLS_DIR"
CLIENT_TLS_MOUNT = "/etc/omnistage-client-tls"
# The job API's durable store (a sqlite:// or postgresql:// URL: its password stays out of the command line on a
# cluster, where the operator sets it from a Secret) and the folder where finished jobs' content is kept.
ENV_JOBS_STORE = "OMNISTAGE_JOBS_STORE"
ENV_JOBS_CONTENT = "OMNISTAGE_JOBS_CONTENT"

DEFAULT_MODEL_DIR = "models"                 # relative to the working directory
DEFAULT_HOST = "127.0.0.1"
DEFAULT_NAMESPACE = "default"

# Paths on the HTTP port.
METRICS_PATH = "/metrics"   # Prometheus
READY_PATH = "/readyz"      # 200 once serving, 503 while loading or draining
LIVE_PATH = "/livez"
DRAIN_PATH = "/drain"       # POST with the drain token (a preStop hook): answers once admitted work is finished
API_PATH = "/v1"            # the base of the OpenAI-compatible API, on its own port
# Where a process that serves /drain writes its drain token (0600, in a 0700 folder of its user under the
# temporary directory, per HTTP port): only its own user (the preStop hook, in the same container) can read it.
DRAIN_TOKEN_DIR = "omnistage-drain-{uid}"
DRAIN_TOKEN_FILE = "{port}.token"
# The preStop hook runs this in the container (an exec hook: it reads the drain token, which a kubelet's
# httpGet hook could not send): Python, so any image that runs omnistage runs it.
DRAIN_HOOK_CODE = "from omnistage.contract.launch import drain_self; drain_self()"
# Where a process that refuses to start writes its one-line reason (Kubernetes' default terminationMessagePath;
# the kubelet shows it as the container's last termination message).
TERMINATION_LOG = "/dev/termination-log"


@dataclass(frozen=True)
class Flag:
    """One command-line flag: `--name` (underscores as dashes), read back as `args.name`."""
    name: str
    help: str
    type: Callable[[str], Any] = str
    default: Any = None
    env: str | None = None          # the default comes from this variable when it is set
    required: bool = False
    repeat: bool = False            # may be given several times; the value is a list (with `env`: the
                                    # variable's comma-separated items, replaced by the flags when given)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


# Flags both services take.
_PIPELINE = Flag("pipeline", "OmniPipeline YAML file", required=True)
_SERVING = (
    Flag("host", f"address to bind (default ${ENV_HOST} or {DEFAULT_HOST})", default=DEFAULT_HOST, env=ENV_HOST),
    Flag("port", "gRPC port (0: any free port)", int, default=0),
    Flag("http_port", f"HTTP port for {METRICS_PATH}, {READY_PATH}, {LIVE_PATH}, {DRAIN_PATH}", int),
    Flag("tls_dir", f"mTLS identity between the pipeline's processes: a folder with ca.crt, tls.crt, tls.key "
                    f"(default ${ENV_TLS_DIR}; none: plaintext)", env=ENV_TLS_DIR, metavar="DIR"),
)
_LIFECYCLE = (
    Flag("drain_seconds", "bound on finishing admitted work at SIGTERM", float),
    Flag("ready_file", "once serving, write the bound ports here (see launch.write_ready)"),
    Flag("log_level", "logging level", default="INFO"),
    Flag("log_format", f"log lines as json (one object a line) or text (default ${ENV_LOG_FORMAT} or "
                       f"{DEFAULT_LOG_FORMAT}; the operator's pods: {POD_LOG_FORMAT})", log_format,
         default=DEFAULT_LOG_FORMAT, env=ENV_LOG_FORMAT, metavar="|".join(LOG_FORMATS)),
    Flag("access_log", f"one {ACCESS_LOGGER} line per request (orchestrator) or per stage call (stage): on or off "
                       f"(default ${ENV_ACCESS_LOG} or on)", access_log_switch, default="on", env=ENV_ACCESS_LOG,
         metavar="on|off"),
)
STAGE_FLAGS = (
    _PIPELINE,
    Flag("stage", "name of the stage to serve", required=True),
    *_SERVING,
    Flag("model_dir", f"root of the model store (default ${ENV_MODEL_DIR} or ./{DEFAULT_MODEL_DIR})"),
    Flag("data_plane_key", f"the pipeline's UCX data-plane key, a file of hex (default ${ENV_DATA_PLANE_KEY}; "
                           "none: UCX only on loopback, unauthenticated)", env=ENV_DATA_PLANE_KEY, metavar="FILE"),
    *_LIFECYCLE,
)
ORCHESTRATOR_FLAGS = (
    _PIPELINE,
    *_SERVING,
    Flag("stage_endpoint", "static replicas of a stage (repeat per stage)", repeat=True,
         metavar="NAME=HOST:PORT[,HOST:PORT]"),
    Flag("discovery", "static: --stage-endpoint flags; file: the --endpoints-file, re-read when it changes (what "
                      "omnistage serve writes as it scales); kubernetes: watch the endpoints of the stage Services "
                      f"(<pipeline>-<stage>, port {GRPC_PORT_NAME}) in --namespace",
         default="static", choices=("static", "file", "kubernetes")),
    Flag("endpoints_file", 'with --discovery file: a JSON object, stage name -> ["host:port", ...]', metavar="FILE"),
    Flag("namespace", f"namespace to watch (default ${ENV_POD_NAMESPACE} or {DEFAULT_NAMESPACE})",
         default=DEFAULT_NAMESPACE, env=ENV_POD_NAMESPACE),
    Flag("wait_for_stages", "seconds to wait at start-up for every stage replica to be SERVING", float,
         default=0.0),
    Flag("api_port", "port of the OpenAI-compatible HTTP API (0: any free port; not given: no API)", int),
    Flag("api_key", f"a bearer key both APIs (gRPC and HTTP) accept; KEY:N also allows priority up to N (repeat; "
                    f"default: ${ENV_API_KEYS}, comma-separated; none: no key needed)", repeat=True, env=ENV_API_KEYS,
         metavar="KEY[:N]"),
    Flag("client_tls_dir", f"serve the client-facing gRPC and HTTP API ports over TLS with tls.crt and tls.key "
                           f"from this folder (default ${ENV_CLIENT_TLS_DIR}; none: plaintext)",
         env=ENV_CLIENT_TLS_DIR, metavar="DIR"),
    Flag("jobs_store", f"the job API's store (/v1/videos, gRPC Jobs): sqlite:///PATH or postgresql://USER:PASS@HOST/DB "
                       f"(default ${ENV_JOBS_STORE}; none: jobs are refused)", env=ENV_JOBS_STORE, metavar="URL"),
    Flag("jobs_content", f"folder where finished jobs' content (MP4, thumbnails) is kept: shared by the replicas "
                         f"(default ${ENV_JOBS_CONTENT}; none: beside a sqlite store)", env=ENV_JOBS_CONTENT,
         metavar="DIR"),
    Flag("jobs_ttl_s", "seconds a finished job and its content are kept", float, default=86400.0),
    Flag("jobs_concurrency", "jobs this replica runs at once", int, default=2),
    Flag("jobs_max_queued_per_key", "jobs one API key may have queued at once", int, default=16),
    Flag("jobs_lease_s", "seconds a running job's lease lasts without renewal: a replica that stops renewing (dead) "
                         "has its jobs taken over this long after", float, default=10.0),
    Flag("jobs_max_attempts", "times a job is run before it fails (restarted_too_often) instead of being taken over "
                              "again: a job whose run kills its orchestrator is not passed from replica to replica "
                              "for good", int, default=3),
    *_LIFECYCLE,
)


@dataclass(frozen=True)
class ReadyPorts:
    """What a process bound, as its ready file says: the gRPC port, and the HTTP status and API ports
    when it serves them."""
    grpc: int
    http: int | None = None
    api: int | None = None


def write_ready(path: str | os.PathLike, ports: ReadyPorts) -> None:
    """Write the ready file: one line `NAME PORT` per bound port (names: grpc, http, api), e.g.

        grpc 43211
        http 43212
        api 43213

    Written to a temporary file and renamed, so a reader sees the whole file or none."""
    path = Path(path)
    text = "".join(f"{f.name} {getattr(ports, f.name)}\n" for f in fields(ports)
                   if getattr(ports, f.name) is not None)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_ready(path: str | os.PathLike) -> ReadyPorts | None:
    """The ports a ready file names; None until it is complete (absent, empty, a last line without its
    newline, a line that is not `NAME PORT`, or no grpc port). Unknown names are skipped: a newer process
    may name more ports than this reader knows."""
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    if not text.endswith("\n"):
        return None
    known = {f.name for f in fields(ReadyPorts)}
    ports: dict[str, int] = {}
    for line in text.splitlines():
        name, _, port = line.partition(" ")
        if not port.isdigit():
            return None
        if name in known:
            ports[name] = int(port)
    return ReadyPorts(**ports) if "grpc" in ports else None


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only: `localhost` (and its subdomains, which resolve to loopback by
    RFC 6761), 127.0.0.0/8, ::1, and an IPv4 loopback address mapped into IPv6 (a dual-stack socket's)."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def http_url(host: str, port: int, path: str = "") -> str:
    """`http://HOST:PORT/PATH`; an IPv6 address in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"


def drain_token_path(port: int, temp_dir: str | os.PathLike | None = None) -> Path:
    """The drain token file of the process whose HTTP status port is `port` (see DRAIN_TOKEN_DIR)."""
    import tempfile  # here: only the token's writer and the hook need it

    root = Path(temp_dir if temp_dir is not None else tempfile.gettempdir())
    return root / DRAIN_TOKEN_DIR.format(uid=os.geteuid()) / DRAIN_TOKEN_FILE.format(port=port)


def drain_self(env: Mapping[str, str] | None = None, port: int = HTTP_PORT,
               temp_dir: str | os.PathLike | None = None) -> None:
    """Ask this pod's own service for /drain and wait for the answer (the preStop hook; the kubelet bounds
    it by the grace period): a POST bearing the token the service wrote (`drain_token_path`). The service
    binds the pod IP, so the call goes there."""
    import urllib.request  # here: only the hook needs it

    env = os.environ if env is None else env
    token = drain_token_path(port, temp_dir).read_text().strip()
    request = urllib.request.Request(http_url(env.get(ENV_POD_IP) or DEFAULT_HOST, port, DRAIN_PATH), data=b"",
                                     method="POST", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request) as answer:
        answer.read()


def drain_hook_command(python: str = sys.executable) -> list[str]:
    """argv of the preStop hook (see `drain_self`)."""
    return [python, "-c", DRAIN_HOOK_CODE]


def stage_service_name(pipeline: str, stage: str) -> str:
    """The Kubernetes name of one stage's Service (and Deployment, disruption budget): `<pipeline>-<stage>`;
    the operator creates it and the orchestrator finds the stage's replicas by it."""
    return f"{pipeline}-{stage}"


def stage_command(pipeline: str | os.PathLike, stage: str, *, python: str = sys.executable,
                  **flags: Any) -> list[str]:
    """argv of one stage replica; `flags` are STAGE_FLAGS by name (None: left out)."""
    return _command(python, STAGE_MODULE, STAGE_FLAGS, pipeline=pipeline, stage=stage, **flags)


def orchestrator_command(pipeline: str | os.PathLike, *, python: str = sys.executable,
                         stage_endpoints: Mapping[str, Sequence[str]] | None = None, **flags: Any) -> list[str]:
    """argv of the orchestrator; `stage_endpoints` maps a stage to its replicas' `host:port`."""
    endpoints = [f"{stage}={','.join(addrs)}" for stage, addrs in (stage_endpoints or {}).items()] or None
    return _command(python, ORCHESTRATOR_MODULE, ORCHESTRATOR_FLAGS, pipeline=pipeline,
                    stage_endpoint=endpoints, **flags)


def stage_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    return _parser(STAGE_MODULE, "Serve one stage of an OmniPipeline.", STAGE_FLAGS, env)


def orchestrator_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    return _parser(ORCHESTRATOR_MODULE, "Serve the client API of an OmniPipeline.", ORCHESTRATOR_FLAGS, env)


def service_env(model_dir: str | os.PathLike | None = None, *, same_host: bool = False) -> dict[str, str]:
    """What a stage or orchestrator process is started with, on top of what it inherits."""
    # One torch thread per model process: with two under load, tokens/s fell 12x (DESIGN.md).
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if model_dir is not None:
        env[ENV_MODEL_DIR] = str(model_dir)
    if same_host:
        env[ENV_SAME_HOST] = "1"
    return env


def report_exit(message: str, path: str = TERMINATION_LOG) -> None:
    """Say why this process exits: on stderr, and in the termination log where the container has one."""
    print(message, file=sys.stderr, flush=True)
    if os.path.exists(path):
        try:
            with open(path, "w") as f:
                f.write(message[:4096])
        except OSError:
            pass


def model_root(root: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The model store: `root` when given, else $OMNISTAGE_MODEL_DIR, else ./models."""
    env = os.environ if env is None else env
    return Path(root or env.get(ENV_MODEL_DIR) or DEFAULT_MODEL_DIR)


def checkpoint_dir(stage: "Stage", root: str | os.PathLike | None = None,
                   env: Mapping[str, str] | None = None) -> Path:
    """The directory a stage's `model` names: absolute, or under the model store; a pvc:// or hf:// source
    where the pod mounts it or `omnistage models pull` put it (omnistage.api.model_sources)."""
    return local_path(stage.model, model_root(root, env), env)


def model_dir(stage: "Stage", root: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Path:
    """Where a stage's weights lie: its `model` (absolute, or under the model store); for a diffusers
    pipeline (`model_index.json`) the `component` sub-folder. A combined transformers checkpoint
    (Qwen-Omni) keeps every component in one set of shards, so its stages get the root."""
    path = checkpoint_dir(stage, root, env)
    if stage.component and (path / "model_index.json").exists():
        return path / stage.component
    return path


def _command(python: str, module: str, table: tuple[Flag, ...], **values: Any) -> list[str]:
    unknown = set(values) - {f.name for f in table}
    if unknown:
        raise TypeError(f"python -m {module} has no flag {', '.join(sorted(unknown))}")
    argv = [python, "-m", module]
    for f in table:
        value = values.get(f.name)
        if value is None:
            continue
        for item in (value if f.repeat else [value]):
            argv += [f.option, str(item)]
    return argv


class _Repeated(argparse.Action):
    """A repeatable flag whose default (from the environment) the flags replace instead of extending:
    argparse's own `append` would add them to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*([] if current is self.default else current), values])


def _parser(module: str, description: str, table: tuple[Flag, ...],
            env: Mapping[str, str] | None) -> argparse.ArgumentParser:
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    for f in table:
        default = (env.get(f.env) or f.default) if f.env else f.default
        kw: dict[str, Any] = {"help": f.help, "type": f.type, "metavar": f.metavar, "choices": f.choices}
        if f.repeat:
            items = [x.strip() for x in (env.get(f.env) or "").split(",")] if f.env else []
            kw.update(action=_Repeated, default=[f.type(x) for x in items if x])
        elif f.required:
            kw.update(required=True)
        else:
            kw.update(default=default)
        p.add_argument(f.option, **kw)
    return p
