"""Faults benchmark: requests lost and latency paid when a replica goes away under steady load.

The Qwen3-Omni tiny example (Thinker -> Talker -> Code2Wav, tiny random weights: cheap enough for a CPU)
with 2 replicas of every stage, each its own process (`python -m stage_service`), the orchestrator its
own process too, tensors by reference as on a cluster (Thinker -> Talker over UCX, Talker -> Code2Wav
over shared memory). A closed loop of clients sends requests back to back, text and audio out.

- kill_one_of_two: after a steady window, SIGKILL one Talker replica; requests failed over the whole run
  (goal 0) and p99 latency of the requests started in the window after the kill over that of the steady
  window. The Talker is the stage whose output never reaches the client itself, so every call caught by
  the kill can be retried (a stage whose output the client already saw is not: docs/faults.md).
- rollout_under_load: restart every Talker replica one at a time as a rollout does (SIGTERM: drain, exit;
  start the new one on the same address; the next only once the new one serves requests); requests
  failed (goal 0).

    .venv/bin/python bench/faults.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml
from common import figure, finish, percentile, print_table

from omnistage.client import build_request
from omnistage.contract import launch
from omnistage.v1 import orchestrator_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
STAGES = ("thinker", "talker", "code2wav")
KILLED = "talker"
REPLICAS = 2
CONCURRENCY = 4
REQUEST = dict(max_tokens=8, max_codec_frames=25)


def pipeline_doc() -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "qwen3-omni-tiny.yaml").read_text())
    stages = {s["name"]: s for s in doc["spec"]["topology"]["stages"]}
    stages["talker"]["inputs"][0]["transport"] = "ucx"
    stages["code2wav"]["inputs"][0]["transport"] = "shm"
    for s in STAGES:
        doc["spec"]["deployment"]["stages"][s]["replicas"] = REPLICAS
    return doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout: float, what: str, log: Path | None = None):
    end = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > end:
            raise RuntimeError(f"{what}: not within {timeout:.0f}s" + (f"\n{log.read_text()[-3000:]}" if log else ""))
        time.sleep(0.1)
    return value


class Replica:
    """One stage replica process on a fixed address, so a restart comes back where the orchestrator looks."""

    def __init__(self, pipeline: Path, stage: str, index: int, tmp: Path):
        self.pipeline, self.stage, self.tmp = pipeline, stage, tmp
        self.name = f"{stage}-{index}"
        self.port, self.http_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        self.ready = self.tmp / f"{self.name}.{self.starts}.ready"
        self.log = self.tmp / f"{self.name}.{self.starts}.log"
        argv = launch.stage_command(self.pipeline, self.stage, port=self.port, http_port=self.http_port,
                                    model_dir=MODELS, ready_file=self.ready, log_level="WARNING")
        env = {**os.environ, **launch.service_env(MODELS, same_host=True), "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            return launch.read_ready(self.ready)
        wait_for(ready, timeout, f"{self.name} ready")

    def served(self) -> float:
        """Requests this process has ended so far (its /metrics)."""
        try:
            url = launch.http_url("127.0.0.1", self.http_port, launch.METRICS_PATH)
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return 0.0
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("omnistage_stage_requests_total"))

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def drain(self, timeout: float = 120) -> int:
        """SIGTERM, as the kubelet does at a rollout; waits for the exit."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


class Rig:
    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-faults-"))
        self.pipeline = self.tmp / "pipeline.yaml"
        self.pipeline.write_text(yaml.safe_dump(pipeline_doc(), sort_keys=False))
        self.replicas = {s: [Replica(self.pipeline, s, i, self.tmp) for i in range(REPLICAS)] for s in STAGES}
        self.orc: subprocess.Popen | None = None

    def start(self) -> None:
        for rs in self.replicas.values():
            for r in rs:
                r.start()
        for rs in self.replicas.values():
            for r in rs:
                r.wait_ready()
        ready = self.tmp / "orc.ready"
        argv = launch.orchestrator_command(self.pipeline, port=0, ready_file=ready, log_level="WARNING",
                                           wait_for_stages=120,
                                           stage_endpoints={s: [r.address for r in rs]
                                                            for s, rs in self.replicas.items()})
        self.orc_log = self.tmp / "orc.log"
        self.orc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **launch.service_env()},
                                    stdout=open(self.orc_log, "w"), stderr=subprocess.STDOUT)
        ports = wait_for(lambda: launch.read_ready(ready), 180, "orchestrator ready", self.orc_log)
        self.endpoint = f"127.0.0.1:{ports.grpc}"

    def close(self) -> None:
        procs = [self.orc] + [r.proc for rs in self.replicas.values() for r in rs]
        for p in procs:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in procs:
            if p is not None:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


@dataclass
class Outcome:
    started: float
    ended: float
    error: str = ""
    retried: bool = False  # some stage of it took more than one attempt (its trace says)

    @property
    def ms(self) -> float:
        return (self.ended - self.started) * 1e3


class Load:
    """A closed loop: CONCURRENCY clients, each sending the next request when the last ended."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Load":
        self._channel = grpc.aio.insecure_channel(self.endpoint)
        stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)

        async def client(i: int):
            n = 0
            while not self._stop.is_set():
                n += 1
                req = build_request("Tell me a story", return_trace=True, **REQUEST)
                t0 = time.perf_counter()
                try:
                    retried = False
                    async for ev in stub.Generate(req, timeout=120):
                        if ev.WhichOneof("event") == "final":
                            retried = any(st.attempts > 1 for st in ev.final.trace.stages)
                    self.outcomes.append(Outcome(t0, time.perf_counter(), retried=retried))
                except grpc.aio.AioRpcError as e:
                    self.outcomes.append(Outcome(t0, time.perf_counter(), f"{e.code().name}: {e.details()}"))

        self._task = asyncio.gather(*(client(i) for i in range(CONCURRENCY)))
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await self._task
        await self._channel.close()

    def window(self, t0: float, t1: float) -> list[Outcome]:
        return [o for o in self.outcomes if t0 <= o.started < t1]

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]


async def kill_one_of_two(rig: Rig, window_s: float) -> tuple[list[dict], dict]:
    async with Load(rig.endpoint) as load:
        await asyncio.sleep(window_s / 2)  # warm: every replica has served
        t0 = time.perf_counter()
        await asyncio.sleep(window_s)
        victim = rig.replicas[KILLED][0]
        t_kill = time.perf_counter()
        victim.kill()
        await asyncio.sleep(window_s)
    steady = [o.ms for o in load.window(t0, t_kill) if not o.error]
    fault = [o.ms for o in load.window(t_kill, t_kill + window_s) if not o.error]
    p99s, p99f = percentile(steady, 99), percentile(fault, 99)
    figures = [figure("faults.kill_one_of_two.failed_requests", len(load.failed), "requests"),
               figure("faults.kill_one_of_two.requests", len(load.outcomes), "requests"),
               figure("faults.kill_one_of_two.retried_requests", sum(o.retried for o in load.outcomes), "requests"),
               figure("faults.kill_one_of_two.steady_p99_ms", p99s, "ms"),
               figure("faults.kill_one_of_two.fault_p99_ms", p99f, "ms"),
               figure("faults.kill_one_of_two.p99_latency_over_steady", p99f / p99s, "ratio")]
    # Bring the killed replica back for the next scenario (a kubelet restart).
    victim.start()
    victim.wait_ready()
    return figures, {"kill_errors": sorted({o.error for o in load.failed})[:5]}


async def rollout_under_load(rig: Rig, settle_s: float) -> tuple[list[dict], dict]:
    async with Load(rig.endpoint) as load:
        await asyncio.sleep(settle_s)
        for r in rig.replicas[KILLED]:
            code = await asyncio.to_thread(r.drain)
            if code != 0:
                raise RuntimeError(f"{r.name} drained with exit code {code}:\n{r.log.read_text()[-3000:]}")
            r.start()
            await asyncio.to_thread(r.wait_ready)
            # As a rollout waits for the new pod to be ready, wait for the orchestrator to route to it.
            await asyncio.to_thread(wait_for, lambda: r.served() > 0, 120, f"{r.name} serving again", r.log)
        await asyncio.sleep(settle_s)
    return ([figure("faults.rollout_under_load.failed_requests", len(load.failed), "requests"),
             figure("faults.rollout_under_load.requests", len(load.outcomes), "requests"),
             figure("faults.rollout_under_load.retried_requests", sum(o.retried for o in load.outcomes), "requests")],
            {"rollout_errors": sorted({o.error for o in load.failed})[:5]})


async def main(quick: bool) -> None:
    started = time.perf_counter()
    rig = Rig()
    figures, extra = [], {"quick": quick, "pipeline": "qwen3-omni-tiny", "replicas_per_stage": REPLICAS,
                          "concurrency": CONCURRENCY, "killed_stage": KILLED, "request": REQUEST,
                          "tls": "off (plaintext hops)",
                          "transports": {"thinker->talker": "ucx", "talker->code2wav": "shm"}}
    try:
        rig.start()
        for part, arg in ((kill_one_of_two, 10.0 if quick else 30.0), (rollout_under_load, 3.0 if quick else 10.0)):
            got, info = await part(rig, arg)
            print_table(part.__name__, got)
            figures += got
            extra.update(info)
    finally:
        rig.close()
    finish("faults", figures, started, extra)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter windows")
    sys.exit(asyncio.run(main(ap.parse_args().quick)))
