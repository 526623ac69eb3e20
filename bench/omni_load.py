"""Load generation against a local Qwen3-Omni tiny pipeline, shared by the benchmarks that serve it."""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OMNI = ROOT / "examples" / "qwen3-omni-tiny.yaml"
WORDS = ("the sea wind story light city river night song stone bird road morning garden music winter "
         "Tell me about a quiet village where people build boats and sing").split()


def prompts(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, max text tokens): half short, half long, seeded."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        long = i % 2 == 1
        words = rng.randint(30, 60) if long else rng.randint(3, 8)
        out.append((" ".join(rng.choice(WORDS) for _ in range(words)), 24 if long else 8))
    return out


async def stream_one(client, text: str, max_tokens: int, frames: int) -> dict:
    """One request through the pipeline, its audio chunks timed as they arrive: TTFP, latency, real-time
    factor (latency over the seconds of audio), tokens, `arrivals` as (arrival s from the call, audio s)."""
    from omnistage.client import GenerateResult

    r, arrivals = GenerateResult(), []
    t0 = time.perf_counter()
    async for ev in client.stream(text, max_tokens=max_tokens, ignore_eos=True, max_codec_frames=frames,
                                  timeout=600):
        elapsed = time.perf_counter() - t0
        before = len(r.pcm)
        r.add(ev, elapsed)
        if len(r.pcm) > before:
            arrivals.append((elapsed, (len(r.pcm) - before) / 2 / r.sample_rate))
    dt = time.perf_counter() - t0
    return {"ttfp": r.first_audio_s, "latency": dt, "rtf": dt / r.audio_seconds, "tokens": len(r.token_ids),
            "arrivals": arrivals, "audio_s": r.audio_seconds}


async def run_level(endpoint: str, prompt_set, frames: int, concurrency: int) -> dict:
    """Every prompt through the pipeline, `concurrency` at a time: rates, TTFP, latency, real-time factor
    (`rtf` the mean, `rtfs` per request), and per request its audio chunks as (arrival s from the call,
    audio s) and what it got (tokens, audio s)."""
    from omnistage.client import AsyncOmniClient

    ttfp, lat, rtf, tokens, chunks, got = [], [], [], 0, [], []
    queue = list(prompt_set)
    async with AsyncOmniClient(endpoint) as client:
        async def worker():
            nonlocal tokens
            while queue:
                text, max_tokens = queue.pop()
                one = await stream_one(client, text, max_tokens, frames)
                ttfp.append(one["ttfp"])
                lat.append(one["latency"])
                rtf.append(one["rtf"])
                tokens += one["tokens"]
                chunks.append(one["arrivals"])
                got.append((one["tokens"], one["audio_s"]))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"rps": len(prompt_set) / wall, "tok_s": tokens / wall, "ttfp": ttfp, "latency": lat,
            "rtf": sum(rtf) / len(rtf), "rtfs": rtf, "n": len(prompt_set), "chunks": chunks, "got": got}


def playback_gaps(chunks: list[tuple[float, float]]) -> list[float]:
    """Underruns of one request's audio played as it arrives: `chunks` are (arrival s, audio s) in order;
    playback starts when the first arrives and each chunk plays once the one before has ended and it is
    here. Returns, for each chunk after the first, how long the listener heard nothing before it: its
    arrival minus the previous chunk's playback end, or 0 when it was already waiting."""
    gaps, end = [], None
    for arrival, seconds in chunks:
        if end is not None:
            gaps.append(max(0.0, arrival - end))
        end = max(arrival, end if end is not None else arrival) + seconds
    return gaps


@contextlib.contextmanager
def serve_local(models: Path, edit=None):
    """`omnistage serve` of the Qwen3-Omni tiny example (edited by `edit(doc)` first), warmed; yields its endpoint."""
    with serve_omni(models, edit) as local:
        yield local.endpoint


@contextlib.contextmanager
def serve_omni(models: Path, edit=None, api_port: int | None = None):
    """As `serve_local`, yielding the LocalPipeline itself (its OpenAI API on `api_port` when given)."""
    from omnistage.api import parse_pipeline
    from omnistage.local.serve import LocalPipeline

    doc = yaml.safe_load(OMNI.read_text())
    if edit:
        edit(doc)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        local = LocalPipeline(path, parse_pipeline(doc), models, progress=lambda m: None, api_port=api_port)
        try:
            endpoint = local.start()
            asyncio.run(run_level(endpoint, prompts(2, 99), 10, 2))  # warm every stage
            yield local
        finally:
            local.stop()
