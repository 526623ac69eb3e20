"""The pipeline targets the orchestrators measure (`targets.ttfpP95Ms`, `targets.rtf`, `targets.underruns`)
against their values, from the orchestrators' histograms of them (`omnistage_request_first_output_seconds`,
`omnistage_request_rtf`) and their audio counters (`omnistage_audio_chunks`, `omnistage_audio_underruns`).

Utilisation sizes each stage for throughput; a latency target can still be missed at a utilisation that
looks fine (bursts queue, a long prompt holds a step, audio comes out slower than it plays). So when a
target's p95 over the window is above it, the planner plans the bottleneck (the stage with the highest
utilisation at the replicas it runs) as if its load were higher by p95 / target (at most `MAX_PRESSURE`):
it gets the next replica though its utilisation alone would not ask for one. Both targets missed: the
larger pressure (one stage planned once, not twice over). Below every target nothing changes: utilisation
and the scale-down band decide as before.

Underruns (audio chunks that reached the client after the audio before them had finished playing) are a
share of the chunks delivered over the window, so a load that doubles both moves nothing. Above the
target, the pressure is share / target (at most `MAX_PRESSURE`) as for the p95s, but the controller puts
it on the busiest growable stage on the audio path only (graph.audio_path): a stage that never feeds the
audio cannot make it late.

Pure: cumulative bucket counts and counters in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from omnistage.api.model import AutoscalingTargets
from omnistage.planner.scrape import AUDIO_CHUNKS, AUDIO_UNDERRUNS, FIRST_OUTPUT_SECONDS, RTF

# Fewer requests than this in a window say nothing of a p95.
MIN_REQUESTS = 5
# Fewer audio chunks than this in a window say nothing of a share: one late chunk among fewer would read as
# more than 1%, a target's usual size (a request of 10 s of speech is some 10 to 40 chunks).
MIN_CHUNKS = 100
# A missed target raises the bottleneck's planned load by at most this factor per decision.
MAX_PRESSURE = 2.0

Buckets = Mapping[float, float]   # upper bound (math.inf last) -> cumulative count
Counters = Mapping[str, float]    # counter name (scrape.ORCHESTRATOR_COUNTERS) -> its cumulative value


@dataclass(frozen=True)
class OrchestratorTarget:
    """A pipeline target read from an orchestrator histogram."""

    histogram: str                                  # the metric it is read from (scrape.py)
    value: Callable[[AutoscalingTargets], float]    # the target's value in the spec; 0: no target
    told: str                                       # a miss for a person, formatted with (p95, target)
    per_unit: float = 1.0                           # the spec's units in one of the histogram's (1e3: ms per s)


TARGETS = (
    OrchestratorTarget(FIRST_OUTPUT_SECONDS, lambda t: t.ttfp_p95_ms,
                       "first packet p95 {:.0f} ms over the {:.0f} ms target", per_unit=1e3),
    OrchestratorTarget(RTF, lambda t: t.rtf, "rtf p95 {:.2f} over the {:.2f} target"),
)


def p95(before: Buckets, after: Buckets) -> float | None:
    """The 95th percentile over the requests between two readings (an orchestrator restarted counts from
    zero): the upper bound of the bucket that holds it; None below MIN_REQUESTS."""
    bounds = sorted(after)
    if not bounds:
        return None
    reset = any(after[b] < before.get(b, 0.0) for b in bounds)
    delta = {b: after[b] - (0.0 if reset else before.get(b, 0.0)) for b in bounds}
    total = delta[bounds[-1]]
    if total < MIN_REQUESTS:
        return None
    return next(b for b in bounds if delta[b] >= 0.95 * total)


def pressure(target: float, measured: float | None) -> float:
    """How much more load the bottleneck is planned for: p95 / target above the target (capped at
    MAX_PRESSURE; an unbounded bucket counts as the cap), else 1."""
    if target <= 0 or measured is None or measured <= target:
        return 1.0
    return MAX_PRESSURE if math.isinf(measured) else min(measured / target, MAX_PRESSURE)


def missed(targets: AutoscalingTargets, p95s: Mapping[str, float | None]) -> tuple[float, list[str]]:
    """The pressure on the bottleneck from every orchestrator target (`p95s` by histogram name): the
    largest of the missed ones' (1 when all are met or unmeasured), and each miss told."""
    factor, told = 1.0, []
    for t in TARGETS:
        target, measured = t.value(targets), p95s.get(t.histogram)
        measured = None if measured is None else measured * t.per_unit   # in the spec's unit
        f = pressure(target, measured)
        if f > 1.0:
            factor = max(factor, f)
            told.append(t.told.format(measured, target))
    return factor, told


def merged(readings: Mapping[str, Buckets]) -> dict[float, float]:
    """The buckets of several orchestrator replicas as one histogram."""
    out: dict[float, float] = {}
    for buckets in readings.values():
        for b, n in buckets.items():
            out[b] = out.get(b, 0.0) + n
    return out


def counted_since(readings: Sequence[Mapping[str, Counters]]) -> dict[str, float]:
    """What the orchestrator replicas counted over successive readings (oldest first; each by replica name):
    per replica, the increase from each of its readings to its next, summed (as Prometheus' `increase`): a
    counter that went back between two readings restarted in between and counted from zero, so that step
    adds its new value. A replica first read in the newest reading adds nothing. Counted per replica, not
    summed first: a replica missing from one reading would otherwise read as every other one's restart."""
    out: dict[str, float] = {}
    last: dict[str, Counters] = {}
    for reading in readings:
        for replica, now in reading.items():
            before = last.get(replica)
            if before is not None:
                reset = any(v < before.get(k, 0.0) for k, v in now.items())
                for k, v in now.items():
                    out[k] = out.get(k, 0.0) + v - (0.0 if reset else before.get(k, 0.0))
            last[replica] = now
    return out


def underrun_pressure(target: float, late: float, chunks: float) -> float:
    """How much more load the busiest stage on the audio path is planned for when `late` of `chunks` audio
    chunks were underruns: their share over the target (capped at MAX_PRESSURE) above it, else 1; 1 too
    under MIN_CHUNKS chunks, or with no target."""
    if target <= 0 or chunks < MIN_CHUNKS:
        return 1.0
    return pressure(target, late / chunks)


def underruns_missed(targets: AutoscalingTargets, counts: Mapping[str, float]) -> tuple[float, str]:
    """The underrun target's pressure from what the orchestrators counted over the window (`counted_since`), and
    the miss told ("" when met, unmeasured or no target)."""
    late, chunks = counts.get(AUDIO_UNDERRUNS, 0.0), counts.get(AUDIO_CHUNKS, 0.0)
    f = underrun_pressure(targets.underruns, late, chunks)
    if f <= 1.0:
        return 1.0, ""
    return f, f"underruns {late / chunks:.1%} of {chunks:.0f} audio chunks over the {targets.underruns:.1%} target"
