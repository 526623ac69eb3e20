"""Hostile traffic: what the front doors and the data plane hold under slow, huge, malformed and forged input,
each figure beside a clean baseline measured in the same run.

    .venv/bin/python bench/abuse.py [--quick] [--only PART ...]

Written to bench/results/abuse.json (goals from issue 37):
  slowloris.p99_ms_over_baseline            a normal request's p99 with 1,000 half-open connections held,
                                             over its p99 with none (goal <= 2)        bench/abuse_slowloris.py
  json_amplification.rss_over_body          the orchestrator's memory growth for the worst JSON body shape
                                             under the limit, over the body's size (goal <= 3)  bench/abuse_json.py
  json_parse.loop_stall_ms                  the longest event-loop gap while a body at the chat limit is parsed,
                                             beside the same parse on a thread (goal < 50)    bench/abuse_json.py
  non_reading.probe_latency_over_baseline   a probe request's latency with 4 x maxBatch non-reading streams
                                             on each door, over its latency without them (goal <= 2)
                                                                                       bench/abuse_non_reading.py
  grpc_unauthenticated.rss_growth_mib       the orchestrator's RSS growth for 16 keyless 120 MiB requests
                                             (goal <= 64)                              bench/abuse_grpc.py
  ucx_injection.requests_corrupted / .requests_failed   fetches while a peer floods forged replies
                                             (goal 0 and 0)                            bench/abuse_ucx.py
  serve_process_death.failed_requests / .failed_after   one of two Talker replicas killed under load, and
                                             new requests after it (goal 0; serve keeps running)
                                                                                       bench/abuse_serve.py
Each part's module says what it measures and how; `--only` runs some parts (the others' figures in the
results file stay, the run is listed under partial_runs).
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import time

from common import finish, merge_results, print_table

# part -> its module's title; each module has `measure(quick) -> list[figure]`
PARTS = {
    "slowloris": "slowloris on the HTTP API: 1,000 half-open connections held",
    "json": "JSON amplification: the worst body shape under the limit",
    "non_reading": "clients that never read: 4 x maxBatch non-reading streams on each door",
    "grpc": "gRPC door: 16 keyless 120 MiB requests",
    "ucx": "UCX data plane: a peer flooding forged replies",
    "serve": "omnistage serve: one of two Talker replicas killed under load",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter runs")
    ap.add_argument("--only", nargs="+", choices=sorted(PARTS), help="run these parts only")
    args = ap.parse_args()
    for var, value in (("OMP_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error"),
                       ("TOKENIZERS_PARALLELISM", "false"), ("UCX_TLS", "tcp"), ("UCX_WARN_UNUSED_ENV_VARS", "n")):
        os.environ.setdefault(var, value)
    # 1,000 held sockets and the servers' own: more descriptors than a default soft limit of 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    started = time.perf_counter()
    figures: list[dict] = []
    for part in args.only or PARTS:
        measured = importlib.import_module(f"abuse_{part}").measure(args.quick)
        print_table(PARTS[part], measured)
        figures += measured
    if args.only:
        path = merge_results("abuse", figures, {"parts": args.only, "quick": args.quick,
                                                "runtime_s": round(time.perf_counter() - started, 1)})
        print(f"\nwrote {path}")
    else:
        finish("abuse", figures, started, {"quick": args.quick})


if __name__ == "__main__":
    main()
