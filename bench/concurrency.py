"""Concurrency curve: the tiny Qwen3-Omni pipeline (text + audio out) as load grows, against the monolith.

Sides, all on the same cores, all up at once (each idle while another is measured; their idle CPU is recorded):
- staged: `examples/qwen3-omni-tiny.yaml` as `omnistage serve` runs it (LocalPipeline), planner off;
- monolith: transformers' combined `generate` in one process, one request at a time from its queue
  (`MonolithReplicas(1, ...)` of bench/e2e_vs_monolith.py);
- monolith_x2: two such processes behind a round-robin dispatcher (as many as the machine has cores);
- staged_planner: the staged pipeline again, after the others have stopped, with the stage planner ticking
  (`LocalAutoscaler`, the autoscaling block bench/planner.py serves: 1 s interval, 1-2 replicas per stage,
  4 in all), so it may add a replica to the stage that falls behind.

Closed loop: each side climbs the levels 1, 2, 4, ... 64 (requests = 2 x level), its points alternated with
the other sides' level by level, and stops climbing once its RTF p95 passes `STOP_RTF_P95`; it then bisects
between the last level whose RTF p95 was below 1 and the first that was not (`MAX_PROBES` extra levels), so
`streams_at_rtf_p95_below_1` (and the ratio of two sides) is not held to powers of two. Each point: req/s,
TTFP p50/p95, RTF (latency over audio seconds) p50/p95, audio underruns (a chunk that arrived after the audio
before it had finished playing: client side from the chunks' arrival times, and for the staged sides the
orchestrator's `omnistage_audio_underruns_total` read before and after the level). The monolith's audio
arrives whole with its result: its TTFP is its latency and it has no underruns to count.
For the staged sides each point also records why: per-stage queue / compute / transfer / first-chunk means
(the orchestrator's `omnistage_stage_time_seconds`, the request traces' parts), the admission wait, and the CPU
cores each process used.

Open loop (not with --quick's smaller set of rates): seeded Poisson arrivals at rising rates (`OPEN_LOAD` x the
staged side's c8 req/s), staged against monolith_x2, rate by rate alternated.

    .venv/bin/python bench/concurrency.py [--quick] [--variant NAME ...]

Writes bench/results/concurrency.json and docs/img/concurrency.png (RTF p95 and TTFP p95 against the level;
skipped, saying so, without matplotlib: `pip install omnistage[bench]`). `--variant NAME` (repeatable)
measures the staged side at c1 and c32 as the pipeline file is and with each edit of it (`VARIANTS`), all up,
alternated, and merges their figures (`concurrency.variant.*`) into the results file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the monolith's processes too

from common import exit_on_sigterm, figure, merge_results, percentile, print_table, write_results
from e2e_vs_monolith import (
    CODEC_FRAMES,
    REQUEST_TIMEOUT_S,
    MonolithReplicas,
    cpu_cores,
    cpu_seconds,
    request_order,
    run_replicas_level,
)
from omni_load import playback_gaps, run_level, serve_omni, stream_one

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "docs" / "img" / "concurrency.png"
LEVELS = (1, 2, 4, 8, 16, 32, 64)
QUICK_LEVELS = (1, 4, 16, 32)
# A side whose audio is this far behind real time at p95 has shown where it breaks: its higher levels
# would only cost minutes (the monolith serves 0.8-2.3 req/s).
STOP_RTF_P95 = 1.5
MAX_PROBES = 2  # bisection levels between the last level below RTF 1 and the first above: 8..16 -> 12 -> 10 or 14
QUICK_MAX_PROBES = 1
# The levels the headline figures read (TTFP p95 at c32 over c1, underruns at c32): always run on the staged
# sides, even above their stop.
REQUIRED = (1, 32)
# Beyond these the monolith sides would take minutes per level (2 x level requests at 0.8-2.3 req/s), and they
# are far past real time long before.
MAX_LEVEL = {"monolith": 16, "monolith_x2": 32}
OPEN_LOAD = (0.25, 0.5, 1.0, 1.5)  # offered req/s, times the staged side's c8 req/s
QUICK_OPEN_LOAD = (1.0,)  # --quick: the open loop only at the staged side's closed-loop rate
OPEN_REQUESTS = {"staged": 32, "monolith_x2": 16}  # the monolith at 1.5 req/s: 16 requests ~ 11 s a rate
SEED = 0
# The autoscaling block bench/planner.py serves the real stages with; replicas stay 60 s after load drops
# (not 20) so one added under a level is still there for the next.
PLANNER = {"enabled": True, "intervalSeconds": 1.0, "budget": {"maxReplicas": 4},
           "targets": {"utilization": 0.5},
           "stages": {s: {"minReplicas": 1, "maxReplicas": 2, "scaleDownDelaySeconds": 60.0}
                      for s in ("thinker", "talker", "code2wav")}}
SUPERVISE_S = 0.2  # as `omnistage serve`'s loop: how often the planner is asked and processes are looked after
IDLE_S = 3.0  # how long each side's idle CPU is read before the ladders


# ---- pure parts: the ladder, the figures ---------------------------------------------------------------


def streams_at(rtf_p95: Mapping[int, float]) -> int:
    """The most concurrent streams with RTF p95 below 1: the largest level that passed below the smallest
    level that did not (a noisy pass above a failure does not count); 0 when level 1 did not pass."""
    top = min((c for c, p in rtf_p95.items() if not p < 1), default=math.inf)  # nan fails
    return max((c for c, p in rtf_p95.items() if p < 1 and c < top), default=0)


def next_level(rtf_p95: Mapping[int, float], levels: Iterable[int] = LEVELS, required: Iterable[int] = (),
               max_probes: int = MAX_PROBES, stop: float = STOP_RTF_P95) -> int | None:
    """The next level a side runs, given its RTF p95 per level so far: the ladder's levels upwards until one
    has passed `stop` (then only `required` ones), then bisection between `streams_at` and the first failing
    level above it, at most `max_probes` levels off the ladder; None when done."""
    ladder = set(levels)
    stopped = False
    for c in sorted(ladder | set(required)):
        if c in rtf_p95:
            stopped = stopped or rtf_p95[c] > stop
        elif not stopped or c in required:
            return c
    lo = streams_at(rtf_p95)
    above = [c for c, p in rtf_p95.items() if not p < 1 and c > lo]
    probes = sum(c not in ladder for c in rtf_p95)
    if lo == 0 or not above or probes >= max_probes:
        return None
    hi = min(above)
    return (lo + hi) // 2 if hi - lo > 1 else None


def requests_at(level: int, quick: bool) -> int:
    """Requests a closed-loop level sends: twice the level (each client sends two), at least 8 (4 quick)."""
    return max(4 if quick else 8, (1 if quick else 2) * level)


def underruns(chunks: list[list[tuple[float, float]]]) -> tuple[int, int]:
    """(underruns, requests with one or more) of requests' audio chunks as (arrival s, audio s)."""
    gaps = [sum(g > 0 for g in playback_gaps(c)) for c in chunks]
    return sum(gaps), sum(g > 0 for g in gaps)


def point(result: dict) -> dict:
    """One level's numbers from `run_level` / `run_replicas_level` / an open-loop run."""
    n_under, with_under = underruns(result.get("chunks", []))
    ttfp = [t for t in result["ttfp"] if t is not None]
    return {"n": result["n"], "rps": result["rps"],
            "ttfp_p50_ms": 1e3 * percentile(ttfp, 50), "ttfp_p95_ms": 1e3 * percentile(ttfp, 95),
            "rtf_p50": percentile(result["rtfs"], 50), "rtf_p95": percentile(result["rtfs"], 95),
            "underruns": n_under, "requests_with_underrun": with_under}


def arrival_times(rate: float, n: int, seed: int) -> list[float]:
    """`n` Poisson arrivals at `rate` per second (seeded): seconds from the start, the first at 0."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def point_figures(side: str, level: int | str, p: dict) -> list[dict]:
    at = f"concurrency.{side}.{level if isinstance(level, str) else f'c{level}'}"
    out = [figure(f"{at}.rps", p["rps"], "req/s"), figure(f"{at}.ttfp_p50_ms", p["ttfp_p50_ms"], "ms"),
           figure(f"{at}.ttfp_p95_ms", p["ttfp_p95_ms"], "ms"), figure(f"{at}.rtf_p50", p["rtf_p50"], "ratio"),
           figure(f"{at}.rtf_p95", p["rtf_p95"], "ratio"), figure(f"{at}.underruns", p["underruns"], "count"),
           figure(f"{at}.n", p["n"], "requests")]
    if "underruns_server" in p:
        out.append(figure(f"{at}.underruns_server", p["underruns_server"], "count"))
    if "offered_rps" in p:
        out.append(figure(f"{at}.offered_rps", p["offered_rps"], "req/s"))
    return out


def headline_figures(points: Mapping[str, Mapping[int, dict]]) -> list[dict]:
    """streams at RTF p95 below 1 per side and the goals' figures (`_planner`: the staged side planner on)."""
    streams = {side: streams_at({c: p["rtf_p95"] for c, p in pts.items()}) for side, pts in points.items()}
    out = [figure(f"concurrency.{side}.streams_at_rtf_p95_below_1", streams[side], "streams")
           for side in ("staged", "monolith", "monolith_x2") if side in streams]
    for side, suffix in (("staged", ""), ("staged_planner", "_planner")):
        pts = points.get(side)
        if not pts:
            continue
        if side != "staged":
            out.append(figure(f"concurrency.staged.streams_at_rtf_p95_below_1{suffix}", streams[side], "streams"))
        if streams.get("monolith_x2"):
            out.append(figure(f"concurrency.staged_over_monolith_x2.streams_at_rtf_p95_below_1{suffix}",
                              streams[side] / streams["monolith_x2"], "ratio"))
        if 1 in pts and 32 in pts:
            out.append(figure(f"concurrency.ttfp_p95_ms_c32_over_c1{suffix}",
                              pts[32]["ttfp_p95_ms"] / pts[1]["ttfp_p95_ms"], "ratio"))
        if 32 in pts:
            out.append(figure(f"concurrency.underruns_c32{suffix}", pts[32]["underruns"], "count"))
    return out


# ---- what the orchestrator and the processes say ------------------------------------------------------


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics page's samples, by (name, sorted labels)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def server_parts(before: Mapping, after: Mapping) -> dict:
    """Between two scrapes of the orchestrator: its underruns, the mean admission wait, and per stage and
    part (queue, compute, transfer, first_chunk, ...) the mean ms of the requests that finished."""
    def delta(name, labels=()):
        key = (name, labels)
        return after.get(key, 0.0) - before.get(key, 0.0)

    parts: dict[str, dict[str, float]] = {}
    for name, labels in after:
        if name == "omnistage_stage_time_seconds_sum":
            lab = dict(labels)
            count = delta("omnistage_stage_time_seconds_count", labels)
            if count:
                parts.setdefault(lab["stage"], {})[lab["part"]] = round(1e3 * delta(name, labels) / count, 1)
    waits = delta("omnistage_admission_wait_seconds_count")
    wait_ms = round(1e3 * delta("omnistage_admission_wait_seconds_sum") / waits, 1) if waits else 0.0
    return {"underruns": int(delta("omnistage_audio_underruns_total")), "admission_wait_ms": wait_ms,
            "stage_ms": parts}


# ---- the sides -------------------------------------------------------------------------------------------


class Side(Protocol):
    def pids(self) -> dict[str, int]: ...
    def closed(self, level: int, n: int) -> dict: ...
    def open(self, rate: float, n: int) -> dict: ...


class Staged:
    """The staged pipeline (a LocalPipeline) as one side: closed-loop levels and open-loop rates, each point
    with the orchestrator's view and each process's CPU."""

    def __init__(self, local, frames: int) -> None:
        self.local, self.frames = local, frames
        self.metrics_url = f"http://{local.host}:{local.orchestrator.ports.http}/metrics"

    def pids(self) -> dict[str, int]:
        # a replica the planner is starting counts too: it loads its model on the same cores
        procs = [*self.local.all_procs(), *self.local.starting]
        return {"client": os.getpid(), **{p.name: p.popen.pid for p in procs}}

    def measure(self, run: Callable[[], dict]) -> dict:
        before, cpu0, t0 = scrape(self.metrics_url), cpu_seconds(self.pids()), time.perf_counter()
        result = run()
        wall = time.perf_counter() - t0
        cpu1, after = cpu_seconds(self.pids()), scrape(self.metrics_url)
        p = point(result)
        server = server_parts(before, after)
        p["underruns_server"] = server.pop("underruns")
        p["diagnosis"] = {**server, "cpu_cores": cpu_cores(cpu0, cpu1, wall),
                          "replicas": self.local.replica_counts()}
        return p

    def closed(self, level: int, n: int) -> dict:
        return self.measure(lambda: asyncio.run(run_level(self.local.endpoint, request_order(n, SEED),
                                                          self.frames, level)))

    def open(self, rate: float, n: int) -> dict:
        return self.measure(lambda: asyncio.run(self._open(rate, n)))

    async def _open(self, rate: float, n: int) -> dict:
        from omnistage.client import AsyncOmniClient

        async with AsyncOmniClient(self.local.endpoint) as client:
            async def one(at: float, text: str, max_tokens: int) -> dict:
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                return await stream_one(client, text, max_tokens, self.frames)

            t0 = time.perf_counter()
            done = await asyncio.gather(*(one(at, *pr) for at, pr in
                                          zip(arrival_times(rate, n, SEED), request_order(n, SEED))))
            wall = time.perf_counter() - t0
        return {"n": n, "rps": n / wall, "ttfp": [d["ttfp"] for d in done], "rtfs": [d["rtf"] for d in done],
                "chunks": [d["arrivals"] for d in done]}


class Monolith:
    """`MonolithReplicas` (one or two processes) as one side."""

    def __init__(self, replicas: MonolithReplicas) -> None:
        self.replicas = replicas

    def pids(self) -> dict[str, int]:
        return {f"replica{i}": pid for i, pid in enumerate(self.replicas.pids())}

    def measure(self, run: Callable[[], dict]) -> dict:
        cpu0, t0 = cpu_seconds(self.pids()), time.perf_counter()
        p = point(run())
        p["diagnosis"] = {"cpu_cores": cpu_cores(cpu0, cpu_seconds(self.pids()), time.perf_counter() - t0)}
        return p

    def closed(self, level: int, n: int) -> dict:
        return self.measure(lambda: run_replicas_level(self.replicas, request_order(n, SEED), level))

    def open(self, rate: float, n: int) -> dict:
        return self.measure(lambda: asyncio.run(self._open(rate, n)))

    async def _open(self, rate: float, n: int) -> dict:
        async def one(at: float, text: str, max_tokens: int) -> tuple[float, float]:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            t = time.perf_counter()
            _, audio_s = await asyncio.wait_for(asyncio.wrap_future(self.replicas.submit(text, max_tokens)),
                                                REQUEST_TIMEOUT_S)
            return time.perf_counter() - t, audio_s

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(at, *pr) for at, pr in
                                      zip(arrival_times(rate, n, SEED), request_order(n, SEED))))
        wall = time.perf_counter() - t0
        return {"n": n, "rps": n / wall, "ttfp": [lat for lat, _ in done],  # the audio comes with the result
                "rtfs": [lat / audio_s for lat, audio_s in done]}


@contextlib.contextmanager
def planner_ticking(local, events: list[str]):
    """The stage planner deciding every interval and the processes looked after, as `omnistage serve
    --autoscale`'s loop does, in a thread while the load runs."""
    from omnistage.local.autoscale import LocalAutoscaler

    t0 = time.monotonic()
    auto = LocalAutoscaler(local, progress=lambda m: events.append(f"{time.monotonic() - t0:.0f}s {m}"))
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(SUPERVISE_S):
            auto.tick()
            events.extend(f"{time.monotonic() - t0:.0f}s {e}" for e in local.supervise())

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield auto
    finally:
        stop.set()
        t.join()
        auto.close()


def idle_cores(sides: Mapping[str, Side]) -> dict[str, float]:
    """CPU cores each side uses while nobody calls it (it shares the cores with the side being measured)."""
    before = {name: cpu_seconds(s.pids()) for name, s in sides.items()}
    time.sleep(IDLE_S)
    after = {name: cpu_seconds(s.pids()) for name, s in sides.items()}
    return {name: round(sum(cpu_cores(before[name], after[name], IDLE_S).values()), 3) for name in sides}


def ladders(sides: Mapping[str, Side], quick: bool, log: list) -> dict[str, dict[int, dict]]:
    """Every side's closed-loop ladder, level by level alternated between the sides still climbing."""
    points: dict[str, dict[int, dict]] = {name: {} for name in sides}
    levels = QUICK_LEVELS if quick else LEVELS
    probes = QUICK_MAX_PROBES if quick else MAX_PROBES
    while True:
        ran = False
        for name, side in sides.items():
            top = MAX_LEVEL.get(name, max(levels))
            c = next_level({lv: p["rtf_p95"] for lv, p in points[name].items()},
                           [lv for lv in levels if lv <= top], REQUIRED if name.startswith("staged") else (),
                           probes)
            if c is None:
                continue
            points[name][c] = side.closed(c, requests_at(c, quick))
            report(name, f"c{c}", points[name][c], log)
            ran = True
        if not ran:
            return points


def report(side: str, at: str, p: dict, log: list) -> None:
    log.append({"side": side, "at": at, "t": round(time.time(), 1), "load1": round(os.getloadavg()[0], 2)})
    d = p.get("diagnosis", {})
    extra = f" server underruns {p['underruns_server']}" if "underruns_server" in p else ""
    print(f"  {side:<15}{at:>9}{p['rps']:>7.2f} req/s"
          f"  TTFP p50/p95 {p['ttfp_p50_ms']:>6.0f}/{p['ttfp_p95_ms']:>6.0f} ms"
          f"  RTF p50/p95 {p['rtf_p50']:>5.2f}/{p['rtf_p95']:>5.2f}  underruns {p['underruns']}{extra}"
          f"  n {p['n']}  cores {d.get('cpu_cores', {})}", flush=True)


def open_loop(sides: Mapping[str, Side], staged_c8_rps: float, quick: bool, log: list) -> dict[str, dict[str, dict]]:
    """Poisson arrivals at rates around the staged side's c8 req/s, rate by rate alternated between the sides."""
    out: dict[str, dict[str, dict]] = {name: {} for name in sides}
    for load in QUICK_OPEN_LOAD if quick else OPEN_LOAD:
        rate = load * staged_c8_rps
        for name, side in sides.items():
            n = OPEN_REQUESTS[name] // (2 if quick else 1)
            at = f"open_{round(100 * load):03d}pct"
            p = side.open(rate, n)
            p["offered_rps"] = rate
            out[name][at] = p
            report(name, at, p, log)
    return out


def plot(points: Mapping[str, Mapping[int, dict]], path: Path) -> bool:
    """RTF p95 and TTFP p95 against the level, one line per side; False (said) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install 'omnistage[bench]')")
        return False
    fig, (rtf_ax, ttfp_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for side, pts in points.items():
        levels = sorted(pts)
        rtf_ax.plot(levels, [pts[c]["rtf_p95"] for c in levels], marker="o", label=side)
        ttfp_ax.plot(levels, [pts[c]["ttfp_p95_ms"] for c in levels], marker="o", label=side)
    rtf_ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    from matplotlib.ticker import FormatStrFormatter

    for ax, title in ((rtf_ax, "RTF p95 (below 1: real time)"), (ttfp_ax, "TTFP p95 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):   # 1, 2, 4 ... and 0.5, 1, 2: not powers written out
            axis.set_major_formatter(FormatStrFormatter("%g"))
            axis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.set_xlabel("concurrent streams (closed loop)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    rtf_ax.legend()
    fig.suptitle(f"tiny Qwen3-Omni, text + {CODEC_FRAMES / 12.5:g} s audio per request, {os.cpu_count()} cores: "
                 "staged pipeline vs monolith")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return True


def markdown(points: Mapping[str, Mapping]) -> str:
    rows = ["| side | level | req/s | TTFP p50 / p95 ms | RTF p50 / p95 | underruns (server) | n |",
            "|---|---|---|---|---|---|---|"]
    for side, pts in points.items():
        for at in sorted(pts, key=lambda k: (isinstance(k, str), k)):
            p = pts[at]
            server = f" ({p['underruns_server']})" if "underruns_server" in p else ""
            rows.append(f"| {side} | {at if isinstance(at, str) else f'c{at}'} | {p['rps']:.2f} | "
                        f"{p['ttfp_p50_ms']:.0f} / {p['ttfp_p95_ms']:.0f} | {p['rtf_p50']:.2f} / {p['rtf_p95']:.2f} | "
                        f"{p['underruns']}{server} | {p['n']} |")
    return "\n".join(rows)


# ---- variants: one edit of the pipeline file, measured against the file as it is -----------------------


VARIANTS: dict[str, Callable[[dict], None]] = {
    # the Talker's first chunk: 5 frames (0.4 s of audio) instead of 15
    "talker_initial_5": lambda doc: doc["spec"]["topology"]["stages"][1].update(initialChunkSize=5),
    # the Thinker's chunks to the Talker and the client: 2 tokens instead of 4 (its adapter emits every chunk at
    # chunkSize: it takes no initialChunkSize)
    "thinker_chunk_2": lambda doc: doc["spec"]["topology"]["stages"][0].update(chunkSize=2),
    # admission: 8 requests in the pipeline at once, the rest wait at the door
    "inflight_8": lambda doc: doc["spec"]["deployment"]["orchestrator"].update(maxInflight=8),
    "inflight_16": lambda doc: doc["spec"]["deployment"]["orchestrator"].update(maxInflight=16),
}


def variant_run(names: list[str], models: Path, quick: bool, log: list) -> tuple[list[dict], dict]:
    """The staged side at c1 and c32 as the file is and with each of `VARIANTS[names]`, all up, alternated."""
    points: dict[str, dict[int, dict]] = {name: {} for name in ["base", *names]}
    with contextlib.ExitStack() as stack:
        sides = {name: Staged(stack.enter_context(serve_omni(models, VARIANTS.get(name))), CODEC_FRAMES)
                 for name in points}
        for c in REQUIRED:
            for name, side in sides.items():
                points[name][c] = side.closed(c, requests_at(c, quick))
                report(name, f"c{c}", points[name][c], log)
    figures = []
    for name, pts in points.items():
        prefix = f"concurrency.variant.{name}"
        for c, p in pts.items():
            figures += [figure(f"{prefix}.c{c}.ttfp_p50_ms", p["ttfp_p50_ms"], "ms"),
                        figure(f"{prefix}.c{c}.ttfp_p95_ms", p["ttfp_p95_ms"], "ms"),
                        figure(f"{prefix}.c{c}.rtf_p95", p["rtf_p95"], "ratio"),
                        figure(f"{prefix}.c{c}.rps", p["rps"], "req/s"),
                        figure(f"{prefix}.c{c}.underruns", p["underruns"], "count")]
        figures.append(figure(f"{prefix}.ttfp_p95_ms_c32_over_c1", pts[32]["ttfp_p95_ms"] / pts[1]["ttfp_p95_ms"],
                              "ratio"))
    return figures, points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer levels, rates and requests (~3 minutes)")
    ap.add_argument("--models", default=str(ROOT / "models"))
    ap.add_argument("--variant", choices=sorted(VARIANTS), action="append",
                    help="only: the staged side at c1, c32 as it is and with this edit (repeat for more)")
    ap.add_argument("--no-open", action="store_true", help="no open-loop series")
    ap.add_argument("--no-planner", action="store_true", help="no planner-on ladder")
    args = ap.parse_args()
    exit_on_sigterm()
    models = Path(args.models)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    print(f"load average at start (1, 5, 15 min): {load_at_start}", flush=True)
    started = time.perf_counter()
    log: list[dict] = []
    if args.variant:
        figures, vpoints = variant_run(args.variant, models, args.quick, log)
        print_table(f"variants {', '.join(args.variant)} against the file as it is", figures)
        path = merge_results("concurrency", figures, {"variant": args.variant, "quick": args.quick,
                                                      "load_average_at_start": load_at_start,
                                                      "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                                                      "points": vpoints, "log": log})
        print(f"\nruntime {time.perf_counter() - started:.0f}s; merged into {path}")
        return

    with serve_omni(models) as local, \
            MonolithReplicas(1, models / "qwen3-omni-tiny", CODEC_FRAMES, "cpu") as one, \
            MonolithReplicas(2, models / "qwen3-omni-tiny", CODEC_FRAMES, "cpu") as two:
        sides: dict[str, Side] = {"staged": Staged(local, CODEC_FRAMES), "monolith": Monolith(one),
                                  "monolith_x2": Monolith(two)}
        idle = idle_cores(sides)
        print(f"idle CPU cores per side: {idle}", flush=True)
        print("closed loop (levels alternated between the sides; bisection between the last level below RTF 1 "
              "and the first above):", flush=True)
        points = ladders(sides, args.quick, log)
        open_points: dict = {}
        if not args.no_open and (8 in points["staged"] or 4 in points["staged"]):
            base = 8 if 8 in points["staged"] else 4  # --quick's ladder has no c8
            rps = points["staged"][base]["rps"]
            print(f"open loop (Poisson arrivals, rates x staged c{base} {rps:.2f} req/s):", flush=True)
            open_points = open_loop({k: sides[k] for k in ("staged", "monolith_x2")}, rps, args.quick, log)
    planner_events: list[str] = []
    if not args.no_planner:
        def autoscaled(doc: dict) -> None:
            doc["spec"]["deployment"]["autoscaling"] = PLANNER

        with serve_omni(models, autoscaled) as local, planner_ticking(local, planner_events):
            print("closed loop, staged with the planner on:", flush=True)
            points.update(ladders({"staged_planner": Staged(local, CODEC_FRAMES)}, args.quick, log))
        for e in planner_events:
            print(f"  planner: {e}")

    figures = headline_figures(points)
    for side, pts in points.items():
        for c, p in sorted(pts.items()):
            figures += point_figures(side, c, p)
    for side, pts in open_points.items():
        for at, p in pts.items():
            figures += point_figures(f"open.{side}", at, p)
    print_table("concurrency curve (closed loop; streams = the most levels with RTF p95 below 1, bisected "
                "between powers of 2)", figures)
    print("\n" + markdown({**points, **{f"open {s}": pts for s, pts in open_points.items()}}))
    plotted = plot(points, PLOT)
    runtime = time.perf_counter() - started
    path = write_results("concurrency", figures, {
        "quick": args.quick, "codec_frames": CODEC_FRAMES, "stop_rtf_p95": STOP_RTF_P95,
        "bisection": f"up to {QUICK_MAX_PROBES if args.quick else MAX_PROBES} levels between the last level with "
                     "RTF p95 below 1 and the first above, so streams are not powers of 2 only",
        "idle_cpu_cores": idle, "load_average_at_start": load_at_start,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()], "plot": str(PLOT) if plotted else None,
        "points": {s: {str(k): v for k, v in pts.items()} for s, pts in points.items()},
        "open_points": open_points, "planner_events": planner_events, "log": log, "runtime_s": round(runtime, 1)})
    print(f"\nruntime {runtime:.0f}s; wrote {path}")


if __name__ == "__main__":
    main()
