"""What metrics cost, on the omni pipeline (qwen3-omni-tiny: thinker, talker, code2wav):

- how long a scrape of each process's `/metrics` takes under a steady load (its p99): `omnistage serve`'s
  processes (each its own interpreter, as in a pod), every status port (the orchestrator's and each
  stage's) scraped in turn from this process, again and again, while CONCURRENCY requests stay in flight;
- requests per second with metrics and access lines on over both off, in the same run on the same servers,
  in alternating rounds so that drift on a busy machine falls on both sides alike. On: every metric updated
  as the code does, each process scraped at least every SCRAPE_INTERVAL_S, the access lines written as JSON
  lines to a file. Off: the access logger disabled (what `--access-log off` does), every metric object of
  the running servers (stage, data plane, orchestrator) swapped for one that takes each update and keeps
  nothing (the processes have no switch for their metrics; the swap leaves only the call into the no-op),
  and no scrape.

For the rates, the stages and the orchestrator run in this process (real gRPC servers and status ports on
127.0.0.1, the tiny models), so that their metrics can be swapped between rounds; the "on" rounds' scrapes
share one interpreter with all four servers and the scraper, so their cost is an upper bound on a pod's.

    .venv/bin/python bench/observability_metrics.py [--quick]
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import threading
import time

from common import figure, on_off_figures, percentile, run_measure
from observability_logs import (
    CONCURRENCY,
    EXAMPLE,
    LINES,
    REQUEST,
    STAGES,
    access_log_file,
    rps_round,
    wait_for_access_lines,
)
from omni_load import serve_omni
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from omnistage import logs
from omnistage.api import load_pipeline
from omnistage.client import AsyncOmniClient
from omnistage.contract import launch
from orchestrator_service.server import OrchestratorServer
from stage_service.server import StageServer

ORCHESTRATOR = "orchestrator"
# Between two sweeps over every status port under load: about 10 sweeps a second, a few hundred scrapes per
# process in the full run, enough for a p99, without the scraper itself taking a core.
SWEEP_PAUSE_S = 0.1
# In the "on" rounds, every process scraped as a round starts and every 5 s after (a round takes a few
# seconds): at least 3 times as often as Prometheus' usual 15 s interval, so the scrapes' share of the cost is
# an upper bound. (Every second, four processes sharing this one interpreter: 0.95 in a full run.)
SCRAPE_INTERVAL_S = 5.0
SCRAPE_TIMEOUT_S = 30.0  # a safety bound on one scrape; a real one takes milliseconds
# What every scrape must hold, or its time is not a metrics scrape's (a 404, an empty registry)
EXPECTED = {ORCHESTRATOR: b"omnistage_requests_ended_total", **{s: b"omnistage_stage_requests_total" for s in STAGES}}
ENDED = "omnistage_requests_ended_total"


def scrape(name: str, port: int) -> float:
    """Seconds to GET one process's /metrics on a new connection (as Prometheus does without keep-alive) and
    read its whole answer; fails unless the answer is the process's metrics."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=SCRAPE_TIMEOUT_S)
    try:
        conn.request("GET", launch.METRICS_PATH)
        answer = conn.getresponse()
        body = answer.read()
    finally:
        conn.close()
    seconds = time.perf_counter() - t0
    if answer.status != 200 or EXPECTED[name] not in body:
        raise RuntimeError(f"scrape of {name} on port {port}: HTTP {answer.status}, {len(body)} bytes without "
                           f"{EXPECTED[name].decode()}")
    return seconds


class Scraper:
    """A thread (as a Prometheus outside the event loop) that scrapes every target in turn, pausing `pause`
    seconds between sweeps, until the `with` block ends; `seconds` holds each scrape's time per target."""

    def __init__(self, targets: dict[str, int], pause: float):
        self.targets, self.pause = targets, pause
        self.seconds: dict[str, list[float]] = {name: [] for name in targets}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for name, port in self.targets.items():
                    self.seconds[name].append(scrape(name, port))
                self._stop.wait(self.pause)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread on exit
            self._error = e

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error


class _NoMetric:
    """Stands for a metric while metrics are off: takes every update, keeps nothing."""

    def labels(self, *args, **kwargs) -> _NoMetric:
        return self

    def inc(self, *args, **kwargs) -> None:
        pass

    dec = set = observe = inc


class MetricsSwitch:
    """Turns the metrics of running servers off and on: each metric object held by `holders` (StageMetrics,
    TransferMetrics, OrchestratorMetrics; the code reads them from there at each update) swapped for a no-op,
    and back. Every family of `registries` with samples must be among them, or "off" would still count some:
    made after a warm-up, what requests update has samples by then."""

    def __init__(self, holders: list[object], registries: list[CollectorRegistry]):
        self.real = [(h, {k: v for k, v in vars(h).items() if isinstance(v, MetricWrapperBase)}) for h in holders]
        switched = {metric._name for _, metrics in self.real for metric in metrics.values()}
        unswitched = {family.name for r in registries for family in r.collect() if family.samples} - switched
        assert not unswitched, f"metrics the switch does not reach: {sorted(unswitched)}"

    def set(self, on: bool) -> None:
        for holder, metrics in self.real:
            for attr, metric in metrics.items():
                setattr(holder, attr, metric if on else _NoMetric())


async def _steady_load(client: AsyncOmniClient, seconds: float) -> int:
    """CONCURRENCY requests in flight for `seconds`; returns how many finished."""
    end, done = time.monotonic() + seconds, 0

    async def worker():
        nonlocal done
        while time.monotonic() < end:
            await client.generate("Hello there", **REQUEST)
            done += 1

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return done


def _ended(orc: OrchestratorServer) -> float:
    return orc.metrics.registry.get_sample_value(ENDED, {"outcome": "finished"}) or 0.0


def scrape_under_load(quick: bool) -> list[dict]:
    """Every process of `omnistage serve` scraped in turn, again and again, under a steady load."""
    idle_s, load_s = (4.0, 10.0) if quick else (15.0, 60.0)
    with serve_omni(launch.model_root()) as local:
        targets = {p.stage or ORCHESTRATOR: p.ports.http for p in local.all_procs()}
        assert set(targets) == set(EXPECTED), targets
        for name, port in targets.items():  # not counted: a status server's first answer sets things up
            scrape(name, port)
        with Scraper(targets, SWEEP_PAUSE_S) as idle:  # the baseline: the same scrapes with no request running
            time.sleep(idle_s)

        async def load() -> int:
            async with AsyncOmniClient(local.endpoint) as client:
                return await _steady_load(client, load_s)

        with Scraper(targets, SWEEP_PAUSE_S) as scraper:
            served = asyncio.run(load())
    p99 = {name: percentile(scraper.seconds[name], 99) for name in EXPECTED}
    return [*(figure(f"metrics.scrape_seconds_p99.{name}", value, "s") for name, value in p99.items()),
            figure("metrics.scrape_seconds_p99", max(p99.values()), "s"),
            figure("metrics.scrape_seconds_p50", max(percentile(s, 50) for s in scraper.seconds.values()), "s"),
            figure("metrics.scrape_seconds_p99_idle", max(percentile(s, 99) for s in idle.seconds.values()), "s"),
            figure("metrics.scrapes_per_process", min(len(s) for s in scraper.seconds.values()), "scrapes"),
            figure("metrics.load_rps_while_scraped", served / load_s, "req/s")]


async def _measure(quick: bool) -> list[dict]:
    with access_log_file() as path:
        return await _measure_into(path, quick)


async def _measure_into(path, quick: bool) -> list[dict]:
    access = logging.getLogger(logs.ACCESS_LOGGER)
    pipeline = load_pipeline(EXAMPLE)
    stages: dict[str, StageServer] = {}
    rounds, per_round = (3, 9) if quick else (8, 30)
    off, on, logged = [], [], 0
    orc = None
    try:
        for name in STAGES:
            stages[name] = StageServer(pipeline, name, "127.0.0.1", 0, http_port=0,
                                       model_root=str(launch.model_root()))
            await stages[name].start()
        orc = OrchestratorServer(pipeline, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()}, http_port=0)
        await orc.start(wait_for_stages=30)
        servers: dict[str, OrchestratorServer | StageServer] = {ORCHESTRATOR: orc, **stages}
        targets = {name: server.http.port for name, server in servers.items() if server.http is not None}
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            access.disabled = True
            await rps_round(client, CONCURRENCY)  # warm-up: first-call costs on every stage
            switch = MetricsSwitch([orc.metrics, *(s.metrics for s in stages.values()),
                                    *(s.data_plane.metrics for s in stages.values())],
                                   [server.metrics.registry for server in servers.values()])
            for _ in range(rounds):
                switch.set(False)
                access.disabled = True
                before = _ended(orc)
                off.append(await rps_round(client, per_round))
                assert _ended(orc) == before, "metrics counted while off"
                switch.set(True)
                access.disabled = False
                with Scraper(targets, SCRAPE_INTERVAL_S):
                    on.append(await rps_round(client, per_round))
                assert _ended(orc) == before + per_round, "metrics not counted while on"
                logged += per_round
                await wait_for_access_lines(path, logged * LINES)
                access.disabled = True  # before the next "off" round: none of its lines
            switch.set(True)
    finally:
        if orc is not None:
            await orc.drain()
            orc.close()
        for s in stages.values():
            await s.drain()
    return on_off_figures("metrics", on, off)


def measure(quick: bool) -> list[dict]:
    return scrape_under_load(quick) + asyncio.run(_measure(quick))


def main() -> None:
    run_measure("observability_metrics", "Metrics (qwen3-omni-tiny, every status port scraped under load)",
                measure, {"concurrency": CONCURRENCY})


if __name__ == "__main__":
    main()
