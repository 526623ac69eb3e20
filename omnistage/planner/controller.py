"""The planner's memory between decisions: recent counters, estimates and each stage's scale.

A controller (the operator's, or `omnistage serve --autoscale`'s) reads every stage replica's counters
each `intervalSeconds` and hands them to `observe`; `decide` then measures each stage over the last
`WINDOW_S` (long enough that a few requests more or less do not move it much), the last `RECENT_S` (a
load step shows there within a second or two) and the stage's scale-down delay (what fewer replicas
would have to serve), updates the estimates, plans and decides. Given the stage graph (`upstream`: each
stage's input stages, spec.topology), a stage's load in each window is bounded by what its upstream was
offered in it (graph.py): an upstream's catch-up passing through counts as backlog, not as a new rate.
Given the orchestrators' per-class counters (`observe_classes`), each stage is also planned for at least
what the front door's admissions surely send it at each request class's demand (classes.py): a shift in
the request mix reaches the stage it loads at the next decision, not once its upstream has passed it on.
Given the stages on the audio path (`audio_path`: graph.audio_path) and the orchestrators' audio counters
(`observe_audio`), a share of late audio chunks over `targets.underruns` presses the busiest of those
stages only (latency.py). Given the jobs the orchestrators count queued in their job store and their job slots
(`observe_jobs`), each stage is planned for the queued jobs that free slots take now too: their work there
over the drain time, at most a replica a job (jobs.py); the jobs that wait for a slot reach no stage sooner
for more replicas, and add nothing.
What the controller does with the result is its own: write Deployments' replicas, or start and drain
local processes until each stage runs `scales[stage].replicas`.

No I/O: time comes in as arguments, so tests drive it with a clock of their own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from omnistage.api.model import Autoscaling, StageAutoscaling
from omnistage.planner import load
from omnistage.planner.classes import ClassCounts, ClassDemand, Forecast, counted, forecast
from omnistage.planner.classes import demand as class_demand
from omnistage.planner.decisions import Change, StageScale, decide
from omnistage.planner.graph import demand_per_request, edge_ratio, steady_arrivals
from omnistage.planner.jobs import JobsReading, job_demand, jobs_backlog, jobs_entering, merged_jobs
from omnistage.planner.latency import Buckets, Counters, counted_since, merged, missed, p95, underruns_missed
from omnistage.planner.scrape import ORCHESTRATOR_HISTOGRAMS
from omnistage.planner.sizing import Budget, Plan, StageNeed, plan

WINDOW_S = 10.0
RECENT_S = 3.0
# A stage grows only for load it surely has: the least its window's request count says at this many standard
# errors (load.load_floor). A steady Poisson load's bursts seldom clear 1.5 over the long window (or the
# scale-down delay's); the recent window is three times as short, so it has three times the chances a
# minute and each is noisier: 2.5 there. A load step to several times what the stage serves at the target
# still clears it within a few seconds.
GROW_ERRORS = 1.5
GROW_ERRORS_RECENT = 2.5


@dataclass(frozen=True)
class Decision:
    plan: Plan
    changes: list[Change]
    estimates: Mapping[str, load.StageEstimate]
    units: Mapping[str, str]   # per stage, what its capacity counts ("tokens/s"; "units/s" before its first step)
    # per stage, the work units one request entering the pipeline takes there (graph.demand_per_request)
    demand: Mapping[str, float] = field(default_factory=dict)
    # per stage, the work units per second the front door's admissions over the last window send it, at each
    # request class's demand (classes.forecast; absent before any class is known)
    forecast: Mapping[str, float] = field(default_factory=dict)
    classes: Mapping[str, ClassDemand] = field(default_factory=dict)
    # per stage, of its load, the work units per second of the queued jobs the free job slots take (jobs.py)
    jobs: Mapping[str, float] = field(default_factory=dict)

    def figures(self, stage: str) -> str:
        """What a change of `stage` rests on, for a person: "53.8 frames/s offered, 272 per replica" (and
        " (12 of it upstream backlog in transit)" when the graph says so, "(80 of it queued jobs)" for jobs waiting
        in the job store, "; 80 on their way from the front door's request mix" when the classes forecast more
        than reached the stage)."""
        est = self.estimates[stage]
        parts = [f"{est.in_transit:.3g} of it upstream backlog in transit" if est.in_transit > 0 else "",
                 f"{self.jobs[stage]:.3g} of it queued jobs" if self.jobs.get(stage, 0.0) > 0 else ""]
        of_it = f" ({', '.join(p for p in parts if p)})" if any(parts) else ""
        ahead = self.forecast.get(stage, 0.0)
        coming = f"; {ahead:.3g} on their way from the front door's request mix" if ahead > est.load else ""
        return f"{est.load:.3g} {self.units[stage]} offered{of_it}, {est.capacity:.3g} per replica{coming}"


class Planner:
    def __init__(self, autoscaling: Autoscaling, replicas: Mapping[str, int], gpus: Mapping[str, int] | None = None,
                 window_s: float = WINDOW_S, fixed: frozenset[str] = frozenset(),
                 upstream: Mapping[str, Sequence[str]] | None = None, audio_path: frozenset[str] = frozenset()):
        """`replicas`: each stage's count now (the file's `replicas`: a starting point, clamped to the
        stage's bounds); `gpus`: GPUs per replica of each stage; `fixed`: stages the controller cannot
        scale (planned at the count they have, so the budget counts what really runs); `upstream`: the
        stage graph, each stage's input stages (graph.upstream_of; None: every stage on its own);
        `audio_path`: the stages the client's audio passes through (graph.audio_path), the only ones a
        missed underrun target presses."""
        self.config = autoscaling
        self.gpus = dict(gpus or {})
        self.window_s = window_s
        self.bounds = {s: StageAutoscaling(replicas[s], replicas[s], autoscaling.bounds(s).scale_down_delay_seconds)
                       if s in fixed else autoscaling.bounds(s) for s in replicas}
        self.scales = {s: StageScale(min(max(n, self.bounds[s].min_replicas), self.bounds[s].max_replicas))
                       for s, n in replicas.items()}
        self.estimates = {s: load.StageEstimate(s) for s in replicas}
        self.units = {s: "" for s in replicas}
        self.upstream = {s: tuple(u for u in (upstream or {}).get(s, ()) if u in replicas) for s in replicas}
        self.ratios: dict[tuple[str, str], float] = {}   # per edge (upstream, stage): graph.edge_ratio
        self.dispersions = {s: 1.0 for s in replicas}    # per stage, of its arrivals (load.dispersion)
        self._history: dict[str, deque[dict[str, load.ReplicaCounters]]] = {s: deque() for s in replicas}
        # per orchestrator histogram (scrape.ORCHESTRATOR_HISTOGRAMS): (at, its buckets merged over replicas)
        self._orchestrators: dict[str, deque[tuple[float, dict[float, float]]]] = {
            name: deque() for name in ORCHESTRATOR_HISTOGRAMS}
        # the orchestrators' per-class counters: (at, per replica), and what each class takes
        self._classes: deque[tuple[float, dict[str, ClassCounts]]] = deque()
        self.audio_path = frozenset(s for s in audio_path if s in replicas)
        # the orchestrators' audio counters (scrape.orchestrator_counters): (at, per replica)
        self._audio: deque[tuple[float, dict[str, Counters]]] = deque()
        self.classes: dict[str, ClassDemand] = {}
        self._jobs: tuple[float, JobsReading] | None = None   # (at, the job gauges merged), the last reading

    @property
    def budget(self) -> Budget:
        return Budget(self.config.budget.max_replicas, self.config.budget.max_gpus)

    def observe(self, stage: str, counters: Mapping[str, load.ReplicaCounters], unit: str = "") -> None:
        """One reading of every replica of a stage (by replica name), all taken at about the same time."""
        if not counters:
            return
        hist = self._history[stage]
        hist.append(dict(counters))
        newest = max(c.at for c in counters.values())
        keep = max(self.window_s, self.bounds[stage].scale_down_delay_seconds)
        while len(hist) > 2 and max(c.at for c in hist[1].values()) <= newest - keep:
            hist.popleft()  # keep one reading at least a window (and a scale-down delay) old
        if unit:
            self.units[stage] = unit

    def observe_orchestrators(self, readings: Mapping[str, Mapping[str, Buckets]], at: float) -> None:
        """One reading of every orchestrator replica's histograms (by replica name, then histogram name:
        scrape.orchestrator_buckets), for the targets read from them (latency.py)."""
        if not readings:
            return
        for name, hist in self._orchestrators.items():
            hist.append((at, merged({r: hs.get(name, {}) for r, hs in readings.items()})))
            while len(hist) > 2 and hist[1][0] <= at - self.window_s:
                hist.popleft()   # keep one reading at least a window old

    def observe_audio(self, readings: Mapping[str, Counters], at: float) -> None:
        """One reading of every orchestrator replica's audio counters (by replica name:
        scrape.orchestrator_counters), for targets.underruns."""
        if not readings:
            return
        self._audio.append((at, {r: dict(c) for r, c in readings.items()}))
        while len(self._audio) > 2 and self._audio[1][0] <= at - self.window_s:
            self._audio.popleft()   # keep one reading at least a window old

    def observe_classes(self, readings: Mapping[str, ClassCounts], at: float) -> None:
        """One reading of every orchestrator replica's per-class counters (by replica name:
        scrape.orchestrator_classes): the request mix at the front door and each class's demand (classes.py)."""
        if not readings:
            return
        if self._classes:
            self.classes = class_demand(self.classes, counted(self._classes[-1][1], readings))
        self._classes.append((at, dict(readings)))
        keep = max([self.window_s, *(b.scale_down_delay_seconds for b in self.bounds.values())])
        while len(self._classes) > 2 and self._classes[1][0] <= at - keep:
            self._classes.popleft()   # keep one reading at least a window (and every scale-down delay) old

    def observe_jobs(self, readings: Mapping[str, JobsReading], at: float) -> None:
        """One reading of every orchestrator replica's job gauges (by replica name: scrape.orchestrator_jobs):
        the jobs queued in the one job store, their job slots and the jobs they run (jobs.merged_jobs)."""
        if readings:
            self._jobs = (at, merged_jobs(readings.values()))

    def _jobs_load(self, now: float, queue_seconds: float) -> tuple[dict[str, float], JobsReading, float]:
        """Per stage, the units per second of the backlog of the queued jobs the free job slots take (jobs.py);
        the jobs reading; how many enter. Nothing once the reading is a window old (no orchestrator answered
        since). A stage whose capacity is not measured yet (too idle to say) gets none: what stands in for its
        capacity is sized to its own load, so a backlog on top would grow it for no measured reason; once
        measured, it is planned like the others. Stages the planner does not run (an orchestrator's counters
        may still name one a rollout renamed) get none."""
        if self._jobs is None or self._jobs[0] < now - self.window_s:
            return {}, JobsReading(0.0), 0.0
        average = demand_per_request(self.upstream, self.ratios,
                                     {s: e.units_per_request for s, e in self.estimates.items()})
        reading = self._jobs[1]
        entering = jobs_entering(reading)
        demand = {s: u for s, u in job_demand(self.classes, average).items() if s in self.estimates}
        # a backlog is planned at full utilisation (sizing.replicas_for): a job's worth is a replica's capacity
        per_replica = {s: e.capacity for s, e in self.estimates.items() if e.capacity > 0}
        return jobs_backlog(entering, demand, queue_seconds, per_replica), reading, entering

    def _forecast(self, seconds: float, now: float) -> dict[str, Forecast]:
        """Per stage, what the front door admitted over about the last `seconds` sends it (classes.forecast);
        empty before two readings, and once the newest is a window old (no orchestrator answered since: what
        they admitted then says nothing of now, and would hold replicas up)."""
        if len(self._classes) < 2 or self._classes[-1][0] < now - self.window_s:
            return {}
        newest, after = self._classes[-1]
        at, before = next(((a, c) for a, c in reversed(self._classes) if a <= newest - seconds), self._classes[0])
        return forecast(self.classes, counted(before, after), newest - at, self._history)

    def _target_pressure(self, needs: list[StageNeed], now: float) -> tuple[list[StageNeed], str]:
        """Needs with the bottleneck's load raised while a target the orchestrators measure is missed (the
        larger pressure when several press the same stage: latency.py), and what the plan's reason should
        add. The p95 targets press the busiest growable stage; the underrun target the busiest growable one
        on the audio path. Readings whose newest is a window old (no orchestrator answered since) say
        nothing of now."""
        p95s = {name: p95(h[0][1], h[-1][1]) if len(h) >= 2 and h[-1][0] >= now - self.window_s else None
                for name, h in self._orchestrators.items()}
        factor, told = missed(self.config.targets, p95s)
        audio = counted_since([r for _, r in self._audio]) if len(self._audio) >= 2 and \
            self._audio[-1][0] >= now - self.window_s else {}
        audio_factor, audio_told = underruns_missed(self.config.targets, audio)
        # the busiest stage that may still grow (one at its maximum would take nothing from it)
        growable = [n for n in needs if n.load > 0 and self.scales[n.stage].replicas < n.max_replicas]
        pressed: dict[str, tuple[float, list[str]]] = {}   # stage -> its pressure, the misses behind it
        for f, why, among in ((factor, told, growable),
                              (audio_factor, [audio_told], [n for n in growable if n.stage in self.audio_path])):
            if f <= 1.0 or not among:
                continue
            worst = max(among, key=lambda n: n.utilization(self.scales[n.stage].replicas)).stage
            had, whys = pressed.get(worst, (1.0, []))
            pressed[worst] = (max(had, f), whys + why)
        raised = [n.scaled(pressed[n.stage][0]) if n.stage in pressed else n for n in needs]
        return raised, "".join(f"; {', '.join(whys)}: {stage} planned at {f:.2f}x its load"
                               for stage, (f, whys) in pressed.items())

    def decide(self, now: float) -> Decision:
        targets = self.config.targets
        windows = self._windows()
        self._measure_edges(windows)
        # per window, the most requests per second that can steadily arrive at each stage (graph.py)
        steady = [steady_arrivals(self.upstream, {s: load.arrived(w[i]) for s, w in windows.items()}, self.ratios,
                                  {s: w[i].seconds for s, w in windows.items()}, errors)
                  for i, errors in enumerate((GROW_ERRORS, GROW_ERRORS_RECENT, GROW_ERRORS))]
        # per window, what the front door's admissions send each stage at its request classes' demand
        spans = {s: (self.window_s, RECENT_S, max(self.bounds[s].scale_down_delay_seconds, self.window_s))
                 for s in windows}
        forecasts = {seconds: self._forecast(seconds, now) for seconds in {x for t in spans.values() for x in t}}
        ahead = {s: tuple(forecasts[seconds] for seconds in spans[s]) for s in windows}
        needs = []
        for stage in self._history:
            est, b = self.estimates[stage], self.bounds[stage]
            unit = f"{self.units[stage] or 'units'}/s"
            if stage not in windows:  # not measured over a window yet: held where it is (a 0 s delay must not cut it)
                held = self.scales[stage].replicas
                needs.append(load.need(est, held, held, self.gpus.get(stage, 0), unit, default_capacity=1.0))
                continue
            long, short, delay_window = windows[stage]
            # the graph bounds what steadily arrives by the upstream's share of its own arrivals, measured over
            # past windows; the request mix at the front door says what share of it is coming now
            fc = [f.get(stage) for f in ahead[stage]]
            bounds = [_with_forecast(steady[i][stage], fc[i], errors)
                      for i, errors in enumerate((GROW_ERRORS, GROW_ERRORS_RECENT, GROW_ERRORS))]
            est = self.estimates[stage] = load.estimate(est, long, targets.queue_seconds, bounds[0])
            per_request = est.units_per_request
            # a load step shows first in the recent window
            recent, recent_backlog = load.offered(per_request, short, targets.queue_seconds, bounds[1])
            # fewer replicas must serve the load over the whole scale-down delay: a window that long, whose
            # count is steadier than any of the shorter ones within it (and a load a little over the target
            # for that long is surely over it, where 10 s could not tell)
            over_delay, delay_backlog = load.offered(per_request, delay_window, targets.queue_seconds, bounds[2])
            # how steady its arrivals are narrows what each window surely holds; each window's backlog is the
            # queue (the same in all) and what it saw in transit (its own)
            d = self.dispersions[stage] = load.dispersion(self._arrival_counts(stage))
            surely = max(load.load_floor(est.load, est.backlog, per_request, long.seconds, GROW_ERRORS, d),
                         load.load_floor(recent, recent_backlog, per_request, short.seconds, GROW_ERRORS_RECENT, d),
                         load.load_floor(over_delay, delay_backlog, per_request, delay_window.seconds, GROW_ERRORS, d),
                         *(load.load_floor(f.load, 0.0, f.per_count, f.seconds, GROW_ERRORS) for f in (fc[0], fc[2])
                           if f is not None))
            if fc[2] is not None:  # fewer replicas must also serve what the front door keeps sending
                over_delay = max(over_delay, fc[2].load)
            planned = max(est.load, surely)
            needs.append(load.need(replace(est, load=planned), b.min_replicas, b.max_replicas,
                                   self.gpus.get(stage, 0), unit,
                                   default_capacity=max(planned, 1.0) / targets.utilization, grow_load=surely,
                                   keep_load=max(over_delay, planned)))
        jobs, reading, entering = self._jobs_load(now, targets.queue_seconds)
        needs = [_with_jobs(n, jobs.get(n.stage, 0.0)) for n in needs]
        running = self.desired()
        needs, why = self._target_pressure(needs, now)
        if jobs:
            why = (f"; {reading.queued:.0f} job{'s' if reading.queued != 1 else ''} queued, {entering:.0f} entering "
                   "free job slots") + why
        p = plan(needs, self.budget, targets.utilization)
        if why:
            p = replace(p, reason=p.reason + why)
        delays = {s: b.scale_down_delay_seconds for s, b in self.bounds.items()}
        self.scales, changes = decide(self.scales, p, now, delays, self.gpus, self.budget)
        demand = demand_per_request(self.upstream, self.ratios,
                                    {s: e.units_per_request for s, e in self.estimates.items()})
        return Decision(p, changes, self._jobs_estimates(jobs, running), {n.stage: n.unit for n in needs}, demand,
                        {s: f.load for s, f in forecasts.get(self.window_s, {}).items()}, dict(self.classes), jobs)

    def _jobs_estimates(self, jobs: Mapping[str, float], replicas: Mapping[str, int]) -> dict[str, load.StageEstimate]:
        """The estimates as the decision reports them: with the queued jobs' backlog in the load (the planner's
        own stay as measured: the next window measures afresh)."""
        out = dict(self.estimates)
        for stage, extra in jobs.items():
            est, n = out[stage], replicas.get(stage, 0)
            util = (est.load + extra) / (n * est.capacity) if n and est.capacity > 0 else 0.0
            out[stage] = replace(est, load=est.load + extra, backlog=est.backlog + extra, utilization=util)
        return out

    def _windows(self) -> dict[str, tuple[load.StageWindow, load.StageWindow, load.StageWindow]]:
        """Per stage measured over a window yet: its last `window_s`, last RECENT_S and last scale-down delay
        (at least `window_s`)."""
        out = {}
        for stage, hist in self._history.items():
            if len(hist) < 2:
                continue
            readings, delay = list(hist), self.bounds[stage].scale_down_delay_seconds
            out[stage] = (load.window_since(stage, readings, self.window_s),
                          load.window_since(stage, readings, RECENT_S),
                          load.window_since(stage, readings, max(delay, self.window_s)))
        return out

    def _arrival_counts(self, stage: str) -> list[float]:
        """The requests that arrived at the stage between each two successive readings kept (the last
        scale-down delay, at least a window): what `load.dispersion` measures."""
        readings = list(self._history[stage])
        return [load.arrived(w) * w.seconds for w in (load.window(stage, a, b) for a, b in zip(readings, readings[1:]))]

    def _measure_edges(self,
                       windows: Mapping[str, tuple[load.StageWindow, load.StageWindow, load.StageWindow]]) -> None:
        """Each edge's share of the upstream's requests that reach the stage, over the window every stage has
        at the same length (`window_s`): what the stage received (arrived) over what the upstream ended,
        which a catch-up passes through alike and a stage that cannot keep up does not lower
        (graph.edge_ratio)."""
        for stage, ins in self.upstream.items():
            for u in ins:
                if stage in windows and u in windows:
                    self.ratios[(u, stage)] = edge_ratio(self.ratios.get((u, stage), 0.0),
                                                         windows[u][0].requests_per_s, load.arrived(windows[stage][0]))

    def desired(self) -> dict[str, int]:
        return {s: sc.replicas for s, sc in self.scales.items()}



def _with_forecast(bound: float | None, f: Forecast | None, errors: float) -> float | None:
    """The graph's bound on a stage's steady arrivals raised to what the front door's admissions send it
    (classes.Forecast.arrivals_bound): the graph's edge shares are measured over past windows and lag a shift
    of the request mix, which would read the first wave of a class as an upstream's catch-up. No bound
    stays none."""
    if bound is None or f is None or f.admitted <= 0:
        return bound
    return max(bound, f.arrivals_bound(errors))


def _with_jobs(need: StageNeed, extra: float) -> StageNeed:
    """The stage's need with the queued jobs' backlog added: counted, not sampled, so it adds alike to the load
    it grows for and the load fewer replicas must serve."""
    if extra <= 0:
        return need
    return replace(need, load=need.load + extra, backlog=need.backlog + extra,
                   grow_load=None if need.grow_load is None else need.grow_load + extra,
                   keep_load=None if need.keep_load is None else need.keep_load + extra)
