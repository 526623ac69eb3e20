"""Async chunk streaming against whole-result hand-off on Qwen3-Omni tiny, side by side in one run.

(a) async chunk: the example as shipped: the Thinker hands the Talker every 4 tokens, the Talker hands
    Code2Wav every 25 codec frames, and each descriptor moves on as soon as it exists;
(b) whole-result hand-off: chunkSize 0 on both edges: each stage starts once its producer has finished.
Both served by `omnistage serve` (every stage its own process, one torch thread each), the same seeded
prompts, greedy decoding, the same token and codec-frame budgets, at concurrency 1 and 8. Reports time to
first audio packet (TTFP) and end-to-end latency. (The anchor from the field: vLLM-Omni reports 6,459 ->
523 ms TTFP from async chunk on a GPU with real weights; these are tiny random weights on CPU cores.)

    .venv/bin/python bench/async_chunk.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from common import figure, percentile, print_table, write_results  # noqa: E402
from omni_load import ROOT, prompts, run_level, serve_local  # noqa: E402


def whole_result(doc) -> None:
    for st in doc["spec"]["topology"]["stages"]:
        st["chunkSize"] = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=str(ROOT / "models"))
    args = ap.parse_args()
    frames = 75  # 6 s of audio: three Code2Wav chunks with async chunk on
    levels = {1: 6, 8: 16} if args.quick else {1: 16, 8: 48}
    results = {}
    for mode, edit in (("async", None), ("whole", whole_result)):
        with serve_local(Path(args.models), edit) as endpoint:
            for c, n in levels.items():
                results[(mode, c)] = asyncio.run(run_level(endpoint, prompts(n, 0), frames, c))
    print(f"\n{'mode':<8}{'conc':>5}{'TTFP p50':>10}{'TTFP p95':>10}{'e2e p50':>10}{'e2e p95':>10}{'req/s':>8}")
    figures = []
    for (mode, c), r in results.items():
        ttfp50, ttfp95 = 1e3 * percentile(r["ttfp"], 50), 1e3 * percentile(r["ttfp"], 95)
        e2e50, e2e95 = 1e3 * percentile(r["latency"], 50), 1e3 * percentile(r["latency"], 95)
        print(f"{mode:<8}{c:>5}{ttfp50:>8.0f}ms{ttfp95:>8.0f}ms{e2e50:>8.0f}ms{e2e95:>8.0f}ms{r['rps']:>8.2f}")
        figures += [figure(f"{mode}.ttfp_p50_c{c}_ms", ttfp50, "ms"), figure(f"{mode}.ttfp_p95_c{c}_ms", ttfp95, "ms"),
                    figure(f"{mode}.e2e_p50_c{c}_ms", e2e50, "ms"), figure(f"{mode}.e2e_p95_c{c}_ms", e2e95, "ms"),
                    figure(f"{mode}.rps_c{c}", r["rps"], "req/s")]
    for c in levels:
        a, w = results[("async", c)], results[("whole", c)]
        figures += [figure(f"async_chunk.ttfp_whole_over_async_c{c}",  # TTFP p50, whole-result over async chunk
                           percentile(w["ttfp"], 50) / percentile(a["ttfp"], 50), "ratio"),
                    figure(f"whole_over_async.e2e_p50_c{c}",
                           percentile(w["latency"], 50) / percentile(a["latency"], 50), "ratio")]
    print_table("figures", figures)
    print(f"\nwrote {write_results('async_chunk', figures, {'quick': args.quick, 'codec_frames': frames})}")


if __name__ == "__main__":
    main()
