"""Request classes in the planner: what the front door admits now, per class, and what a request of each
class takes at each stage, so a stage is sized for the load its class mix is about to send it.

A stage's own counters say what reached it; they lag the front door by every stage upstream of it, and
the average request they measure moves when the mix does. A pipeline whose requests are text-only or
spoken has its bottleneck where the mix puts it (text: the Thinker; speech: the Talker), so a mix shift
moves the bottleneck before anything reaches the Talker, and the stage graph's edge shares (graph.py,
measured over the last windows) read the first wave of speech requests as an upstream catch-up.

The orchestrators count, per request class (its input and output modalities: "text->text+audio"), the
requests they admit and those that ended (finished or not), and, from every finished request's trace,
which stages served it and the work units each did for it (scrape.CLASS_*). From two readings of those
counters:

- `demand`: per class and stage, the work units one admitted request of the class takes there (the
  share of the class that the stage serves included) and that share, over the requests that ended, a
  request that did not finish (cancelled, a stop string, failed) counting none: the forecast multiplies
  admissions by it, so the work of the requests that finish is not charged to those that do not. Each
  reading moves it by as much as the requests it counted say (smoothed by their number);
- `forecast`: per stage, what the front door's admissions over a window send it, at each class's demand:
  requests per second reaching it and work units per second, with how much the units of such a window
  vary (`per_count`), so the planner can take the load it surely is (load.load_floor). Each class's
  admissions are a Poisson count, and a request of class c reaches the stage with probability r_c,
  bringing d_c / r_c units (d_c its demand there): the window's units vary by sum(n_c d_c^2 / r_c), so
  they are a Poisson count in units of that over their mean. Counting only the admissions' total would
  miss the mix's own noise: a 3 s window with 14 requests may hold 90% speech requests where 70% arrive
  on average, and the modeled Talker was given a replica its steady load never needed.

The forecast only ever adds to what a stage measures of itself (controller.py): a class not known yet
counts nothing, and a stage's own counters still say what it is offered.

Pure: counters in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from omnistage.planner.graph import slack

# Each reading moves a class's demand by this much less than the reading says (as load.PER_REQUEST_MEMORY).
DEMAND_MEMORY = 0.8
# A class is forecast from once this many of its requests have finished.
MIN_FINISHED = 5


@dataclass(frozen=True)
class ClassCounts:
    """The orchestrators' class counters at one reading (cumulative; summed over replicas)."""

    admitted: Mapping[str, float] = field(default_factory=dict)            # class -> requests admitted
    finished: Mapping[str, float] = field(default_factory=dict)            # class -> requests finished
    served: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (class, stage) -> finished ones it served
    units: Mapping[tuple[str, str], float] = field(default_factory=dict)   # (class, stage) -> its units for them
    ended: Mapping[str, float] = field(default_factory=dict)               # class -> admitted requests that ended


@dataclass(frozen=True)
class ClassDemand:
    """What one request of a class takes at each stage."""

    cls: str
    finished: float = 0.0                                     # of its requests, finished since first seen
    units: Mapping[str, float] = field(default_factory=dict)  # stage -> work units per request of the class
    reach: Mapping[str, float] = field(default_factory=dict)  # stage -> share of the class's requests it serves

    @property
    def known(self) -> bool:
        return self.finished >= MIN_FINISHED


@dataclass(frozen=True)
class Forecast:
    """What the front door's admissions over a window send a stage."""

    stage: str
    seconds: float
    admitted: float            # requests the front door admitted in the window, of the known classes
    requests_per_s: float      # of them, per second, those that reach the stage
    load: float                # work units per second they bring it
    # the variance of the units the window's admissions bring over their mean (units): one request's worth
    # when every request brings the same, more when the classes differ (see `forecast`)
    per_count: float = 0.0

    @property
    def share(self) -> float:
        """The share of the admitted requests that reach the stage."""
        return self.requests_per_s * self.seconds / self.admitted if self.admitted > 0 else 0.0

    def arrivals_bound(self, errors: float) -> float:
        """The most requests per second that steadily reach the stage from these admissions, with the binomial
        spread of which of them do at `errors` standard deviations (graph.slack)."""
        rate = self.admitted / self.seconds if self.seconds > 0 else 0.0
        return self.requests_per_s + slack(rate, self.share, self.seconds, errors)


Readings = Mapping[str, ClassCounts]   # orchestrator replica -> its counters at one reading


def counted(before: Readings, after: Readings) -> ClassCounts:
    """What the orchestrator replicas counted between two readings. A replica read only once of the two (new,
    gone, or its scrape failed) or restarted between them (a counter went back) adds nothing: the counts are
    then short, which the planner can afford, since the forecast only ever adds to a stage's load. Summing
    each reading over the replicas first would read a replica missing from one reading as a restart, and
    its whole history as admitted in the window."""
    out: tuple[dict, ...] = ({}, {}, {}, {}, {})
    for replica, a in after.items():
        b = before.get(replica)
        if b is None:
            continue
        parts_before, parts_after = _parts(b), _parts(a)
        if any(v < pb.get(k, 0.0) for pb, pa in zip(parts_before, parts_after) for k, v in pa.items()):
            continue
        for into, pb, pa in zip(out, parts_before, parts_after):
            for k, v in pa.items():
                into[k] = into.get(k, 0.0) + v - pb.get(k, 0.0)
    return ClassCounts(*out)


def _parts(c: ClassCounts) -> tuple[Mapping, ...]:
    return c.admitted, c.finished, c.served, c.units, c.ended


def demand(prev: Mapping[str, ClassDemand], d: ClassCounts) -> dict[str, ClassDemand]:
    """Each class's demand after the requests `d` counted ended (classes.counted between two readings; a
    class with none keeps what it had). Per stage, units per request and the share served are over the
    requests that ended (those the stage did not serve, and those that did not finish, counting 0 units;
    over the finished ones where an orchestrator counts no ended requests), smoothed: each request counted
    keeps DEMAND_MEMORY of the rest."""
    out = dict(prev)
    for cls in {*d.finished, *d.ended}:
        finished = d.finished.get(cls, 0.0)
        n = max(d.ended.get(cls, 0.0), finished)
        if n <= 0:
            continue
        old = prev.get(cls, ClassDemand(cls))
        stages = {s for c, s in (*d.served, *d.units) if c == cls} | set(old.units)
        seen_units = {s: d.units.get((cls, s), 0.0) / n for s in stages}
        seen_reach = {s: min(d.served.get((cls, s), 0.0) / n, 1.0) for s in stages}
        keep = 0.0 if old.finished <= 0 else DEMAND_MEMORY ** n   # the first finished requests set it
        out[cls] = ClassDemand(cls, old.finished + finished,
                               {s: keep * old.units.get(s, 0.0) + (1 - keep) * v for s, v in seen_units.items()},
                               {s: keep * old.reach.get(s, 0.0) + (1 - keep) * v for s, v in seen_reach.items()})
    return out


def forecast(demands: Mapping[str, ClassDemand], d: ClassCounts, seconds: float,
             stages: Iterable[str]) -> dict[str, Forecast]:
    """Per stage, what the requests the front door admitted over `seconds` (`d`: classes.counted) send it, at
    each known class's demand; a class not known yet (fewer than MIN_FINISHED finished) is left out."""
    known = {c: n for c, n in d.admitted.items() if n > 0 and c in demands and demands[c].known}
    admitted = sum(known.values())
    out = {}
    for stage in stages:
        if seconds <= 0:
            out[stage] = Forecast(stage, seconds, 0.0, 0.0, 0.0)
            continue
        reaching = sum(n * demands[c].reach.get(stage, 0.0) for c, n in known.items())
        units = sum(n * demands[c].units.get(stage, 0.0) for c, n in known.items())
        spread = sum(n * demands[c].units.get(stage, 0.0) ** 2 / demands[c].reach[stage] for c, n in known.items()
                     if demands[c].reach.get(stage, 0.0) > 0)
        out[stage] = Forecast(stage, seconds, admitted, reaching / seconds, units / seconds,
                              spread / units if units > 0 else 0.0)
    return out
