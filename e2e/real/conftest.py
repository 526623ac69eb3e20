"""Fixtures of the real-container scenarios: a cluster whose node is a kubelet with containerd and runc
running the project image (e2e/harness.py, node="real"), inside a private network namespace. Run them
as scripts/run_tests.sh does:

    e2e/cluster/in-netns.sh .venv/bin/python -m pytest e2e/real

The operator fixture is e2e/conftest.py's, on this cluster. Needs root (containerd, runc, cgroups), the tiny
models, the binaries of e2e/cluster/build.sh and the image of `make image` (both built on first use and cached
in ~/.cache/omnistage)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ..conftest import NS, models_readable_by_pods
from ..harness import REPO, Cluster, running
from .first_answer import private_network

RUN = Path(os.environ.get("OMNISTAGE_E2E_REAL_RUN", REPO / "e2e" / ".run" / "real"))


@pytest.fixture(scope="session")
def cluster():
    if os.geteuid() != 0:
        pytest.fail("a real node needs root (containerd, runc, cgroups)")
    if not private_network():
        pytest.fail("the real-container scenarios run in a private network namespace: "
                    "e2e/cluster/in-netns.sh .venv/bin/python -m pytest e2e/real")
    models_readable_by_pods()
    with running(Cluster(RUN, node="real"), NS) as c:
        print(f"[e2e-real] {c.image}: {c.timings}")
        yield c

