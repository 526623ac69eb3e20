"""The pipeline's time to first packet against its target (`targets.ttfpP95Ms`), from the orchestrators'
histogram of it (`omnistage_first_output_ms`).

Utilisation sizes each stage for throughput; a latency target can still be missed at a utilisation that
looks fine (bursts queue, a long prompt holds a step). So when the p95 over the window is above the
target, the planner plans the bottleneck (the stage with the highest utilisation at the replicas it runs)
as if its load were higher by p95 / target (at most `MAX_PRESSURE`): it gets the next replica though its
utilisation alone would not ask for one. Below the target nothing changes: utilisation and the scale-down
band decide as before.

Pure: cumulative bucket counts in, numbers out.
"""

from __future__ import annotations

import math
from typing import Mapping

# Fewer first packets than this in a window say nothing of a p95.
MIN_REQUESTS = 5
# A missed target raises the bottleneck's planned load by at most this factor per decision.
MAX_PRESSURE = 2.0

Buckets = Mapping[float, float]   # upper bound in ms (math.inf last) -> cumulative count


def p95_ms(before: Buckets, after: Buckets) -> float | None:
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


def pressure(target_ms: float, p95: float | None) -> float:
    """How much more load the bottleneck is planned for: p95 / target above the target (capped at
    MAX_PRESSURE; an unbounded bucket counts as the cap), else 1."""
    if target_ms <= 0 or p95 is None or p95 <= target_ms:
        return 1.0
    return MAX_PRESSURE if math.isinf(p95) else min(p95 / target_ms, MAX_PRESSURE)


def merged(readings: Mapping[str, Buckets]) -> dict[float, float]:
    """The buckets of several orchestrator replicas as one histogram."""
    out: dict[float, float] = {}
    for buckets in readings.values():
        for b, n in buckets.items():
            out[b] = out.get(b, 0.0) + n
    return out
