"""Shared test fixtures. Kept free of tool checks so unit tests run anywhere."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import grpc.aio
import pytest

from omnistage.contract import launch

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

# In-process stages run as a stage process would, all on this host as under `omnistage serve`: `auto`
# edges may use shared memory. Processes the tests start inherit this.
for key, value in launch.service_env(REPO / "models", same_host=True).items():
    os.environ.setdefault(key, value)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UCX_TLS", "tcp")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny models (`make models` builds them); tests that need models fail loudly without them."""
    from omnistage.tiny_models.build import MODELS, is_current

    d = launch.model_root()
    stale = [name for name in MODELS if not is_current(d / name)]
    if stale:
        pytest.fail(f"tiny models missing or stale in {d} ({', '.join(stale)}): run `make models` "
                    f"(or `.venv/bin/omnistage models build {d}`)")
    return d


# Every gRPC server a test starts must be stopped by it. One left running outlives the event loop, and
# at interpreter exit grpc's clean-up of it blocks forever (the whole run then hangs after its last
# test). So servers are tracked: a leaked one is stopped here and the run fails, naming the test.
_SERVERS: list[tuple[str, object, dict]] = []
_CURRENT_TEST = ["(collection)"]


def _tracking_server(make):
    def server(*args, **kwargs):
        srv = make(*args, **kwargs)
        state = {"stopped": False}
        stop = srv.stop

        async def tracked_stop(grace=None):
            state["stopped"] = True
            return await stop(grace)

        srv.stop = tracked_stop
        _SERVERS.append((_CURRENT_TEST[0], srv, state))
        return srv
    return server


grpc.aio.server = _tracking_server(grpc.aio.server)


def pytest_runtest_setup(item):
    _CURRENT_TEST[0] = item.nodeid


@pytest.fixture(scope="session", autouse=True)
async def _no_leaked_grpc_servers():
    yield
    leaked = [test for test, _, state in _SERVERS if not state["stopped"]]
    for _, srv, state in _SERVERS:
        if not state["stopped"]:
            await srv.stop(0)
    _SERVERS.clear()
    if leaked:
        pytest.fail(f"gRPC servers left running by: {', '.join(sorted(set(leaked)))}")


@pytest.fixture(scope="module", autouse=True)
async def _close_sdk_clients():
    """The OpenAI SDK clients a module's tests made, closed once it ends (tests/sdk_clients.py: why never
    left to the garbage collector)."""
    yield
    from .sdk_clients import close_all

    await close_all()
