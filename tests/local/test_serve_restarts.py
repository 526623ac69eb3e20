"""`omnistage serve` restarts a process that dies, as a Deployment does: one of two Talker replicas killed
under load takes nothing down. Its calls complete on the other replica, new requests are served, serve says
what happened in one line per event, and the replica comes back into the orchestrator's endpoints. Real
processes, the tiny Qwen3-Omni pipeline (text and audio out)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import urllib.request
from pathlib import Path

import psutil
import yaml

from omnistage.client import OmniClient

from ..conftest import EXAMPLES
from ..polling import wait_until_sync
from .test_cli_serve import Served

CLIENTS = 3       # requests kept in flight: both Talker replicas have work when one is killed
REQUEST = dict(max_tokens=8, max_codec_frames=25, timeout=180)
AFTER_KILL = 6    # requests that must complete after the kill (while the replica is gone or coming back)


def running(port: int) -> int:
    """Calls a stage replica is running now, as it says."""
    import grpc

    from omnistage.v1 import stage_pb2, stage_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return stage_pb2_grpc.StageServiceStub(ch).GetLoad(stage_pb2.GetLoadRequest(), timeout=5).running


def retries(served: Served, stage: str) -> float:
    """The orchestrator's count of a stage's calls retried on another replica."""
    url = served.wait_for(r"  orchestrator\s+(http://\S+/metrics)", 5)
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf'^omnistage_stage_retries_total{{[^}}]*stage="{stage}"[^}}]*}} (\S+)$',
                                            text, re.M))


def test_a_killed_replica_of_two_fails_no_request_and_comes_back(model_dir, tmp_path):
    # --no-tls: the test asks the replica itself (GetLoad) whether it holds a call before killing it
    served = Served("qwen3-omni-tiny", model_dir, tmp_path, "--replicas", "talker=2", "--no-api", "--no-tls")
    talker_port = int(served.wait_for(r"stage talker\[1\]: ready on 127\.0\.0\.1:(\d+)", 5))
    stop, failures, done = threading.Event(), [], []

    def client():
        with OmniClient(served.endpoint) as c:
            while not stop.is_set():
                try:
                    r = c.generate("say something", **REQUEST)
                    done.append((r.text, len(r.pcm)))
                except Exception as e:  # noqa: BLE001 - any failure is what the test reports
                    failures.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        wait_until_sync(lambda: len(done) >= CLIENTS, 300, 0.1, what="steady load")
        wait_until_sync(lambda: running(talker_port) > 0, 120, 0.01, what="a call on stage talker[1]")
        victim = served.processes["stage talker[1]"]
        os.kill(victim, signal.SIGKILL)
        killed_at = len(done)
        served.wait_for(rf"(stage talker\[1\] \(pid {victim}\) exited with code -9 while serving; out of service, "
                        rf"restart 1 in 1s)", 60)
        served.wait_for(r"(stage talker\[1\]: restarted \(pid \d+\))", 60)
        back = served.wait_for(r"(stage talker\[1\]: ready on 127\.0\.0\.1:\d+ after [\d.]+s, in service)", 300)
        wait_until_sync(lambda: len(done) >= killed_at + AFTER_KILL, 300, 0.1, what="requests after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join(240)
    assert failures == []
    assert all(text and pcm for text, pcm in done)
    assert retries(served, "talker") >= 1   # the call the replica held completed on the other one
    # the replacement is in the orchestrator's endpoints again, on the port it now serves, beside the other one
    port = re.search(r":(\d+) after", back).group(1)
    endpoints = json.loads((tmp_path / "logs-qwen3-omni-tiny" / "endpoints.json").read_text())
    assert len(endpoints["talker"]) == 2 and f"127.0.0.1:{port}" in endpoints["talker"]
    with OmniClient(served.endpoint) as c:   # and serve still serves
        assert c.generate("and now?", **REQUEST).pcm
    assert served.proc.poll() is None and not psutil.pid_exists(victim)
    assert served.stop() == 0


def llm_on_transformers(tmp_path) -> Path:
    doc = yaml.safe_load((EXAMPLES / "llm-tiny.yaml").read_text())
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    path = tmp_path / "llm-tiny.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_killed_orchestrator_is_restarted_on_the_address_clients_were_given(model_dir, tmp_path):
    served = Served(llm_on_transformers(tmp_path), model_dir, tmp_path, "--no-api", "--no-tls")
    orchestrator = served.processes["orchestrator"]
    os.kill(orchestrator, signal.SIGKILL)
    served.wait_for(rf"(orchestrator \(pid {orchestrator}\) exited with code -9 while serving; restart 1 in 1s)", 60)
    served.wait_for(rf"(orchestrator: ready again on {re.escape(served.endpoint)} after [\d.]+s)", 300)
    with OmniClient(served.endpoint) as c:
        assert c.generate("hello", max_tokens=4, timeout=120).token_ids
    assert served.stop() == 0
