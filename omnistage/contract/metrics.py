"""What every omnistage process's Prometheus metrics share: the naming scheme and the latency buckets.

Names are `omnistage_<subsystem>_<what>_<unit>`: subsystem `request(s)` and `admission` (an orchestrator's
client requests), `audio` (the answers' audio as a client receives it), `stage` (a stage replica, or an
orchestrator's view of a stage), `transfer` (the data plane), `class` (per request class), `planner`,
`operator`, `tls` (a process's certificates), `jobs` (an orchestrator's durable jobs, /v1/videos). Units are
base units (`_seconds`, `_bytes`); counters get `_total` from prometheus_client. docs/observability.md lists
every metric (generated: scripts/metrics_doc.py).
"""

from __future__ import annotations

# One set of buckets for every latency histogram, in seconds: a 1-2-5 series from 1 ms (an engine step on a
# small model) through sub-second audio packets and tens of seconds of speech to the minutes an image or a
# video takes, up to 600 s (a pipeline's default requestTimeoutSeconds: no request lives longer unless told).
# Up to 60 s it is the series the millisecond histograms had, so the planner's p95 (the upper bound of a
# bucket, targets.ttfpP95Ms) reads the same values as before.
LATENCY_SECONDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
