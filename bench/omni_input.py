"""Omni input: what image and audio parts cost a request, and whether an encoder stage of its own pays.

Two pipelines, each served as local processes (`omnistage serve`, one torch thread per process) and
warmed, run side by side:
(a) inline:        examples/qwen3-omni-tiny.yaml, the Thinker runs the vision and audio towers itself;
(b) encoder stage: examples/qwen3-omni-encoders-tiny.yaml, one encoder replica runs them and hands the
                   Thinker prompt ids and encoder rows.
Every request asks for text only (`outputs=["text"]`), 8 tokens, ignore_eos, and a trace.

1. Throughput: image + text requests (a seeded 320x240 JPEG) at concurrency 8 on both pipelines, both
   served at once and measured in alternating rounds, so that a noisy neighbour on the machine hits
   both alike; `encoder_stage.rps_c8_over_inline` is the ratio of their requests/s over all rounds.
2. TTFT on the inline pipeline, from sending the request to its first text delta, at c1 and c8, for the
   image request, an audio request (a seeded 3 s WAV at 44.1 kHz, resampled by the server) and, at c1,
   the same text alone. The traces split it: `decode` is the orchestrator's media decode at admission
   (`trace.media_decode_ms`), `encode` the Thinker's processor and encoders (its `StageTrace.encode_ms`),
   the rest is prefill, the first tokens and the hops.

    .venv/bin/python bench/omni_input.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import time
import wave
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import yaml
from common import figure, finish, percentile, print_table
from omni_load import serve_local

ROOT = Path(__file__).resolve().parent.parent
ENCODERS = ROOT / "examples" / "qwen3-omni-encoders-tiny.yaml"
QUESTION = "Describe what you see and hear in one short sentence."
MAX_TOKENS = 8
AUDIO_SECONDS, AUDIO_RATE = 3.0, 44_100


def test_image(seed: int = 0) -> bytes:
    """A 320x240 JPEG: smooth gradients plus seeded noise, so it decodes like a photo, not a flat field."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:240, 0:320]
    base = np.stack([x * 255 / 319, y * 255 / 239, (x + y) * 255 / 558], axis=-1)
    pixels = np.clip(base + rng.normal(0, 24, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_audio(seed: int = 0) -> bytes:
    """A 3 s mono 16-bit WAV at 44.1 kHz: two tones and seeded noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(AUDIO_SECONDS * AUDIO_RATE)) / AUDIO_RATE
    wav = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 661 * t) + rng.normal(0, 0.05, t.shape)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(AUDIO_RATE)
        w.writeframes(np.round(np.clip(wav, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def requests(kind: str) -> list:
    """The content parts of one request of `kind` (image, audio or text)."""
    from omnistage.client import audio_part, image_part

    media = {"image": [image_part(test_image())], "audio": [audio_part(test_audio())], "text": []}[kind]
    return media + [QUESTION]


async def run_level(endpoint: str, parts: list, n: int, concurrency: int) -> dict:
    """`n` requests of `parts`, `concurrency` at a time: requests/s, TTFT, and the decode / encode split."""
    from omnistage.client import AsyncOmniClient, GenerateResult

    ttft, decode, encode = [], [], []
    left = n
    async with AsyncOmniClient(endpoint) as client:
        async def one():
            result, first_text, t0 = GenerateResult(), None, time.perf_counter()
            async for ev in client.stream(parts=parts, max_tokens=MAX_TOKENS, ignore_eos=True, outputs=["text"],
                                          return_trace=True, timeout=600):
                elapsed = time.perf_counter() - t0
                if first_text is None and ev.WhichOneof("event") == "text":
                    first_text = elapsed
                result.add(ev, elapsed)
            trace = result.final.trace
            ttft.append(first_text)
            decode.append(trace.media_decode_ms)
            # encoders run in the Thinker (inline) or the encoder stage: the stage that did the work
            encode.append(sum(st.encode_ms for st in trace.stages))

        async def worker():
            nonlocal left
            while left > 0:
                left -= 1
                await one()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"rps": n / wall, "ttft": ttft, "decode": decode, "encode": encode, "n": n}


def replace_with(path: Path):
    """A `serve_local` edit that serves the pipeline in `path` instead of the tiny example."""
    def edit(doc: dict) -> None:
        doc.clear()
        doc.update(yaml.safe_load(path.read_text()))
    return edit


def warm(endpoint: str, kinds: list[str], n: int) -> None:
    for kind in kinds:
        asyncio.run(run_level(endpoint, requests(kind), n, 2))


def merged(runs: list[dict]) -> dict:
    """Rounds of one run as one: requests/s over their summed wall time, every sample."""
    n = sum(r["n"] for r in runs)
    return {"rps": n / sum(r["n"] / r["rps"] for r in runs), "n": n,
            **{k: [v for r in runs for v in r[k]] for k in ("ttft", "decode", "encode")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=str(ROOT / "models"))
    args = ap.parse_args()
    models = Path(args.models)
    # throughput rounds x image requests per round at c8 (per pipeline), audio requests at c8, requests at c1,
    # warm-up requests per kind
    rounds, per_round, n_c8, n_c1, n_warm = (2, 16, 16, 6, 4) if args.quick else (5, 48, 48, 32, 8)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        inline_ep = stack.enter_context(serve_local(models))
        staged_ep = stack.enter_context(serve_local(models, replace_with(ENCODERS)))
        warm(inline_ep, ["image", "audio", "text"], n_warm)
        warm(staged_ep, ["image"], n_warm)
        image = requests("image")
        tput: dict[str, list[dict]] = {"inline": [], "staged": []}
        for _ in range(rounds):
            tput["inline"].append(asyncio.run(run_level(inline_ep, image, per_round, 8)))
            tput["staged"].append(asyncio.run(run_level(staged_ep, image, per_round, 8)))
        inline = {"image.c8": merged(tput["inline"])}
        for name, (kind, n, c) in {"image.c1": ("image", n_c1, 1), "audio.c1": ("audio", n_c1, 1),
                                   "audio.c8": ("audio", n_c8, 8),
                                   "text.c1": ("text", n_c1, 1)}.items():
            inline[name] = asyncio.run(run_level(inline_ep, requests(kind), n, c))
    staged = {"image.c8": merged(tput["staged"])}
    round_ratios = [round(s["rps"] / i["rps"], 3) for i, s in zip(tput["inline"], tput["staged"])]

    rows = [(f"inline {k}", r) for k, r in inline.items()] + [(f"encoder stage {k}", r) for k, r in staged.items()]
    print(f"\n{'run':<24}{'req/s':>8}{'TTFT p50':>10}{'TTFT p95':>10}{'decode p50':>12}{'encode p50':>12}{'n':>5}")
    for name, r in rows:
        print(f"{name:<24}{r['rps']:>8.2f}{1e3 * percentile(r['ttft'], 50):>9.0f}ms"
              f"{1e3 * percentile(r['ttft'], 95):>8.0f}ms{percentile(r['decode'], 50):>10.1f}ms"
              f"{percentile(r['encode'], 50):>10.1f}ms{r['n']:>5}")

    figures = [figure("encoder_stage.rps_c8_over_inline", staged["image.c8"]["rps"] / inline["image.c8"]["rps"],
                      "ratio"),
               figure("encoder_stage.rps_c8", staged["image.c8"]["rps"], "req/s"),
               figure("inline.rps_c8", inline["image.c8"]["rps"], "req/s")]
    for kind in ("image", "audio"):
        for c in (1, 8):
            r = inline[f"{kind}.c{c}"]
            figures += [figure(f"{kind}_request.ttft_p50_ms.c{c}", 1e3 * percentile(r["ttft"], 50), "ms"),
                        figure(f"{kind}_request.decode_p50_ms.c{c}", percentile(r["decode"], 50), "ms"),
                        figure(f"{kind}_request.encode_p50_ms.c{c}", percentile(r["encode"], 50), "ms")]
    figures += [figure("text_request.ttft_p50_ms.c1", 1e3 * percentile(inline["text.c1"]["ttft"], 50), "ms"),
                figure("encoder_stage.image_request.ttft_p50_ms.c8", 1e3 * percentile(staged["image.c8"]["ttft"], 50),
                       "ms"),
                figure("encoder_stage.image_request.encode_p50_ms.c8", percentile(staged["image.c8"]["encode"], 50),
                       "ms")]
    print_table("figures", figures)
    print(f"\nencoder stage / inline req/s at c8, round by round: {round_ratios}")
    notes = ("inline: examples/qwen3-omni-tiny.yaml, the Thinker runs the vision and audio towers itself; "
             "encoder stage: examples/qwen3-omni-encoders-tiny.yaml, one encoder replica runs them before the "
             f"Thinker. Every process has one torch thread; on {os.cpu_count()} CPU cores the encoder stage "
             "competes with the Thinker (and the orchestrator) for the same cores: splitting it off lets encoding "
             "overlap the Thinker's decoding, but there is no idle core to give it, and it adds a hop. "
             "Requests ask for text only, 8 tokens; TTFT is to the first text delta; decode is the orchestrator's "
             "media decode, encode the encoders' time in the stage that ran them (the Thinker when inline).")
    extra = {"quick": args.quick, "max_tokens": MAX_TOKENS, "image": "320x240 JPEG",
             "audio": f"{AUDIO_SECONDS:g} s WAV at {AUDIO_RATE} Hz",
             "rps_c8_ratio_by_round": round_ratios, "notes": notes}
    finish('omni_input', figures, started, extra)


if __name__ == "__main__":
    main()
