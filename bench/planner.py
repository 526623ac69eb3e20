"""The stage planner against the best allocation and against per-stage HPA-style scaling.

MODELED STAGES, on purpose: a Thinker -> Talker -> Code2Wav pipeline simulated in virtual time (steps of
`DT`), each stage replica a model of a batching engine: up to `BATCH` requests in service at once, each
advancing at capacity/BATCH units per second (tokens or codec frames: batching keeps a request's speed),
the rest queued at the stage; a new replica serves `STARTUP_S` after it is asked for (a modeled pod
start and model load; it holds its share of the budget from the moment it is asked for); a replica
removed finishes what it serves first (the drain contract). The planner is the real one
(`omnistage.planner.controller.Planner`, the code `omnistage serve --autoscale` runs), fed the counters
a real replica exports (units, busy seconds, finished requests, queue and running) every second.

Three controllers over the same arrivals (same seed):
- planner: omnistage's planner;
- optimal: an oracle that knows the true capacities and each instant's load, sizes every stage with
  the same sizing (utilisation 0.8, the same budget) and whose replicas start at once;
- hpa: each stage on its own, as the Kubernetes HPA does on a CPU-like utilisation metric (the share
  of its replicas' batch slots in use): every 15 s, desired = ceil(replicas x utilisation / 0.8) outside
  a 10% tolerance, scale-up at most max(4, 100%) per period, scale-down to the highest recommendation
  of the last 300 s; replicas beyond the budget are never granted (pending pods).

Scenarios: a load step (x4 at 60 s), a ramp (x1 to x4 over 300 s), a steady load, and a request mix
that moves the bottleneck (text-heavy: the Thinker; speech-heavy: the Talker) every 120 s under a fixed
budget. A request meets its target when its latency is at most `SLO_FACTOR` times its latency alone;
goodput is those per second. Figures:

- `planner.goodput_per_replica_over_optimal.step` / `.ramp`: (goodput per replica-second) over the
  oracle's (goal >= 0.9), and `planner_over_optimal.goodput.step` / `.ramp`: the goodput alone over the
  oracle's (what the replicas it did not add cost);
- `planner.react_s`: load step to the first scale-up decision (goal <= 5);
- `planner.to_target_s`: load step to the trailing 10 s share of requests meeting their target back at
  95% (with STARTUP_S stated);
- `planner.changes_under_steady_load` after the first 4 minutes (the cold start settled; goal 0);
- `planner_over_per_stage_hpa.goodput` on the moving bottleneck (goal >= 1.3);

Then one run with the real tiny Qwen3-Omni stages under `omnistage serve --autoscale` (not with
--quick): budget 4 replicas for 3 stages (the planner must pick the bottleneck for the fourth), target
utilisation `REAL_UTILIZATION` (a load the clients clearly cross, as the modeled step does),
speech requests from `REAL_CLIENTS` clients for `REAL_LOAD_S` seconds, then `REAL_LIGHT_CLIENTS` of them
go on with shorter answers (`REAL_LIGHT_FRAMES`) while the planner drains the replica it added, then
none: `planner_real.react_s` (load start to the first scale-up), `planner_real.failed_requests` (goal 0),
`planner_real.changes`,
`planner_real.drained`, and which stage it grew (in the results file). The light phase gives
`planner.failed_requests_on_scale_down` (requests failed from the end of the heavy load until
`REAL_AFTER_DRAIN_S` after the drained replica exited; goal 0), `planner_real.scale_down_requests`
(requests served meanwhile) and `planner_real.scale_down_after_s` (the heavy load's end to the
scale-down). The planner's estimates every second (load, capacity, utilisation, desired replicas per
stage) go to the results file.

    .venv/bin/python bench/planner.py [--quick]

Prints a table and writes bench/results/planner.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from common import figure, finish, print_table

from omnistage.api.model import Autoscaling, AutoscalingBudget, AutoscalingTargets, StageAutoscaling
from omnistage.planner.classes import ClassCounts
from omnistage.planner.controller import Planner
from omnistage.planner.load import ReplicaCounters
from omnistage.planner.sizing import Budget, StageNeed, offered_load, plan

REPO = Path(__file__).resolve().parent.parent
DT = 0.1
BATCH = 8
STARTUP_S = 15.0
INTERVAL_S = 1.0
UTILIZATION = 0.8
SLO_FACTOR = 2.0
STAGES = {"thinker": 400.0, "talker": 200.0, "code2wav": 1000.0}   # units per second per replica, full batch
UNITS = {"thinker": "tokens", "talker": "frames", "code2wav": "frames"}
CLASSES = {"text": {"thinker": 256}, "speech": {"thinker": 24, "talker": 120, "code2wav": 120}}
UPSTREAM = {"thinker": (), "talker": ("thinker",), "code2wav": ("talker",)}   # the stage graph (spec.topology)
WARMUP_S = 60.0           # figures count from here (every controller starts at one replica per stage)
STEADY_AFTER_S = 240.0    # the steady load's changes are counted from here (after the cold start settled)
MAX_REPLICAS = 8          # per stage
BUDGET = 12               # replicas of all stages
MIX_PERIOD_S = 120.0      # the mix scenario's request mix shifts this often


def alone_s(cls: str) -> float:
    """A request's latency with no queue: each stage at one batch slot's speed."""
    return sum(units / (STAGES[s] / BATCH) for s, units in CLASSES[cls].items())


# ------------------------------------------------------------------ the model


@dataclass(eq=False)
class Request:
    cls: str
    born: float
    stages: list[str]
    left: float = 0.0


@dataclass(eq=False)
class Replica:
    name: str
    ready_at: float
    draining: bool = False
    serving: list[Request] = field(default_factory=list)
    units: float = 0.0
    busy: float = 0.0
    finished: float = 0.0


class Stage:
    def __init__(self, name: str, capacity: float, replicas: int):
        self.name, self.capacity = name, capacity
        self.queue: deque[Request] = deque()
        self.replicas: list[Replica] = []
        self._made = 0
        for _ in range(replicas):
            self.add(0.0)

    def add(self, ready_at: float) -> None:
        self._made += 1
        self.replicas.append(Replica(f"{self.name}-{self._made}", ready_at))

    def in_service(self, t: float) -> list[Replica]:
        return [r for r in self.replicas if r.ready_at <= t and not r.draining]

    def counted(self) -> int:
        """Replicas that hold budget: serving, starting or draining."""
        return len(self.replicas)

    def drain_one(self, t: float) -> bool:
        live = [r for r in self.replicas if not r.draining]
        if len(live) < 2:
            return False
        starting = [r for r in live if r.ready_at > t]
        victim = starting[-1] if starting else live[-1]   # a replica still starting goes first
        victim.draining = True
        return True

    def step(self, t: float, dt: float) -> list[Request]:
        ready = self.in_service(t)
        while self.queue and ready:
            r = min(ready, key=lambda x: len(x.serving))
            if len(r.serving) >= BATCH:
                break
            r.serving.append(self.queue.popleft())
        done = []
        speed = self.capacity / BATCH * dt
        for r in self.replicas:
            if r.ready_at > t:
                continue
            r.busy += len(r.serving) / BATCH * dt
            for req in list(r.serving):
                used = min(speed, req.left)
                req.left -= used
                r.units += used
                if req.left <= 1e-9:
                    r.serving.remove(req)
                    r.finished += 1
                    done.append(req)
        self.replicas = [r for r in self.replicas if not (r.draining and not r.serving)]
        return done

    def counters(self, t: float) -> dict[str, ReplicaCounters]:
        ready = self.in_service(t)
        return {r.name: ReplicaCounters(t, r.units, r.busy, r.finished, len(self.queue) // max(len(ready), 1),
                                        len(r.serving)) for r in ready}


class FrontDoor:
    """The orchestrator's per-class counters (omnistage_class_*): requests admitted per class, and from each
    finished request's trace the stages that served it and their units."""

    def __init__(self):
        self.admitted: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        self.served: dict[tuple[str, str], float] = {}
        self.units: dict[tuple[str, str], float] = {}

    def admit(self, cls: str) -> None:
        self.admitted[cls] = self.admitted.get(cls, 0.0) + 1

    def finish(self, req: Request) -> None:
        self.finished[req.cls] = self.finished.get(req.cls, 0.0) + 1
        for stage, units in CLASSES[req.cls].items():
            self.served[(req.cls, stage)] = self.served.get((req.cls, stage), 0.0) + 1
            self.units[(req.cls, stage)] = self.units.get((req.cls, stage), 0.0) + units

    def counts(self) -> ClassCounts:
        # every modeled request ends finished: ended is finished
        return ClassCounts(dict(self.admitted), dict(self.finished), dict(self.served), dict(self.units),
                           dict(self.finished))


@dataclass
class Scenario:
    name: str
    horizon: float
    rates: Callable[[float], Mapping[str, float]]   # requests per second per class at time t
    budget: int = BUDGET


@dataclass
class Outcome:
    done: list[tuple[float, float, bool]] = field(default_factory=list)   # (finish time, latency, met)
    replica_seconds: float = 0.0
    changes: list[tuple[float, str, int, int]] = field(default_factory=list)

    def goodput(self, start: float, end: float) -> float:
        return sum(1 for t, _, met in self.done if start <= t < end and met) / (end - start)

    def goodput_per_replica(self, start: float, end: float) -> float:
        return self.goodput(start, end) / (self.replica_seconds / (end - start))


def simulate(sc: Scenario, controller, seed: int = 1, warmup: float = 0.0) -> Outcome:
    rng = random.Random(seed)
    stages = {name: Stage(name, cap, 1) for name, cap in STAGES.items()}
    front = FrontDoor()
    out, t, next_decision = Outcome(), 0.0, 0.0
    while t < sc.horizon:
        for cls, rate in sc.rates(t).items():
            for _ in range(_poisson(rng, rate * DT)):
                order = [s for s in STAGES if CLASSES[cls].get(s)]
                req = Request(cls, t, order, CLASSES[cls][order[0]])
                stages[order[0]].queue.append(req)
                front.admit(cls)
        for name in STAGES:
            for req in stages[name].step(t, DT):
                i = req.stages.index(name)
                if i + 1 < len(req.stages):
                    req.left = CLASSES[req.cls][req.stages[i + 1]]
                    stages[req.stages[i + 1]].queue.append(req)
                else:
                    front.finish(req)
                    latency = t + DT - req.born
                    out.done.append((t + DT, latency, latency <= SLO_FACTOR * alone_s(req.cls)))
        if t >= warmup:
            out.replica_seconds += sum(s.counted() for s in stages.values()) * DT
        if t >= next_decision - 1e-9:
            next_decision += INTERVAL_S
            want = controller.decide(t, stages, front)
            _reconcile(t, stages, want, sc.budget, out, getattr(controller, "instant", False))
        t = round(t + DT, 6)
    return out


def _reconcile(t, stages, want, budget, out, instant) -> None:
    for name, n in want.items():
        st = stages[name]
        live = sum(not r.draining for r in st.replicas)
        for _ in range(live - n):
            st.drain_one(t)
        for _ in range(n - live):
            if sum(s.counted() for s in stages.values()) >= budget:
                break  # beyond the budget: a pending pod that never starts
            st.add(t if instant else t + STARTUP_S)
        now_live = sum(not r.draining for r in st.replicas)
        if now_live != live:
            out.changes.append((t, name, live, now_live))


def _poisson(rng: random.Random, mean: float) -> int:
    n, p, limit = 0, 1.0, math.exp(-mean)
    while True:
        p *= rng.random()
        if p <= limit:
            return n
        n += 1


# ------------------------------------------------------------------ the controllers


class PlannerControl:
    def __init__(self, budget: int, classes: bool = True):
        """`classes`: the planner reads the front door's per-class counters (as serve and the operator do);
        without, it sees the stages' counters only (as it did before request classes)."""
        self.classes = classes
        cfg = Autoscaling(enabled=True, interval_seconds=INTERVAL_S,
                          targets=AutoscalingTargets(queue_seconds=1.0, utilization=UTILIZATION),
                          budget=AutoscalingBudget(max_replicas=budget),
                          stages={s: StageAutoscaling(1, MAX_REPLICAS, 30.0) for s in STAGES})
        self.planner = Planner(cfg, {s: 1 for s in STAGES}, upstream=UPSTREAM)

    def decide(self, t, stages, front) -> dict[str, int]:
        for name, st in stages.items():
            self.planner.observe(name, st.counters(t), UNITS[name])
        if self.classes:
            self.planner.observe_classes({"orchestrator": front.counts()}, t)
        self.planner.decide(t)
        return self.planner.desired()


class OracleControl:
    instant = True

    def __init__(self, rates, budget: int):
        self.rates, self.budget = rates, budget

    def decide(self, t, stages, front) -> dict[str, int]:
        load = offered_load(self.rates(t), CLASSES)
        needs = [StageNeed(s, load.get(s, 0.0), cap, 1, MAX_REPLICAS) for s, cap in STAGES.items()]
        return plan(needs, Budget(max_replicas=self.budget), UTILIZATION).replicas()


class HpaControl:
    PERIOD_S, TOLERANCE, DOWN_WINDOW_S = 15.0, 0.1, 300.0

    def __init__(self):
        self.next = 0.0
        self.last: dict[str, tuple[float, float]] = {}
        self.recommended: dict[str, deque] = {s: deque() for s in STAGES}
        self.current = {s: 1 for s in STAGES}

    def decide(self, t, stages, front) -> dict[str, int]:
        if t < self.next:
            return self.current
        self.next = t + self.PERIOD_S
        for name, st in stages.items():
            ready = st.in_service(t)
            busy = sum(r.busy for r in st.replicas)
            b0, t0 = self.last.get(name, (busy, t))
            self.last[name] = (busy, t)
            if t <= t0 or not ready:
                continue
            util = (busy - b0) / (t - t0) / len(ready)
            n = self.current[name]
            ratio = util / UTILIZATION
            desired = n if abs(ratio - 1) <= self.TOLERANCE else math.ceil(n * ratio)
            desired = min(desired, max(n + 4, 2 * n), MAX_REPLICAS)
            rec = self.recommended[name]
            rec.append((t, max(desired, 1)))
            while rec and rec[0][0] < t - self.DOWN_WINDOW_S:
                rec.popleft()
            self.current[name] = desired if desired > n else max(d for _, d in rec)
        return self.current


# ------------------------------------------------------------------ the figures


def base_rates(scale: float, speech_share: float = 0.7) -> dict[str, float]:
    """Requests per second; scale 1 keeps a replica of each stage busy at about half."""
    total = 1.2 * scale
    return {"speech": total * speech_share, "text": total * (1 - speech_share)}


def to_target(out: Outcome, step_at: float, horizon: float, share: float = 0.95, hold: float = 20.0) -> float:
    """Seconds from the step until the trailing 10 s share of requests meeting their target is back at
    `share` and stays there `hold` seconds."""
    t = step_at
    good_since = None
    while t < horizon:
        window = [met for ft, _, met in out.done if t - 10 <= ft < t]
        ok = window and sum(window) / len(window) >= share
        good_since = (good_since if good_since is not None else t) if ok else None
        if good_since is not None and t - good_since >= hold:
            return good_since - step_at
        t += 1.0
    return float("inf")


def seed_figures(scenarios, results, step_at) -> list[dict]:
    figures = []
    for name in ("step", "ramp"):
        sc = scenarios[name]
        ours, best = results[(name, "planner")], results[(name, "optimal")]
        figures.append(figure(f"planner.goodput_per_replica_over_optimal.{name}",
                              ours.goodput_per_replica(WARMUP_S, sc.horizon) /
                              best.goodput_per_replica(WARMUP_S, sc.horizon), "x"))
        # the goodput alone: what fewer replicas cost in requests that missed their target
        figures.append(figure(f"planner_over_optimal.goodput.{name}",
                              ours.goodput(WARMUP_S, sc.horizon) / best.goodput(WARMUP_S, sc.horizon), "x"))
    step = results[("step", "planner")]
    react = min((t for t, _, before, after in step.changes if t >= step_at and after > before), default=math.inf)
    figures.append(figure("planner.react_s", react - step_at, "s"))
    figures.append(figure("planner.to_target_s", to_target(step, step_at, scenarios["step"].horizon), "s"))
    figures.append(figure("planner.startup_s_modeled", STARTUP_S, "s"))
    steady = results[("steady", "planner")]
    figures.append(figure("planner.changes_under_steady_load",
                          sum(1 for t, *_ in steady.changes if t >= STEADY_AFTER_S), "changes"))
    mix = scenarios["mix"]

    def mix_ratio(ours: str, theirs: str) -> float:
        return (results[("mix", ours)].goodput(WARMUP_S, mix.horizon) /
                results[("mix", theirs)].goodput(WARMUP_S, mix.horizon))
    figures.append(figure("planner_over_per_stage_hpa.goodput", mix_ratio("planner", "hpa"), "x"))
    figures.append(figure("planner_over_optimal.goodput.mix", mix_ratio("planner", "optimal"), "x"))
    # request classes: the same planner without the front door's per-class counters (stage counters only)
    figures.append(figure("planner_stages_only_over_optimal.goodput.mix",
                          mix_ratio("planner_stages_only", "optimal"), "x"))
    figures.append(figure("planner_classes_over_stages_only.goodput.mix",
                          mix_ratio("planner", "planner_stages_only"), "x"))
    figures.append(figure("planner.react_s_mix_shift", mix_react(results[("mix", "planner")], mix), "s"))
    figures.append(figure("planner_stages_only.react_s_mix_shift",
                          mix_react(results[("mix", "planner_stages_only")], mix), "s"))
    for name in ("step", "ramp"):
        sc = scenarios[name]
        figures.append(figure(f"planner_stages_only.goodput_per_replica_over_optimal.{name}",
                              results[(name, "planner_stages_only")].goodput_per_replica(WARMUP_S, sc.horizon) /
                              results[(name, "optimal")].goodput_per_replica(WARMUP_S, sc.horizon), "x"))
    return figures


def mix_react(out: Outcome, sc: Scenario) -> float:
    """Mean seconds from each shift of the request mix (every MIX_PERIOD_S after the warm-up) to the first
    replica added to the stage it made the bottleneck (the oracle's busiest stage after it); a shift never
    answered counts the time to the next."""
    waits = []
    shift = MIX_PERIOD_S * math.ceil(WARMUP_S / MIX_PERIOD_S)
    while shift < sc.horizon:
        load = offered_load(sc.rates(shift), CLASSES)
        bottleneck = max(STAGES, key=lambda s: load.get(s, 0.0) / STAGES[s])
        end = min(shift + MIX_PERIOD_S, sc.horizon)
        first = min((t for t, stage, before, after in out.changes
                     if shift <= t < end and stage == bottleneck and after > before), default=end)
        waits.append(first - shift)
        shift += MIX_PERIOD_S
    return statistics.mean(waits) if waits else math.nan


REAL_CLIENTS = 6
REAL_LOAD_S = 60.0
REAL_LIGHT_CLIENTS = 2     # kept on while the planner drains the added replica (two: the orchestrator sends a lone
                           # request to the same replica every time, so one client would leave the drained one idle)
# Speech per request in the light phase (100 frames under the heavy load): two clients of full requests keep
# the Talker above what one replica serves at REAL_UTILIZATION's band, so nothing would drain.
REAL_LIGHT_FRAMES = 25
REAL_DRAIN_WAIT_S = 180.0  # the light phase ends this long after the heavy one at the latest
REAL_AFTER_DRAIN_S = 10.0  # ... or this long after the drained replica exited
# Longer than a replica takes to start here (~18 s): the replica added under load serves before fewer replicas
# can be judged enough (with 10 s, the noisy load often gave it up while it started, and another stage grew).
REAL_SCALE_DOWN_DELAY_S = 20.0
# The target the real run plans to: its load must cross it clearly, as the modeled step (x4) does. On two
# cores the six clients hold the busiest stage at 0.6-0.85 of one replica, which at the default 0.8 is a
# load at the target, not a step over it: no planner can tell that within 5 s at ~2.5 requests/s.
REAL_UTILIZATION = 0.5


def estimates_line(t: float, gauges: Mapping[str, Mapping[str, float]]) -> str:
    """One reading of the planner's gauges, one line: "12s talker 171/345=0.49 x2 d0.62 ..." (per stage: offered
    load over the capacity of one replica, units per second, their utilisation, the replicas it wants, and the
    dispersion of its arrivals against Poisson's; "t12" when 12 units/s of the load are an upstream's backlog in
    transit)."""
    return f"{t:.0f}s " + " ".join(
        f"{stage} {g.get('offered_load', 0):.0f}/{g.get('capacity', 0):.0f}={g.get('utilization', 0):.2f} "
        f"x{g.get('desired_replicas', 0):.0f} d{g.get('arrival_dispersion', 1):.2f}"
        + (f" t{g['in_transit']:.0f}" if g.get("in_transit", 0) > 0 else "") for stage, g in gauges.items())


def real_run(tmp: Path) -> tuple[list[dict], dict]:
    """The tiny Qwen3-Omni stages under `omnistage serve --autoscale` (see the module docstring)."""
    import urllib.request

    import yaml

    from omnistage.client import OmniClient
    from omnistage.contract.launch import METRICS_PATH
    from omnistage.local.serve import TARGETS_FILE
    from omnistage.planner.scrape import replica_counters

    doc = yaml.safe_load((REPO / "examples" / "qwen3-omni-tiny.yaml").read_text())
    doc["spec"]["deployment"]["autoscaling"] = {
        "enabled": True, "intervalSeconds": 1.0, "budget": {"maxReplicas": 4},
        "targets": {"utilization": REAL_UTILIZATION},
        "stages": {s: {"minReplicas": 1, "maxReplicas": 2, "scaleDownDelaySeconds": REAL_SCALE_DOWN_DELAY_S}
                   for s in STAGES}}
    path = tmp / "qwen3-omni-auto.yaml"
    path.write_text(yaml.safe_dump(doc))
    log = tmp / "serve.out"
    serve = subprocess.Popen([sys.executable, "-m", "omnistage.local.cli", "serve", str(path), "--autoscale",
                              "--no-api", "--no-tls", "--models", str(REPO / "models"), "--log-dir", str(tmp / "logs")],
                             stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO)

    def wait_for(pattern: str, timeout: float, since: int = 0) -> re.Match | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, log.read_text()[since:], re.M)
            if m:
                return m
            if serve.poll() is not None:
                raise RuntimeError(f"serve exited with {serve.returncode}:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        return None

    def must(m: re.Match | None, what: str) -> re.Match:
        if m is None:
            raise RuntimeError(f"no {what}:\n{log.read_text()[-3000:]}")
        return m

    trace: list[str] = []   # every second, the planner's estimates (its own metrics): `estimates_line`
    added: dict[str, list[tuple[float, float, int]]] = {}   # added replica -> (time, requests ended, held)

    def sample(url: str, t0: float, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            try:
                text = urllib.request.urlopen(url, timeout=2).read().decode()
                targets = json.loads((tmp / "logs" / TARGETS_FILE).read_text())
            except (OSError, ValueError):
                continue
            gauges: dict[str, dict[str, float]] = {}
            for m in re.finditer(r'^omnistage_planner_(\w+)\{pipeline="[^"]*",stage="(\w+)"\} (\S+)$', text, re.M):
                gauges.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
            trace.append(estimates_line(time.monotonic() - t0, gauges))
            for target in targets:   # the replicas in service; one drained leaves this file first
                name = target["labels"]["process"]
                if "[+" in name:
                    try:
                        text = urllib.request.urlopen(f"http://{target['targets'][0]}{METRICS_PATH}", timeout=1).read()
                    except OSError:
                        continue
                    c, _ = replica_counters(text.decode(), 0.0)
                    added.setdefault(name, []).append((time.monotonic(), c.finished, c.queued + c.running))

    try:
        endpoint = must(wait_for(r"serving on (127\.0\.0\.1:\d+)", 600), "endpoint").group(1)
        metrics_url = must(wait_for(r"decisions at (\S+)", 10), "planner metrics").group(1)
        heavy_stop, light_stop, sampler_stop = threading.Event(), threading.Event(), threading.Event()
        ok: list[float] = []
        failed: list[tuple[float, str]] = []

        def client(i: int, stop: threading.Event) -> None:
            with OmniClient(endpoint) as c:
                while not stop.is_set():
                    try:
                        frames = REAL_LIGHT_FRAMES if heavy_stop.is_set() else 100
                        c.generate(f"say something {i}", max_tokens=16, max_codec_frames=frames, timeout=300)
                        ok.append(time.monotonic())
                    except Exception as e:  # noqa: BLE001 - a failed request is what this counts
                        failed.append((time.monotonic(), repr(e)))

        t0 = time.monotonic()
        load_start = len(log.read_text())
        sampler = threading.Thread(target=sample, args=(metrics_url, t0, sampler_stop), daemon=True)
        sampler.start()
        threads = [threading.Thread(target=client, args=(i, light_stop if i < REAL_LIGHT_CLIENTS else heavy_stop))
                   for i in range(REAL_CLIENTS)]
        for t in threads:
            t.start()
        up = must(wait_for(r"^planner: (\S+) 1 -> 2 replicas", REAL_LOAD_S, load_start), "scale-up under load")
        react = time.monotonic() - t0
        grown = up.group(1)
        time.sleep(max(0.0, REAL_LOAD_S - (time.monotonic() - t0)))
        # The light phase: REAL_LIGHT_CLIENTS keep sending while the planner drains the added replica.
        heavy_stop.set()
        light_at, light_from = time.monotonic(), len(log.read_text())
        # the stage grown by then (the first one may have been given up while it started, another grown instead)
        counts = {m.group(1): int(m.group(2)) for m in
                  re.finditer(r"^planner: (\S+) \d+ -> (\d+) replicas", log.read_text()[load_start:], re.M)}
        at_two = "|".join(re.escape(s) for s, n in counts.items() if n == 2) or "(?!)"
        # a drain of a replica in service (one given up while still starting serves nothing: not a drain)
        down = wait_for(rf"stage ({at_two})\[(\+\d+)\]: out of service, draining(?: \(holding (\d+) request)?",
                        REAL_DRAIN_WAIT_S, light_from)
        down_s = time.monotonic() - light_at if down else None
        drained, held = (down.group(1), down.group(3)) if down else (None, None)
        gone = wait_for(re.escape(f"stage {drained}[{down.group(2)}]: drained, exited with code ") + r"(-?\d+)",
                        max(0.0, REAL_DRAIN_WAIT_S - (time.monotonic() - light_at)), light_from) if down else None
        time.sleep(REAL_AFTER_DRAIN_S if gone else 0.0)
        light_end = time.monotonic()
        light_stop.set()
        for t in threads:
            t.join(300)
        wait_for(r"drained, exited with code 0", 0 if gone else 120, load_start)   # counted below
        time.sleep(3)
        sampler_stop.set()
        out = log.read_text()[load_start:]
    finally:
        serve.terminate()
        serve.wait(120)
    changes = len(re.findall(r"^planner: \S+ \d+ -> \d+ replicas", out, re.M))
    drains = len(re.findall(r"drained, exited with code 0", out))
    light_ok = sum(1 for t in ok if light_at <= t <= light_end)
    # the drained replica in the light phase, until it left service: requests it ended, the most it held at a reading
    seen = [(f, h) for t, f, h in added.get(f"stage {drained}[{down.group(2)}]", []) if t >= light_at] if down else []
    served_light = seen[-1][0] - seen[0][0] if seen else None
    held_most = max(h for _, h in seen) if seen else None
    light_failed = [e for t, e in failed if light_at <= t <= light_end]
    figures = [figure("planner_real.react_s", react, "s"),
               figure("planner_real.failed_requests", len(failed), "requests"),
               figure("planner_real.requests", len(ok), "requests"), figure("planner_real.changes", changes, "changes"),
               figure("planner_real.drained", drains, "replicas")]
    if gone:  # a drain under traffic happened: what it failed
        figures += [figure("planner.failed_requests_on_scale_down", len(light_failed), "requests"),
                    figure("planner_real.scale_down_requests", light_ok, "requests"),
                    figure("planner_real.scale_down_after_s", down_s, "s")]
    print(f"  real: grew {grown} after {react:.1f}s; {len(ok)} requests, {len(failed)} failed; {changes} changes, "
          f"{drains} drained", flush=True)
    print(f"  real, {REAL_LIGHT_CLIENTS} clients on: " + (
        f"{drained} 2 -> 1 after {down_s:.1f}s (the replica had ended {served_light} requests since the heavy "
        f"load, held up to {held_most}, {held} when drained), exited with code {gone.group(1)}; "
        f"{light_ok} requests, {len(light_failed)} failed meanwhile" if gone else
        f"no drain within {REAL_DRAIN_WAIT_S:.0f}s ({light_ok} requests, {len(light_failed)} failed)"), flush=True)
    return figures, {"real_run": {
        "grown_first": grown, "failures": [e for _, e in failed][:5],
        "decisions": re.findall(r"^planner: .*$", out, re.M),
        "replicas": re.findall(r"^  stage \S+\[\+\d+\]: .*$", out, re.M),   # the added ones
        "scale_down_under_traffic": {
            "clients": REAL_LIGHT_CLIENTS, "phase_s": round(light_end - light_at, 1), "stage": drained,
            "down_after_s": round(down_s, 1) if down_s is not None else None,
            "drained_exit_code": int(gone.group(1)) if gone else None,
            "held_when_drained": int(held) if held is not None else None,
            "drained_replica_ended_requests": served_light, "drained_replica_held_most": held_most,
            "requests": light_ok, "failed": len(light_failed), "failures": light_failed[:5]},
        "estimates": trace}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one seed, no run with the real stages")
    ap.add_argument("--modeled", action="store_true",
                    help="the modeled scenarios over every seed only: no run with the real stages, no results file")
    args = ap.parse_args()
    started = time.perf_counter()
    seeds = (7,) if args.quick else (7, 8, 9, 10, 11)
    step_at = 60.0
    scenarios = {
        "step": Scenario("step", 360, lambda t: base_rates(1.0 if t < step_at else 4.0)),
        "ramp": Scenario("ramp", 360, lambda t: base_rates(1.0 + 3.0 * min(max(t - 60, 0) / 300, 1))),
        "steady": Scenario("steady", 600, lambda t: base_rates(3.0)),
        # the bottleneck moves: speech-heavy (the Talker) and text-heavy (the Thinker) every 120 s
        "mix": Scenario("mix", 540, lambda t: base_rates(5.0, 0.9 if int(t // MIX_PERIOD_S) % 2 == 0 else 0.15),
                        budget=8),
    }
    figures, rows = [], []
    per_seed = []
    for seed in seeds:
        results: dict[tuple[str, str], Outcome] = {}
        for name, sc in scenarios.items():
            for label, ctl in (("planner", PlannerControl(sc.budget)),
                               ("planner_stages_only", PlannerControl(sc.budget, classes=False)),
                               ("optimal", OracleControl(sc.rates, sc.budget)),
                               ("hpa", HpaControl())):
                out = results[(name, label)] = simulate(sc, ctl, seed=seed, warmup=WARMUP_S)
                span = sc.horizon - WARMUP_S
                g, gpr = out.goodput(WARMUP_S, sc.horizon), out.goodput_per_replica(WARMUP_S, sc.horizon)
                rows.append((seed, name, label, g, gpr, out.replica_seconds / span, len(out.changes)))
                print(f"  seed {seed} {name:7s} {label:8s} goodput {g:6.2f} req/s  per replica {gpr:6.3f}  "
                      f"replicas {out.replica_seconds / span:5.2f}  changes {len(out.changes)}", flush=True)
        per_seed.append(seed_figures(scenarios, results, step_at))
    figures = [figure(f["name"], statistics.mean(s[i]["value"] for s in per_seed), f["unit"])
               for i, f in enumerate(per_seed[0])]
    real_extra: dict = {}
    if args.modeled:
        print_table("stage planner (modeled stages in virtual time)", figures)
        return 0
    if not args.quick:
        with tempfile.TemporaryDirectory() as tmp:
            real, real_extra = real_run(Path(tmp))
        figures += real
    print_table("stage planner (modeled stages in virtual time; planner_real: tiny Qwen3-Omni, serve --autoscale)",
                figures)
    finish("planner", figures, started, {"model": {"dt_s": DT, "batch": BATCH, "startup_s": STARTUP_S,
                                                   "capacities": STAGES, "classes": CLASSES, "budget": BUDGET,
                                                   "slo_factor": SLO_FACTOR},
                                         **real_extra, "seeds": list(seeds),
                                         "runs": [{"seed": r[0], "scenario": r[1], "controller": r[2],
                                                   "goodput": round(r[3], 3), "goodput_per_replica": round(r[4], 4),
                                                   "mean_replicas": round(r[5], 2), "changes": r[6]} for r in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
