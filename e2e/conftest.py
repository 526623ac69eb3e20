"""Fixtures of the end-to-end suite: one real Kubernetes v1.20.2 control plane and node agent per
session (e2e/harness.py), the operator running against it as its own user, and the namespaces the
scenarios use. Needs root (mount namespaces for pods), the tiny models, and the cached binaries
(e2e/cluster/build.sh builds them on first use, about 9-12 minutes)."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest

from .harness import REPO, Cluster, running
from .real.first_answer import private_network

RUN = Path(os.environ.get("OMNISTAGE_E2E_RUN", REPO / "e2e" / ".run" / "pytest"))
# The real-container scenarios run in a private network namespace of their own (e2e/real/conftest.py);
# scripts/run_tests.sh runs them after these.
collect_ignore = [] if private_network() else ["real"]
MODELS = REPO / "models"
NS = "omnistage-e2e"          # the session operator serves this namespace
HELM_NS = "omnistage-helm"    # the chart-installed operator serves this one
POD_UID = 1000                # stage pods run as this user (OMNISTAGE_RUN_AS_USER)


def models_readable_by_pods() -> None:
    """Pods run as uid 1000 and read the model store through a read-only hostPath volume: it must be
    world-readable. `omnistage models build` writes safetensors 0600 today, so open them up here."""
    if not (MODELS / "qwen3-omni-tiny" / "config.json").exists():
        pytest.fail(f"tiny models missing in {MODELS}: run `make models` first")
    closed = [p for p in MODELS.rglob("*") if not p.stat().st_mode & stat.S_IROTH]
    for p in closed:
        p.chmod(p.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0))
    if closed:
        print(f"[e2e] made {len(closed)} model files readable by the pods' uid {POD_UID}")


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# scripts/run_tests.sh bounds a run with `timeout`, which ends it with SIGTERM: tear the clusters down as on
# Ctrl-C (pytest runs the session fixtures' teardown), not leave their processes and containers behind.
signal.signal(signal.SIGTERM, _interrupted)


@pytest.fixture(scope="session")
def cluster():
    if os.geteuid() != 0:
        pytest.fail("the e2e node agent needs root (a mount namespace per pod)")
    models_readable_by_pods()
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
           "UCX_TLS": "tcp"}
    # Extra environment for every pod, for debugging: OMNISTAGE_E2E_POD_ENV="KEY=VALUE;KEY2=VALUE2".
    env.update(item.split("=", 1) for item in os.environ.get("OMNISTAGE_E2E_POD_ENV", "").split(";") if "=" in item)
    with running(Cluster(RUN, agent_env=env), NS) as c:
        yield c


@pytest.fixture(scope="session")
def operator(cluster):
    """The operator of this session, watching NS, with the managed validating webhook."""
    cluster.start_operator([NS])
    yield cluster
    cluster.stop_operator()
