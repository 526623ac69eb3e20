"""The stage graph in the planner: what a stage's upstream says of the load it receives.

A stage is offered what its upstream stages finish. After a load step the upstream builds a queue while
its new replicas start, then works it off: for a while it finishes more requests than arrive at it, and
its consumer receives that catch-up as a burst (the modeled Talker read 550 to 750 frames/s for some
10 s where 403 were sustained). From its own counters the consumer cannot tell that burst from a rise in
load; the graph can. Per edge `upstream -> stage`, the planner measures how many of the upstream's
requests reach the stage (`edge_ratio`: what the stage received over what the upstream ended, over
windows of the same span; what the upstream ends is what the stage receives, catch-up or not, so the
ratio holds through one), and the stage's steady arrival rate is at most that ratio times what its
upstream is *offered*, plus the binomial spread of which of those requests go on (`slack`)
(`steady_arrivals`: sources first, each bounded by its upstream's steady rate, so a catch-up two
stages up is bounded too).
What a stage receives above that bound is an upstream backlog in transit: it is planned as backlog
(work to drain over the drain time), not as a new steady rate (load.offered's `steady`).

A stage with several inputs is bounded by the largest of its inputs' bounds: a catch-up counts as one
only when every input says so (a request that takes either input, not both, is not undercounted).

Per stage, the work one request entering the pipeline takes there (`demand_per_request`: its units per
request times the share of the pipeline's requests that reach it, the product of the edge ratios from a
source) is what the planner shows of the request mix: the average request, since the counters a stage
exports do not tell request classes apart.

Pure: the graph and numbers in, numbers out.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

from omnistage.api.graph import topo_order

# Each window moves an edge's ratio by this much less than the window says.
RATIO_MEMORY = 0.8

Upstream = Mapping[str, Sequence[str]]   # stage -> the stages it reads from (spec.topology's inputs)


def upstream_of(pipeline) -> dict[str, tuple[str, ...]]:
    """The graph of an OmniPipeline (`omnistage.api.Pipeline`): each stage's input stages."""
    return {s.name: tuple(e.source for e in s.inputs) for s in pipeline.stages}


def feeding(upstream: Upstream, stages: Iterable[str]) -> frozenset[str]:
    """`stages` and every stage upstream of them: all a request's output from them passes through."""
    out: set[str] = set()
    todo = list(stages)
    while todo:
        s = todo.pop()
        if s not in out:
            out.add(s)
            todo.extend(upstream.get(s, ()))
    return frozenset(out)


def audio_path(pipeline) -> frozenset[str]:
    """The stages of an OmniPipeline the client's audio passes through: the stage whose output is audio
    (`spec.outputs`) and every stage upstream of it; none for a pipeline without audio out. A stage off it
    cannot make the audio late (targets.underruns)."""
    return feeding(upstream_of(pipeline), (o.stage for o in pipeline.outputs if o.modality == "audio"))


def order(upstream: Upstream) -> list[str]:
    """Stages with every upstream before its consumers; an input that is no stage of the graph is ignored."""
    return topo_order({s: [u for u in ins if u in upstream] for s, ins in upstream.items()})


def edge_ratio(prev: float, upstream_ended: float, stage_received: float) -> float:
    """The share of the upstream's requests that reach the stage after a window in which the upstream ended
    `upstream_ended` requests and the stage received `stage_received` (per second, or counts), smoothed;
    `prev` 0: not known yet. A window in which either is 0 leaves it as it was."""
    if upstream_ended <= 0 or stage_received <= 0:
        return prev
    seen = stage_received / upstream_ended
    return seen if prev <= 0 else RATIO_MEMORY * prev + (1 - RATIO_MEMORY) * seen


def steady_arrivals(upstream: Upstream, arrived: Mapping[str, float], ratios: Mapping[tuple[str, str], float],
                    seconds: Mapping[str, float] | None = None, errors: float = 0.0) -> dict[str, float | None]:
    """Per stage, the most requests per second that can steadily arrive at it over a window (of `seconds`
    per stage) in which `arrived[s]` arrived at each stage: a source (or a stage with an edge not measured
    yet, or an input not measured in this window or measured over another span), None: no bound; any
    other, the largest over its inputs of the edge's ratio times what steadily arrived at that input (its
    own arrivals, where it has no bound), plus `errors` standard deviations of which of those requests go
    on (`slack`)."""
    out: dict[str, float | None] = {}
    seconds = seconds or {}
    for stage in order(upstream):
        bounds: list[float] = []
        for u in upstream[stage]:
            ratio = ratios.get((u, stage), 0.0)
            if u not in arrived or ratio <= 0 or not _same_span(seconds.get(u), seconds.get(stage)):
                bounds = []
                break
            base = out.get(u)
            rate = arrived[u] if base is None else min(base, arrived[u])
            bounds.append(ratio * rate + slack(rate, ratio, seconds.get(u, 0.0), errors))
        out[stage] = max(bounds) if bounds else None
    return out


def slack(rate: float, ratio: float, seconds: float, errors: float) -> float:
    """Requests per second by which a window's share of `rate` that goes on may exceed `ratio` by chance, at
    `errors` standard deviations: of n requests each goes on with probability `ratio`, a binomial count
    (sqrt(n ratio (1 - ratio)) of them). Which requests a window holds is noise the bound must not read as
    a catch-up (a window with more speech requests than the mean sends the Talker more), or it would cut
    a steady load by its own noise.

    Not covered: the stage receives what its upstream *ended*, which differs from what the upstream was
    offered by the change in what it holds, even under a steady load; at a ratio near 1 that noise is
    all there is, and a simulated steady Poisson load then reads 2 to 5% low (upstream latency 1 to 5 s).
    A Poisson spread of the stage's count (sqrt(n ratio)) covers it but lets the modeled catch-up through
    as a rise (a fourth Talker replica in test_planner_graph); measuring the upstream's held-count
    variance would be the way to cover both."""
    if seconds <= 0 or errors <= 0 or not 0 < ratio < 1:
        return 0.0
    return errors * math.sqrt(rate * seconds * ratio * (1 - ratio)) / seconds


def _same_span(a: float | None, b: float | None) -> bool:
    """Whether two windows (seconds; None: not given) cover the same span, so one's count may bound the
    other's: stages with different scale-down delays have delay windows of different lengths."""
    if a is None or b is None:
        return True
    return abs(a - b) <= 0.05 * max(a, b, 1.0)


def reach(upstream: Upstream, ratios: Mapping[tuple[str, str], float]) -> dict[str, float]:
    """Per stage, the share of the pipeline's requests that reach it: 1 at a source, else the largest over
    its inputs of the input's share times the edge's ratio (an edge not measured yet counts 1)."""
    out: dict[str, float] = {}
    for stage in order(upstream):
        ins = [u for u in upstream[stage] if u in upstream]
        out[stage] = max((out[u] * (ratios.get((u, stage), 0.0) or 1.0) for u in ins), default=1.0)
    return out


def demand_per_request(upstream: Upstream, ratios: Mapping[tuple[str, str], float],
                       units_per_request: Mapping[str, float]) -> dict[str, float]:
    """Per stage, the work units one request entering the pipeline takes there (see the module docstring)."""
    shares = reach(upstream, ratios)
    return {s: shares[s] * units_per_request.get(s, 0.0) for s in shares}
