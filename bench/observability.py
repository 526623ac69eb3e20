"""The figures of omnistage's observability, on the omni pipeline (qwen3-omni-tiny: thinker, talker,
code2wav), each beside its baseline from the same run: what metrics cost (every process's scrape time under
load; requests per second with metrics and access lines on over both off: observability_metrics.py), what
access lines alone cost (observability_logs.py), and what tracing costs (spans per request; requests per
second with tracing on over off: observability_traces.py). Each part starts its own servers.

    .venv/bin/python bench/observability.py [--quick] [--only metrics,logs,traces]
"""

from __future__ import annotations

import argparse
import time

import observability_logs
import observability_metrics
import observability_traces
from common import exit_on_sigterm, finish, print_table

PARTS = {"metrics": observability_metrics.measure, "logs": observability_logs.measure,
         "traces": observability_traces.measure}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter rounds (about 3 minutes on 2 cores)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    args = ap.parse_args()
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        ap.error(f"--only: unknown part(s) {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    exit_on_sigterm()
    started = time.perf_counter()
    figures = [f for part in only for f in PARTS[part](args.quick)]
    print_table("Observability (qwen3-omni-tiny)", figures)
    finish("observability", figures, started,
           {"quick": args.quick, "parts": only, "concurrency": observability_logs.CONCURRENCY})


if __name__ == "__main__":
    main()
