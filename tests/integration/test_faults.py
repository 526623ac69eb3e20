"""Faults a replica cannot report by itself, on a real tiny LM stage behind a real orchestrator: an engine
step that never returns fails /livez (the kubelet restarts the container), and requests whose caller set
no deadline end at the pipeline's requestTimeoutSeconds, admitted or still waiting, instead of hanging."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

import grpc

from omnistage.client import AsyncOmniClient
from omnistage.contract import launch
from orchestrator_service.server import OrchestratorServer

from ..harness import example, start_stage
from ..polling import wait_until

REQUEST_TIMEOUT_S = 3.0
STALL_S = 1.0


def hangable_lm(doc):
    """The tiny LM on the transformers engine, one request at a time, short deadline and stall bounds."""
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    doc["spec"]["topology"]["limits"] = {"defaultMaxTokens": 4, "maxTokens": 8,
                                         "requestTimeoutSeconds": REQUEST_TIMEOUT_S}
    doc["spec"]["deployment"]["orchestrator"] = {"maxInflight": 1, "maxQueued": 4}
    doc["spec"]["deployment"]["stages"]["llm"]["scheduler"] = {"maxBatch": 1, "stallSeconds": STALL_S}


def hang_steps(engine) -> threading.Event:
    """From now on each step of the engine waits for the event returned: a hung kernel, until it is set."""
    gate = threading.Event()
    real = engine.scheduler.step_fn

    def step(states):
        gate.wait(120)
        return real(states)

    engine.scheduler.step_fn = step
    return gate


def livez(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(launch.http_url("127.0.0.1", port, launch.LIVE_PATH), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def test_a_hung_step_fails_livez_and_requests_without_a_deadline_end_at_the_default(model_dir):
    pipeline = example("llm-tiny", hangable_lm)
    stage = await start_stage(pipeline, "llm", model_dir, http_port=0)
    orc = OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]})
    gate = None
    try:
        await orc.start(wait_for_stages=60)
        http = stage.http.port
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            await client.generate("warm up", timeout=60)
            assert await asyncio.to_thread(livez, http) == (200, "ok\n")
            gate = hang_steps(stage.engine)
            t0 = time.monotonic()
            # No deadline from the caller: the first is admitted and hangs in the stage, the second waits for
            # admission behind it (maxInflight 1).
            results = await asyncio.gather(client.generate("first"), client.generate("second"),
                                           return_exceptions=True)
            took = time.monotonic() - t0
        assert all(isinstance(r, grpc.aio.AioRpcError) for r in results), results
        # (Which timer fires first, the stage's, the stage call's or admission's, decides the message.)
        assert [r.code() for r in results] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2, \
            [(r.code(), r.details()) for r in results]
        assert REQUEST_TIMEOUT_S - 0.5 < took < REQUEST_TIMEOUT_S + 20
        # The step the first request is in still has not returned: the stage is not live.
        code, body = await wait_until(lambda: (r := livez(http))[0] == 503 and r, 30, what="/livez 503")
        assert body.startswith("not live: stage llm: an engine step has been running for") and body.count("\n") == 1
        gate.set()  # the step returns: the stage makes progress again
        await wait_until(lambda: livez(http) == (200, "ok\n"), 30, what="/livez 200 again")
        await wait_until(lambda: stage.engine.unfinished() == 0 and not orc.servicer.runs, 30,
                         what="nothing left after the deadline")
    finally:
        if gate is not None:
            gate.set()
        await orc.drain()
        orc.close()
        await stage.drain()
        stage.close()
