"""Orchestrator benchmark: throughput against the bottleneck stage's capacity, added latency per hop,
descriptors routed per second on one core, and behaviour at 3x overload.

The stages MODEL a known service time on purpose (bench/modeled_stage.py: batch b, hold t seconds),
so the theoretical throughput min over stages of (replicas x batch / service time) is known exactly
and only the orchestrator is measured. The orchestrator runs as its own process
(`python -m orchestrator_service`), as in production; the load generator is this process.

    .venv/bin/python bench/orchestrator.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil
import yaml

from common import figure, percentile, print_table, write_results

from omnistage import launch  # noqa: E402
from omnistage.client import build_request  # noqa: E402
from omnistage.v1 import orchestrator_pb2_grpc, stage_pb2, stage_pb2_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def pipeline_doc(name: str, stages: dict, max_inflight: int, max_queued: int) -> dict:
    names = list(stages)
    topo = []
    for i, s in enumerate(names):
        # Served by bench/modeled_stage.py; declared as a plain LM chain so that validation accepts it.
        st = {"name": s, "kind": "ar", "engine": "transformers", "model": "modeled", "emits": ["text", "tokens"]}
        if i:
            st["inputs"] = [{"stage": names[i - 1]}]
        topo.append(st)
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": name},
            "spec": {"topology": {"stages": topo, "outputs": [{"modality": "text", "stage": names[-1]}]},
                     "deployment": {"orchestrator": {"maxInflight": max_inflight, "maxQueued": max_queued},
                                    "stages": {s: {"replicas": v["replicas"],
                                                   "scheduler": {"maxBatch": v["batch"],
                                                                 "maxQueued": v.get("max_queued", 2 * v["batch"])}}
                                               for s, v in stages.items()}}}}


class Rig:
    """Modeled stages in one process, the orchestrator in another (optionally pinned to one core)."""

    def __init__(self, name: str, stages: dict, max_inflight: int = 1024, max_queued: int = 4096,
                 pin_core: int | None = None):
        self.tmp = Path(tempfile.mkdtemp(prefix=f"bench-orc-{name}-"))
        self.stages_proc = subprocess.Popen([PY, str(ROOT / "bench" / "modeled_stage.py"), json.dumps(stages)],
                                            stdout=subprocess.PIPE, text=True)
        self.ports = json.loads(self.stages_proc.stdout.readline())
        path = self.tmp / "pipeline.yaml"
        path.write_text(yaml.safe_dump(pipeline_doc(name, stages, max_inflight, max_queued)))
        ready = self.tmp / "orc.ready"
        argv = launch.orchestrator_command(
            path, port=0, ready_file=ready, log_level="WARNING", wait_for_stages=30,
            stage_endpoints={s: [f"127.0.0.1:{p}" for p in ports] for s, ports in self.ports.items()})
        pre = (lambda: os.sched_setaffinity(0, {pin_core})) if pin_core is not None else None
        self.orc = subprocess.Popen(argv, cwd=ROOT, preexec_fn=pre, stdout=open(self.tmp / "orc.log", "w"),
                                    stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while launch.read_ready(ready) is None:
            if self.orc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"orchestrator did not start:\n{(self.tmp / 'orc.log').read_text()}")
            time.sleep(0.05)
        self.endpoint = f"127.0.0.1:{launch.read_ready(ready).grpc}"
        self.orc_ps = psutil.Process(self.orc.pid)

    def close(self) -> None:
        for p in (self.orc, self.stages_proc):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


async def one_request(stub, req) -> tuple[float, bool]:
    t0 = time.perf_counter()
    try:
        async for _ in stub.Generate(req, timeout=120):
            pass
        return time.perf_counter() - t0, True
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return time.perf_counter() - t0, False


async def closed_loop(endpoint: str, concurrency: int, duration: float, warmup: float) -> tuple[int, float]:
    """Requests completed per second once warm, with `concurrency` clients each sending back to back."""
    req = build_request("x")
    done_times: list[float] = []
    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        t_end = time.perf_counter() + warmup + duration

        async def client():
            while time.perf_counter() < t_end:
                await one_request(stub, req)
                done_times.append(time.perf_counter())

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    window = [t for t in done_times if t0 + warmup <= t <= t0 + warmup + duration]
    return len(window), len(window) / duration


def capacity(stages: dict) -> float:
    return min(s["replicas"] * s["batch"] / s["service_time"] for s in stages.values())


async def bench_throughput(quick: bool) -> list[dict]:
    stages = {"encode": {"replicas": 2, "batch": 4, "service_time": 0.05},
              "generate": {"replicas": 1, "batch": 4, "service_time": 0.1},
              "decode": {"replicas": 2, "batch": 2, "service_time": 0.08}}
    rig = Rig("throughput", stages)
    try:
        n, rps = await closed_loop(rig.endpoint, 48, 4.0 if quick else 10.0, 1.0)
    finally:
        rig.close()
    cap = capacity(stages)
    return [figure("throughput_rps", rps, "req/s"), figure("bottleneck_capacity_rps", cap, "req/s"),
            figure("throughput_over_bottleneck_capacity", rps / cap, "ratio")]


async def latencies(call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


async def bench_hop(quick: bool) -> list[dict]:
    stages = {"echo": {"replicas": 1, "batch": 1, "service_time": 0.0}}
    rig = Rig("hop", stages)
    n = 150 if quick else 600
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rig.ports['echo'][0]}") as ch1, \
                grpc.aio.insecure_channel(rig.endpoint) as ch2:
            stage = stage_pb2_grpc.StageServiceStub(ch1)
            orc = orchestrator_pb2_grpc.OrchestratorStub(ch2)
            params = build_request("x").params
            head = stage_pb2.StageInput(header=stage_pb2.StageRequestHeader(request_id="r", params=params))

            async def direct():
                async def gen():
                    yield head
                async for _ in stage.Process(gen()):
                    pass

            async def via():
                async for _ in orc.Generate(build_request("x")):
                    pass

            for f in (direct, via):
                await latencies(f, 30)  # warm
            d = await latencies(direct, n)
            v = await latencies(via, n)
    finally:
        rig.close()
    return [figure("direct_p50_ms", percentile(d, 50), "ms"), figure("via_orchestrator_p50_ms", percentile(v, 50), "ms"),
            figure("hop_overhead_p50_ms", percentile(v, 50) - percentile(d, 50), "ms"),
            figure("hop_overhead_p99_ms", percentile(v, 99) - percentile(d, 99), "ms")]


async def bench_descriptors(quick: bool) -> list[dict]:
    k = 256
    stages = {"source": {"replicas": 1, "batch": 64, "service_time": 0.0, "out_chunks": k},
              "sink": {"replicas": 1, "batch": 64, "service_time": 0.0}}
    rig = Rig("descriptors", stages, pin_core=0)
    try:
        cpu0 = rig.orc_ps.cpu_times()
        n, rps = await closed_loop(rig.endpoint, 8, 3.0 if quick else 8.0, 1.0)
        cpu1 = rig.orc_ps.cpu_times()
    finally:
        rig.close()
    return [figure("descriptors_routed_per_s", rps * k, "chunks/s"),
            figure("descriptors.orchestrator_cpu_s", (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system), "s")]


async def bench_overload(quick: bool) -> list[dict]:
    stages = {"encode": {"replicas": 2, "batch": 4, "service_time": 0.05},
              "generate": {"replicas": 1, "batch": 4, "service_time": 0.1},
              "decode": {"replicas": 2, "batch": 2, "service_time": 0.08}}
    cap = capacity(stages)
    rig = Rig("overload", stages, max_inflight=32, max_queued=32)
    duration = 5.0 if quick else 15.0
    lat_ok, rejected, peak = [], 0, [0]
    try:
        async def sample_rss():
            while True:
                peak[0] = max(peak[0], rig.orc_ps.memory_info().rss)
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample_rss())
        async with grpc.aio.insecure_channel(rig.endpoint) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            req = build_request("x")
            rng = random.Random(0)
            tasks = []
            t0 = time.perf_counter()
            t = t0
            while t - t0 < duration:  # open loop: Poisson arrivals at 3x capacity
                t += rng.expovariate(3 * cap)
                await asyncio.sleep(max(0.0, t - time.perf_counter()))
                tasks.append(asyncio.create_task(one_request(stub, req)))
            results = await asyncio.gather(*tasks)
            elapsed = time.perf_counter() - t0
        sampler.cancel()
        for dt, ok in results:
            if ok:
                lat_ok.append(dt * 1e3)
            else:
                rejected += 1
    finally:
        rig.close()
    goodput = len(lat_ok) / elapsed
    return [figure("overload3x.offered_rps", len(results) / duration, "req/s"),
            figure("overload3x.goodput_rps", goodput, "req/s"),
            figure("overload3x.goodput_over_capacity", goodput / cap, "ratio"),
            figure("overload3x.rejected_fraction", rejected / len(results), "ratio"),
            figure("overload3x.admitted_p50_ms", percentile(lat_ok, 50), "ms"),
            figure("overload3x.admitted_p99_ms", percentile(lat_ok, 99), "ms"),
            figure("overload3x.peak_rss_mb", peak[0] / 2 ** 20, "MiB")]


async def main(quick: bool) -> None:
    figures = []
    for part in (bench_throughput, bench_hop, bench_descriptors, bench_overload):
        got = await part(quick)
        print_table(part.__name__.replace("bench_", ""), got)
        figures += got
    path = write_results("orchestrator", figures, {"quick": quick})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    asyncio.run(main(ap.parse_args().quick))
