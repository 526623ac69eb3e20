"""A stage's life as a process (`python -m stage_service`): SIGTERM under load drains (admitted work
completes, new work gets UNAVAILABLE, exit 0 within the bound); an engine that breaks makes the
process exit non-zero; a stop while loading never serves; a bad engineArgs key refuses to start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnistage.api import parse_pipeline
from omnistage.contract import launch
from stage_service.runtime.faults import ENV_INJECT_STEP_FAILURE
from stage_service.server import EXIT_ENGINE_DEAD, StageServer

from ..conftest import EXAMPLES, REPO
from ..harness import call_stage, header, token_ids
from ..polling import wait_until
from .test_stage_support import load

DRAIN_SECONDS = 30
TOKENS = 256


def lm_pipeline_file_text(**engine_args) -> str:
    """llm-tiny on the transformers engine, two requests at a time."""
    doc = yaml.safe_load((EXAMPLES / "llm-tiny.yaml").read_text())
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    doc["spec"]["deployment"]["stages"]["llm"]["scheduler"] = {"maxBatch": 2, "maxQueued": 16}
    doc["spec"]["deployment"]["stages"]["llm"]["engineArgs"].update(engine_args)
    return yaml.safe_dump(doc)


def lm_pipeline_file(tmp_path: Path, **engine_args) -> Path:
    path = tmp_path / "llm.yaml"
    path.write_text(lm_pipeline_file_text(**engine_args))
    return path


class StageProcess:
    def __init__(self, tmp_path: Path, model_dir: Path, flags: dict | None = None, env: dict | None = None,
                 **engine_args):
        self.ready_file = tmp_path / "ready"
        self.log = open(tmp_path / "stage.log", "w+")
        argv = launch.stage_command(lm_pipeline_file(tmp_path, **engine_args), "llm", port=0,
                                    ready_file=self.ready_file, drain_seconds=DRAIN_SECONDS, **(flags or {}))
        self.proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **launch.service_env(model_dir), **(env or {})},
                                     stdout=self.log, stderr=subprocess.STDOUT)

    async def start(self) -> int:
        await wait_until(lambda: launch.read_ready(self.ready_file) or self.proc.poll() is not None, 120, 0.1,
                         "stage ready")
        assert self.proc.poll() is None, self.output()
        return launch.read_ready(self.ready_file).grpc

    async def exit_code(self, timeout: float) -> int:
        await wait_until(lambda: self.proc.poll() is not None, timeout, 0.05, "process exit")
        return self.proc.returncode

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.mark.slow
async def test_sigterm_under_load_finishes_admitted_work_refuses_new_and_exits_0(tmp_path, model_dir):
    stage = StageProcess(tmp_path, model_dir)
    try:
        port = await stage.start()
        calls = [asyncio.create_task(call_stage(port, header(f"r{i}", max_tokens=TOKENS, ignore_eos=True)))
                 for i in range(8)]
        loaded = {}

        async def all_admitted():  # maxBatch 2: two run, six wait
            loaded["l"] = await load(port)
            return (loaded["l"].running, loaded["l"].queued, loaded["l"].max_running) == (2, 6, 2)

        async def draining():
            return (await load(port)).draining

        await wait_until(all_admitted, 60, what="all admitted", detail=lambda: loaded)
        stage.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        await wait_until(draining, 10, what="reported draining")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call_stage(port, header("late", max_tokens=4))
        assert (refused.value.code() == grpc.StatusCode.UNAVAILABLE
                and "stage llm is draining" in refused.value.details())
        assert any(not c.done() for c in calls)  # the refusal came while admitted work still ran

        results = await asyncio.wait_for(asyncio.gather(*calls), DRAIN_SECONDS)
        assert [len(token_ids(r)) for r in results] == [TOKENS] * 8
        assert all(r[-1].end_of_stream and r[-1].finish_reason == "length" for r in results)
        assert await stage.exit_code(DRAIN_SECONDS + 15) == 0, stage.output()
        assert time.monotonic() - t_term < DRAIN_SECONDS + 15
        assert "draining" in stage.output()
    finally:
        stage.kill()


async def test_prestop_drain_is_answered_after_admitted_work_then_the_process_exits_0(tmp_path, model_dir):
    """What a kubelet's preStop hook does: POST /drain with the process's drain token blocks until admitted
    work is done, gets its 200 (the HTTP port stays up until then), and the process exits 0 by itself."""
    import socket
    import urllib.request

    with socket.socket() as s:  # a free port for the HTTP status server
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    stage = StageProcess(tmp_path, model_dir, {"http_port": http_port})
    try:
        port = await stage.start()
        call = asyncio.create_task(call_stage(port, header("admitted", max_tokens=64, ignore_eos=True)))
        await wait_until(lambda: call.done() or stage_running(port), 30, 0.02, "request running")

        def drain():
            token = launch.drain_token_path(http_port).read_text().strip()
            url = f"http://127.0.0.1:{http_port}{launch.DRAIN_PATH}"
            request = urllib.request.Request(url, data=b"", method="POST", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=DRAIN_SECONDS + 10) as r:
                return r.status, r.read()

        status, body = await asyncio.to_thread(drain)
        assert (status, body) == (200, b"drained\n")
        assert call.done() and len(token_ids(call.result())) == 64  # answered only once the work was done
        assert await stage.exit_code(15) == 0, stage.output()
    finally:
        stage.kill()


def stage_running(port: int) -> bool:
    from omnistage.v1 import stage_pb2, stage_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return stage_pb2_grpc.StageServiceStub(ch).GetLoad(stage_pb2.GetLoadRequest(), timeout=5).running > 0


@pytest.mark.slow
async def test_a_broken_engine_makes_the_process_exit_non_zero(tmp_path, model_dir):
    # Every step after the third raises (the test fault hook, switched on by the environment), and one failed
    # step is enough to declare the engine dead.
    stage = StageProcess(tmp_path, model_dir, env={ENV_INJECT_STEP_FAILURE: "3"}, max_failed_steps=1)
    try:
        port = await stage.start()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call_stage(port, header("r", max_tokens=50, ignore_eos=True), timeout=60)
        assert failed.value.code() == grpc.StatusCode.INTERNAL and "stage llm: engine failed" in failed.value.details()
        assert await stage.exit_code(30) == EXIT_ENGINE_DEAD, stage.output()
        assert "engine failed for good" in stage.output()
    finally:
        stage.kill()


async def test_stop_while_loading_never_serves_and_stops_cleanly(model_dir):
    pipeline = parse_pipeline(yaml.safe_load(lm_pipeline_file_text()))
    srv = StageServer(pipeline, "llm", "127.0.0.1", 0, model_root=str(model_dir))
    loading, release = threading.Event(), threading.Event()
    original = srv.engine.load

    def slow_load():  # the real load, held at its start until the test has asked the stage to stop
        loading.set()
        release.wait(30)
        original()

    srv.engine.load = slow_load
    start = asyncio.create_task(srv.start())
    try:
        await wait_until(loading.is_set, 30, what="loading")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            seen = [(await watch.read()).status]
            drain = asyncio.create_task(srv.drain())  # SIGTERM's handler, while the model loads
            release.set()
            await asyncio.wait_for(asyncio.gather(start, drain), 30)
            with contextlib.suppress(grpc.aio.AioRpcError):
                while (update := await watch.read()) is not grpc.aio.EOF:  # ends when the server stops
                    seen.append(update.status)
        assert health_pb2.HealthCheckResponse.SERVING not in seen
        assert srv.stopped.is_set() and not srv.ready and srv.exit_code == 0
    finally:
        release.set()


async def test_an_unknown_engine_arg_refuses_to_start_naming_the_field(tmp_path, model_dir):
    stage = StageProcess(tmp_path, model_dir, bogus_knob=1)
    try:
        assert await stage.exit_code(60) == 2
        assert "spec.deployment.stages.llm.engineArgs: unknown key(s) bogus_knob" in stage.output()
    finally:
        stage.kill()
