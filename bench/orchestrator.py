"""Orchestrator benchmark: throughput against the bottleneck stage's capacity, added latency per hop,
descriptors routed per second on one core and on two orchestrator replicas behind the client's round
robin (with where the CPU went), and behaviour at 3x overload.

The stages MODEL a known service time on purpose (bench/modeled_stage.py: batch b, hold t seconds),
so the theoretical throughput min over stages of (replicas x batch / service time) is known exactly
and only the orchestrator is measured. The orchestrator runs as its own process
(`python -m orchestrator_service`), as in production; the load generator is this process.

    .venv/bin/python bench/orchestrator.py [--quick] [--only descriptors]
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

from omnistage.client import AsyncOmniClient, build_request
from omnistage.contract import launch
from omnistage.v1 import orchestrator_pb2_grpc, stage_pb2, stage_pb2_grpc

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
    """Modeled stages in one process; `orchestrators` orchestrator processes over those same stage replicas
    (as several replicas behind one client-side balancer share them in a cluster), the i-th optionally
    pinned to core `pin_cores[i]`."""

    def __init__(self, name: str, stages: dict, max_inflight: int = 1024, max_queued: int = 4096,
                 orchestrators: int = 1, pin_cores: tuple[int, ...] = ()):
        self.tmp = Path(tempfile.mkdtemp(prefix=f"bench-orc-{name}-"))
        # The stages' stderr goes to a log: calls cut when the orchestrators stop first are expected noise.
        self.stages_proc = subprocess.Popen([PY, str(ROOT / "bench" / "modeled_stage.py"), json.dumps(stages)],
                                            stdout=subprocess.PIPE, stderr=open(self.tmp / "stages.log", "w"),
                                            text=True)
        self.ports = json.loads(self.stages_proc.stdout.readline())
        self.orcs: list[subprocess.Popen] = []
        try:
            path = self.tmp / "pipeline.yaml"
            path.write_text(yaml.safe_dump(pipeline_doc(name, stages, max_inflight, max_queued)))
            ready = [self.tmp / f"orc{i}.ready" for i in range(orchestrators)]
            for i, ready_file in enumerate(ready):
                argv = launch.orchestrator_command(
                    path, port=0, ready_file=ready_file, log_level="WARNING", wait_for_stages=30,
                    stage_endpoints={s: [f"127.0.0.1:{p}" for p in ports] for s, ports in self.ports.items()})
                core = pin_cores[i] if i < len(pin_cores) else None
                pre = (lambda c=core: os.sched_setaffinity(0, {c})) if core is not None else None
                self.orcs.append(subprocess.Popen(argv, cwd=ROOT, preexec_fn=pre, stdout=open(self.log(i), "w"),
                                                  stderr=subprocess.STDOUT))
            end = time.monotonic() + 60
            while any(launch.read_ready(r) is None for r in ready):
                failed = [i for i, o in enumerate(self.orcs) if o.poll() is not None]
                if failed or time.monotonic() > end:
                    i = failed[0] if failed else 0
                    raise RuntimeError(f"orchestrator {i} did not start:\n{self.log(i).read_text()}")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        self.endpoints = [f"127.0.0.1:{launch.read_ready(r).grpc}" for r in ready]
        self.endpoint = self.endpoints[0]
        self.orc_ps = [psutil.Process(o.pid) for o in self.orcs]
        self.stages_ps = psutil.Process(self.stages_proc.pid)

    def log(self, i: int) -> Path:
        return self.tmp / f"orc{i}.log"

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each process of the run, this one (the load generator) and the whole machine."""
        def used(ps: psutil.Process) -> float:
            t = ps.cpu_times()
            return t.user + t.system + t.children_user + t.children_system

        m = psutil.cpu_times()  # summed over every core; guest time is inside user already
        return {"orchestrators": sum(used(p) for p in self.orc_ps), "stages": used(self.stages_ps),
                "load_generator": used(psutil.Process()),
                "machine_busy": m.user + m.nice + m.system + m.irq + m.softirq,
                **{f"orchestrator{i}": used(p) for i, p in enumerate(self.orc_ps)}}

    def close(self) -> None:
        for p in (*self.orcs, self.stages_proc):
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


async def closed_loop(endpoints: list[str], concurrency: int, duration: float, warmup: float,
                      sample=None) -> tuple[int, float, list]:
    """Requests completed per second once warm, with `concurrency` clients each sending back to back through
    one client over `endpoints` (several: the client's round robin spreads them). `sample()`, when given,
    is called as the measured window opens and as it closes; its two results come back."""
    req = build_request("x")
    done_times: list[float] = []
    samples: list = []
    async with AsyncOmniClient(endpoints) as client:
        t0 = time.perf_counter()
        t_end = t0 + warmup + duration

        async def worker():
            while time.perf_counter() < t_end:
                await one_request(client.stub, req)
                done_times.append(time.perf_counter())

        async def sampler():
            for at in (t0 + warmup, t0 + warmup + duration):
                await asyncio.sleep(at - time.perf_counter())
                samples.append(sample())

        await asyncio.gather(*(worker() for _ in range(concurrency)), *([sampler()] if sample else []))
    window = [t for t in done_times if t0 + warmup <= t <= t0 + warmup + duration]
    return len(window), len(window) / duration, samples


def capacity(stages: dict) -> float:
    return min(s["replicas"] * s["batch"] / s["service_time"] for s in stages.values())


async def bench_throughput(quick: bool) -> list[dict]:
    stages = {"encode": {"replicas": 2, "batch": 4, "service_time": 0.05},
              "generate": {"replicas": 1, "batch": 4, "service_time": 0.1},
              "decode": {"replicas": 2, "batch": 2, "service_time": 0.08}}
    rig = Rig("throughput", stages)
    try:
        n, rps, _ = await closed_loop(rig.endpoints, 48, 4.0 if quick else 10.0, 1.0)
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
    """Added latency per hop: one request at a time straight to an echo stage, through one orchestrator,
    and through two orchestrator replicas behind the client's round robin (each request crosses one of
    them: the hop should cost the same). The three are taken in turn, request by request, so whatever
    else runs on the machine weighs on each alike."""
    stages = {"echo": {"replicas": 1, "batch": 1, "service_time": 0.0}}
    rig = Rig("hop", stages, orchestrators=2)
    n = 150 if quick else 600
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rig.ports['echo'][0]}") as ch, \
                AsyncOmniClient(rig.endpoints[:1]) as one, AsyncOmniClient(rig.endpoints) as two:
            stage = stage_pb2_grpc.StageServiceStub(ch)
            params = build_request("x").params
            head = stage_pb2.StageInput(header=stage_pb2.StageRequestHeader(request_id="r", params=params))

            async def direct():
                async def gen():
                    yield head
                async for _ in stage.Process(gen()):
                    pass

            def via(client):
                async def call():
                    async for _ in client.stub.Generate(build_request("x")):
                        pass
                return call

            calls = {"direct": direct, "x1": via(one), "x2": via(two)}
            ms: dict[str, list[float]] = {name: [] for name in calls}
            for i in range(30 + n):  # the first 30 warm every connection (both replicas' too)
                for name, call in calls.items():
                    took = await latencies(call, 1)
                    if i >= 30:
                        ms[name] += took
    finally:
        rig.close()
    d = ms["direct"]
    figures = [figure("direct_p50_ms", percentile(d, 50), "ms"),
               figure("via_orchestrator_p50_ms", percentile(ms["x1"], 50), "ms")]
    for prefix, v in (("", ms["x1"]), ("orchestrator_x2.", ms["x2"])):
        if prefix:
            figures.append(figure(prefix + "via_orchestrator_p50_ms", percentile(v, 50), "ms"))
        figures += [figure(prefix + "hop_overhead_p50_ms", percentile(v, 50) - percentile(d, 50), "ms"),
                    figure(prefix + "hop_overhead_p99_ms", percentile(v, 99) - percentile(d, 99), "ms")]
    return figures


CHUNKS_PER_REQUEST = 256


async def bench_descriptors(quick: bool) -> list[dict]:
    """Chunk descriptors routed per second: through one orchestrator pinned to one core, and through two
    replicas (one per core) behind the client's round robin with twice the clients, over the same stage
    processes. Windows of the two alternate, so whatever else runs on the machine weighs on both alike.
    Where the CPU went in each comes with it: on this 2-core machine stages, orchestrators and the load
    generator share the cores, so the x2 figure is read beside the split and the descriptors routed per
    orchestrator CPU second (the orchestrator's own cost, unchanged when replicas do not contend)."""
    stages = {"source": {"replicas": 1, "batch": 64, "service_time": 0.0, "out_chunks": CHUNKS_PER_REQUEST},
              "sink": {"replicas": 1, "batch": 64, "service_time": 0.0}}
    rounds, window = (2, 1.5) if quick else (4, 2.0)
    # x1: one replica; x2: both behind one round-robin client; x2_own_clients: a client (and half the load)
    # per replica, which shows what the replicas route when no client-side balancer stands between.
    modes = {"x1": (1, False), "x2": (2, False), "x2_own_clients": (2, True)}
    runs = {m: {"requests": 0, "window": 0.0, "cpu": {}} for m in modes}
    rig = Rig("descriptors", stages, orchestrators=2, pin_cores=tuple(i % os.cpu_count() for i in range(2)))
    try:
        for _ in range(rounds):
            for mode, (n, own_clients) in modes.items():
                if own_clients:
                    got = await asyncio.gather(*(closed_loop([e], 8, window, 0.5, sample=rig.cpu_seconds if i == 0
                                                             else None) for i, e in enumerate(rig.endpoints)))
                    done, (before, after) = sum(g[0] for g in got), got[0][2]
                else:
                    done, _, (before, after) = await closed_loop(rig.endpoints[:n], 8 * n, window, 0.5,
                                                                 sample=rig.cpu_seconds)
                run = runs[mode]
                run["requests"] += done
                run["window"] += window
                for k, v in window_cpu(n, before, after).items():
                    run["cpu"][k] = run["cpu"].get(k, 0.0) + v
    finally:
        rig.close()
    for run in runs.values():
        cpu = run["cpu"]
        run["rate"] = run["requests"] * CHUNKS_PER_REQUEST / run["window"]
        run["per_orc_cpu"] = run["rate"] * run["window"] / cpu["orchestrators"]
        ours = sum(v for k, v in cpu.items() if k in ("orchestrators", "idle_replica", "stages", "load_generator"))
        run["other"] = max(0.0, cpu["machine_busy"] - ours)
    x1, x2, own = runs["x1"], runs["x2"], runs["x2_own_clients"]
    figures = [figure("descriptors_routed_per_s", x1["rate"], "chunks/s"),
               figure("descriptors.orchestrator_cpu_s", x1["cpu"]["orchestrators"], "s"),
               figure("orchestrator_x2.descriptors_routed_per_s", x2["rate"], "chunks/s"),
               figure("orchestrator_x2_over_x1.descriptors_per_s", x2["rate"] / x1["rate"], "ratio"),
               figure("orchestrator_x2_over_x1.descriptors_per_orchestrator_cpu_s",
                      x2["per_orc_cpu"] / x1["per_orc_cpu"], "ratio"),
               figure("orchestrator_x2_own_clients.descriptors_routed_per_s", own["rate"], "chunks/s"),
               figure("orchestrator_x2_own_clients_over_x1.descriptors_per_s", own["rate"] / x1["rate"], "ratio")]
    for prefix, run in (("descriptors.", x1), ("orchestrator_x2.descriptors.", x2),
                        ("orchestrator_x2_own_clients.descriptors.", own)):
        figures.append(figure(prefix + "per_orchestrator_cpu_s", run["per_orc_cpu"], "chunks/cpu-s"))
        figures += [figure(f"{prefix}cores.{part}", run["cpu"][part] / run["window"], "cores")
                    for part in run["cpu"] if part != "machine_busy"]
        figures += [figure(prefix + "cores.other_processes", run["other"] / run["window"], "cores"),
                    figure(prefix + "cores.machine_busy", run["cpu"]["machine_busy"] / run["window"], "cores")]
    return figures


def window_cpu(serving: int, before: dict, after: dict) -> dict[str, float]:
    """CPU seconds of one window by part, `serving` of the rig's two orchestrators taking the load."""
    d = {k: after[k] - before[k] for k in before}
    if serving == 1:  # the other replica only polls the stages: its own line, not the served one's cost
        return {"orchestrators": d["orchestrator0"], "idle_replica": d["orchestrator1"], "stages": d["stages"],
                "load_generator": d["load_generator"], "machine_busy": d["machine_busy"]}
    return d


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
                peak[0] = max(peak[0], rig.orc_ps[0].memory_info().rss)
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


PARTS = ("throughput", "hop", "descriptors", "overload")


async def main(quick: bool, only: list[str]) -> None:
    # The machine is shared: what else ran as this started is part of reading the figures.
    settings = {"load_average_at_start": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count(),
                "descriptors_chunks_per_request": CHUNKS_PER_REQUEST}
    figures = []
    for name in only or PARTS:
        got = await globals()[f"bench_{name}"](quick)
        print_table(name, got)
        figures += got
    if only:
        print("\n--only: results file not written (it holds every part's figures)")
        return
    path = write_results("orchestrator", figures, {"quick": quick, "settings": settings})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", action="append", choices=PARTS, default=[],
                    help="run this part alone (repeatable); prints its figures, writes no results file")
    args = ap.parse_args()
    asyncio.run(main(args.quick, args.only))
