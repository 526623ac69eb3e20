"""Async chunk streaming against whole-result hand-off on Qwen3-Omni tiny, side by side in one run.

(a) async chunk: the example as shipped: the Thinker hands the Talker every 4 tokens, the Talker hands
    Code2Wav a first chunk of `initialChunkSize` (15) codec frames and then every `chunkSize` (25) frames,
    and each descriptor moves on as soon as it exists;
(b) whole-result hand-off: chunkSize 0 on every stage: each stage starts once its producer has finished;
(c) long case only, async chunk untuned: the chunk sizes shipped before initialChunkSize (Talker chunks of
    25 frames from the first), to show what the smaller first chunk buys.
Each served by `omnistage serve` (every stage its own process, one torch thread each), all at once, their
requests alternating in rounds of `concurrency` requests (so the load other work puts on these cores falls
on every mode alike; idle pipelines cost next to nothing), the same seeded prompts, greedy decoding,
ignore_eos (so lengths are exact: `*.long.tokens_min` checks the text; the tiny Code2Wav returns 480
samples (0.25 frame) less than 1920 per frame for each chunk it decodes, so `*.long.audio_frames_min`,
the audio received counted in frames, is 400 less 0.25 per chunk), at concurrency 1 and 8, in two cases:

- short: half short, half long prompts, 8 or 24 text tokens, 75 codec frames (6 s of audio);
- long: 128 text tokens and 400 codec frames (32 s of audio at 12.5 Hz) per request, the anchor's length
  (vLLM-Omni reports 6,459 -> 523 ms TTFP, 12x, from async chunk on a GPU with real weights; these are
  tiny random weights on CPU cores).

Figures: time to first audio packet (TTFP) and end-to-end latency; for the long case also the real-time
factor (request latency over the seconds of audio it returned, mean over requests: < 1 means the audio
was made faster than it plays) and the longest playback gap. A gap: the client plays each request's audio
as it arrives, starting when the first chunk arrives; a later chunk that arrives after the previous chunk
has finished playing leaves the listener `arrival - previous playback end` of silence (an underrun; a
chunk already waiting leaves none). `max_gap_long_c1_ms` is the longest such silence over all requests
at concurrency 1. The load average at start and end is in the settings: other work on the cores skews
every figure.

    .venv/bin/python bench/async_chunk.py [--quick] [--long-only] [--levels 1] [--initial N] [--talker-chunk N]

`--initial` / `--talker-chunk` override the Talker's shipped initialChunkSize / chunkSize in the async run
(for tuning); `--quick --long-only --levels 1 --no-untuned --no-whole` is the quick tuning loop (one
pipeline, two requests: about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from common import figure, percentile, print_table, write_results
from omni_load import ROOT, playback_gaps, prompts, run_level, serve_local

SHORT_FRAMES = 75      # 6 s of audio: three Code2Wav chunks with async chunk on
LONG_TOKENS = 128      # text tokens per long request
LONG_FRAMES = 400      # codec frames per long request: 32 s of audio
FRAME_HZ = 12.5        # Qwen3-Omni codec frames per second of audio
UNTUNED_TALKER_CHUNK = 25  # the Talker's chunkSize before initialChunkSize, from the first chunk


def whole_result(doc) -> None:
    for st in doc["spec"]["topology"]["stages"]:
        st["chunkSize"] = 0
        st.pop("initialChunkSize", None)


def talker_chunks(initial: int | None, every: int | None):
    """An edit setting the Talker's chunk sizes (None: as shipped; initial 0: no smaller first chunk)."""
    def edit(doc) -> None:
        talker = next(st for st in doc["spec"]["topology"]["stages"] if st["name"] == "talker")
        if every is not None:
            talker["chunkSize"] = every
        if initial is not None:
            talker["initialChunkSize"] = initial
    return edit


def shipped_talker(edit) -> dict:
    import yaml
    from omni_load import OMNI

    doc = yaml.safe_load(OMNI.read_text())
    if edit:
        edit(doc)
    talker = next(st for st in doc["spec"]["topology"]["stages"] if st["name"] == "talker")
    return {"chunkSize": talker.get("chunkSize", 0), "initialChunkSize": talker.get("initialChunkSize", 0)}


def long_prompts(n: int) -> list[tuple[str, int]]:
    return [(text, LONG_TOKENS) for text, _ in prompts(n, 0)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--long-only", action="store_true", help="only the long case")
    ap.add_argument("--levels", default="1,8", help="concurrency levels, e.g. 1 or 1,8")
    ap.add_argument("--initial", type=int, default=None, help="the Talker's initialChunkSize in the async run")
    ap.add_argument("--talker-chunk", type=int, default=None, help="the Talker's chunkSize in the async run")
    ap.add_argument("--no-untuned", action="store_true", help="skip the untuned async run of the long case")
    ap.add_argument("--no-whole", action="store_true", help="skip the whole-result run (tuning: compare TTFP only)")
    ap.add_argument("--models", default=str(ROOT / "models"))
    args = ap.parse_args()
    load_at_start = os.getloadavg()
    started = time.perf_counter()
    conc = [int(c) for c in args.levels.split(",")]
    short_n = {1: 6, 8: 16} if args.quick else {1: 16, 8: 48}
    long_n = {1: 2, 8: 8} if args.quick else {1: 4, 8: 16}
    tuned = talker_chunks(args.initial, args.talker_chunk)
    modes = [("async", tuned, True), ("whole", whole_result, True),
             ("async_untuned", talker_chunks(0, UNTUNED_TALKER_CHUNK), False)]
    modes = [m for m in modes if not (args.no_untuned and m[0] == "async_untuned")
             and not (args.no_whole and m[0] == "whole")]
    results = {}
    with contextlib.ExitStack() as stack:  # every mode served at once, so their requests can alternate
        endpoints = {mode: stack.enter_context(serve_local(Path(args.models), edit)) for mode, edit, _ in modes}
        for c in conc:
            if not args.long_only:
                short = {mode: endpoints[mode] for mode, _, short_too in modes if short_too}
                for mode, r in interleaved(short, prompts(short_n[c], 0), SHORT_FRAMES, c).items():
                    results[("short", mode, c)] = r
            for mode, r in interleaved(endpoints, long_prompts(long_n[c]), LONG_FRAMES, c).items():
                results[("long", mode, c)] = r
    figures = report(results, conc)
    settings = {"quick": args.quick, "long_only": args.long_only, "levels": conc,
                "load_average_at_start": [round(x, 2) for x in load_at_start],
                "short": {"codec_frames": SHORT_FRAMES, "requests": short_n},
                "long": {"text_tokens": LONG_TOKENS, "codec_frames": LONG_FRAMES, "requests": long_n},
                "talker": {"async": shipped_talker(tuned), "async_untuned": shipped_talker(modes[-1][1])
                           if not args.no_untuned else None},
                "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                "runtime_s": round(time.perf_counter() - started, 1)}
    print(f"\nload average at start {load_at_start}; talker chunks {settings['talker']}")
    print(f"wrote {write_results('async_chunk', figures, {'settings': settings})}")


def interleaved(endpoints: dict[str, str], prompt_set: list, frames: int, c: int) -> dict[str, dict]:
    """Each mode's run of `prompt_set` at concurrency `c`, in rounds of `c` requests that alternate between
    the modes (the first mode rotating each round), so a change in the machine's load (other work shares
    these cores) falls on every mode alike rather than on whichever ran last."""
    names = list(endpoints)
    runs: dict[str, list[dict]] = {m: [] for m in names}
    for i, start in enumerate(range(0, len(prompt_set), c)):
        part = prompt_set[start:start + c]
        for m in names[i % len(names):] + names[:i % len(names)]:
            runs[m].append(asyncio.run(run_level(endpoints[m], part, frames, c)))
    return {m: merged(rs) for m, rs in runs.items()}


def merged(runs: list[dict]) -> dict:
    """`run_level` results of several rounds as one: rates over the rounds' summed wall time."""
    n = sum(r["n"] for r in runs)
    wall = sum(r["n"] / r["rps"] for r in runs)
    return {"n": n, "rps": n / wall, "tok_s": sum(r["tok_s"] * r["n"] / r["rps"] for r in runs) / wall,
            "rtf": sum(r["rtf"] * r["n"] for r in runs) / n,
            **{k: [x for r in runs for x in r[k]] for k in ("ttfp", "latency", "chunks", "got")}}


def report(results: dict, conc: list[int]) -> list[dict]:
    print(f"\n{'case':<6}{'mode':<15}{'conc':>5}{'TTFP p50':>10}{'TTFP p95':>10}{'e2e p50':>10}{'e2e p95':>10}"
          f"{'req/s':>8}{'RTF':>7}{'max gap':>9}")
    figures = []
    for (case, mode, c), r in results.items():
        ttfp50, ttfp95 = 1e3 * percentile(r["ttfp"], 50), 1e3 * percentile(r["ttfp"], 95)
        e2e50, e2e95 = 1e3 * percentile(r["latency"], 50), 1e3 * percentile(r["latency"], 95)
        gap = 1e3 * max((g for chunks in r["chunks"] for g in playback_gaps(chunks)), default=0.0)
        print(f"{case:<6}{mode:<15}{c:>5}{ttfp50:>8.0f}ms{ttfp95:>8.0f}ms{e2e50:>8.0f}ms{e2e95:>8.0f}ms"
              f"{r['rps']:>8.2f}{r['rtf']:>7.3f}{gap:>7.0f}ms")
        name = mode if case == "short" else f"{mode}.long"  # the short case keeps its figure names
        figures += [figure(f"{name}.ttfp_p50_c{c}_ms", ttfp50, "ms"), figure(f"{name}.ttfp_p95_c{c}_ms", ttfp95, "ms"),
                    figure(f"{name}.e2e_p50_c{c}_ms", e2e50, "ms"), figure(f"{name}.e2e_p95_c{c}_ms", e2e95, "ms"),
                    figure(f"{name}.rps_c{c}", r["rps"], "req/s")]
        if case == "long":
            if r["chunks"]:  # one request's audio as it arrived: where a gap opens
                print("      arrivals (s, audio s): " + " ".join(f"{t:.2f}+{a:.2f}" for t, a in r["chunks"][0]))
            first = [chunks[0][1] * FRAME_HZ for chunks in r["chunks"] if chunks]
            figures += [figure(f"{name}.rtf_c{c}", r["rtf"], "ratio"),
                        figure(f"{name}.max_gap_c{c}_ms", gap, "ms"),
                        figure(f"{name}.first_chunk_frames_c{c}", min(first, default=0), "frames"),
                        figure(f"{name}.audio_frames_min_c{c}", min(a for _, a in r["got"]) * FRAME_HZ, "frames"),
                        figure(f"{name}.tokens_min_c{c}", min(t for t, _ in r["got"]), "tokens")]
    for case, suffix in (("short", ""), ("long", "_long")):
        for c in conc:
            a, w = results.get((case, "async", c)), results.get((case, "whole", c))
            if a and w:
                figures += [figure(f"async_chunk.ttfp_whole_over_async{suffix}_c{c}",  # TTFP p50, whole over async
                                   percentile(w["ttfp"], 50) / percentile(a["ttfp"], 50), "ratio"),
                            figure(f"whole_over_async{'.long' if suffix else ''}.e2e_p50_c{c}",
                                   percentile(w["latency"], 50) / percentile(a["latency"], 50), "ratio")]
            u = results.get((case, "async_untuned", c))
            if a and u:
                figures.append(figure(f"async_chunk.ttfp_untuned_over_async{suffix}_c{c}",
                                      percentile(u["ttfp"], 50) / percentile(a["ttfp"], 50), "ratio"))
    if ("long", "async", 1) in results:
        r = results[("long", "async", 1)]
        figures += [figure("async_chunk.rtf_long_c1", r["rtf"], "ratio"),
                    figure("async_chunk.max_gap_long_c1_ms",
                           1e3 * max((g for ch in r["chunks"] for g in playback_gaps(ch)), default=0.0), "ms")]
    print_table("figures", figures)
    return figures


if __name__ == "__main__":
    main()
