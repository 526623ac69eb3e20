"""The orchestrator's OpenAI-compatible API port as plumbing: the process writes every port it bound to its
ready file and serves each; a drain lets admitted work that did not come over gRPC finish before the API
port closes. (What the API answers is tests/integration/test_http_api.py's.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

from omnistage.client import build_request
from omnistage.contract import launch
from orchestrator_service.server import OrchestratorServer

from ..conftest import REPO
from ..harness import example, stage_servers, write_pipeline
from ..polling import wait_until, wait_until_sync

TOKENS = 48   # long enough on the tiny LM that a drain starts while the request is in flight


def status_of(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status


def closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except OSError:
        return True


def llm_on_transformers(doc):
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    doc["spec"]["deployment"]["stages"]["llm"]["engineArgs"] = {}


@contextlib.contextmanager
def orchestrator_process(tmp_path: Path, **flags):
    """`python -m orchestrator_service` of llm-tiny with `flags`: yields (its ready ports, its log file). No
    stage is needed to serve the ports: the static endpoint points nowhere, and nothing waits for it."""
    path = write_pipeline(example("llm-tiny"), tmp_path / "llm.yaml")
    ready_file, log = tmp_path / "orchestrator.ready", tmp_path / "orchestrator.log"
    argv = launch.orchestrator_command(path, port=0, ready_file=ready_file, stage_endpoints={"llm": ["127.0.0.1:1"]},
                                       **flags)
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **launch.service_env()}, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    try:
        def ready():
            assert proc.poll() is None, log.read_text()
            return launch.read_ready(ready_file)

        yield wait_until_sync(ready, 60, 0.05, what="orchestrator ready", detail=log.read_text), log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_orchestrator_process_writes_and_serves_its_grpc_status_and_api_ports(tmp_path):
    with orchestrator_process(tmp_path, http_port=0, api_port=0) as (ports, log):
        assert None not in (ports.http, ports.api) and len({ports.grpc, ports.http, ports.api}) == 3
        status = launch.http_url("127.0.0.1", ports.http)
        for path in (launch.METRICS_PATH, launch.READY_PATH, launch.LIVE_PATH):
            assert status_of(status + path) == 200
        api = launch.http_url("127.0.0.1", ports.api, launch.API_PATH)
        assert status_of(api + "/models") == 200
        assert f"OpenAI API on {api}" in log.read_text()
    assert closed(ports.api) and closed(ports.grpc)   # the process exited 0 on SIGTERM


def test_without_an_api_port_no_api_is_served(tmp_path):
    with orchestrator_process(tmp_path) as (ports, log):
        assert ports == launch.ReadyPorts(ports.grpc)
        assert "OpenAI API" not in log.read_text()


async def test_drain_lets_admitted_work_off_grpc_finish_before_the_api_closes(model_dir):
    pipeline = example("llm-tiny", llm_on_transformers)
    async with stage_servers(pipeline, model_dir) as stages:
        orc = OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stages['llm'].port}"]}, api_port=0)
        await orc.start(wait_for_stages=60)
        try:
            api = launch.http_url("127.0.0.1", orc.api_port, launch.API_PATH)
            assert await asyncio.to_thread(status_of, api + "/models") == 200
            events: list[str] = []

            async def as_the_http_front_door_sends_it():
                request = build_request("Hello there", max_tokens=TOKENS, ignore_eos=True)
                async for ev in orc.servicer.generate(request):
                    events.append(ev.WhichOneof("event"))

            request = asyncio.create_task(as_the_http_front_door_sends_it())
            await wait_until(lambda: events, 60, 0.01, what="first event")
            assert orc.servicer.admission.inflight == 1
        finally:
            await orc.drain()
        # No gRPC call was in flight, so server.stop alone would have returned at once and closed the router
        # under the request: it finished in full instead, and only then did the API port close.
        assert request.done() and request.exception() is None
        assert events[-1] == "final" and events.count("text") >= 1
        assert closed(orc.api_port)
        orc.close()
