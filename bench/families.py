"""Model families served as stages against each family's own reference implementation, side by side.

One row per family (`ROWS`; a family adds its own function returning its figures). Each row starts its staged
pipeline as `omnistage serve` runs it (LocalPipeline: a process per stage, one torch thread each, mutual TLS)
and its reference in a process of its own (one torch thread), loaded once; the two sides are measured in
alternating rounds (so a noisy neighbour on the machine hits both alike) and each figure is the median of the
rounds.

`asr.staged_over_reference.rps_c8`: `examples/qwen3-asr-tiny.yaml` at 8 concurrent requests (gRPC Generate,
each one clip as an audio part, language "en") over the reference implementation generating one request at a
time: transformers' Qwen3ASRForConditionalGeneration.generate (greedy) on one clip, with the checkpoint's
Qwen3ASRProcessor (apply_transcription_request, the same language), clip after clip. That is the figure's
definition; it is not a batched reference. `asr.staged_over_reference_batched.rps_c8` is the same staged rate
over the reference batching: generate() over 8 clips at once (the processor given the 8 clips as a list, the
prompts left-padded), batch after batch. Same clips (seeded noise of 1 to 4 s, 16 kHz) on both sides, and the
same work: every request decodes exactly `TOKENS` tokens (ignore_eos on the staged side, min_new_tokens on the
reference). Requests/s = clips / wall time of the round. `asr.staged.rps_c8`, `asr.reference.rps_c1` and
`asr.reference_batched.rps_b8` are the three rates.

`step_cache.<family>.speedup` and `.psnr_db` (with `.latents_moved_off`, `.skipped_rows` and the `.threshold`
each was measured at): the diffusion step cache on each diffusion family's tiny model, cached against uncached
denoise stages for the same prompts and seeds, as bench/step_cache.py measures and defines them (that bench runs
the same measurement alone, with a threshold sweep).

    flock /tmp/omnistage-bench.lock .venv/bin/python bench/families.py [--quick] [--only asr]

Writes bench/results/families.json.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the reference's process too
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import soundfile
import yaml
from common import figure, finish, print_table

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
ASR_EXAMPLE = ROOT / "examples" / "qwen3-asr-tiny.yaml"
ASR_MODEL = "qwen3-asr-tiny"
RATE = 16000
TOKENS = 16        # tokens each request decodes, on both sides
CONCURRENCY = 8


def asr_clips(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.2 * rng.standard_normal(int(RATE * rng.uniform(1.0, 4.0)))).astype(np.float32) for _ in range(n)]


def wav_bytes(samples: np.ndarray) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, RATE, format="WAV", subtype="FLOAT")
    return buf.getvalue()


# ------------------------------------------------------------------ reference side (its own process)

def _reference_worker(model_dir: str, jobs, done) -> None:
    """Loads Qwen3-ASR once, then transcribes each (clips, batch) it is sent, `batch` clips per generate()
    call; answers with the seconds taken (None ends it)."""
    import torch
    from transformers import Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor

    torch.set_num_threads(1)
    model = Qwen3ASRForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = Qwen3ASRProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"  # a batch's prompts end where its answers start
    done.put("ready")
    while (job := jobs.get()) is not None:
        clips, batch = job
        t0 = time.perf_counter()
        for at in range(0, len(clips), batch):
            group = clips[at:at + batch]
            inputs = processor.apply_transcription_request(group if batch > 1 else group[0], language="English")
            with torch.inference_mode():
                model.generate(**inputs, do_sample=False, max_new_tokens=TOKENS, min_new_tokens=TOKENS)
        done.put(time.perf_counter() - t0)


class Reference:
    def __init__(self, model_dir: Path):
        ctx = multiprocessing.get_context("spawn")
        self.jobs, self.done = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_reference_worker, args=(str(model_dir), self.jobs, self.done), daemon=True)
        self.proc.start()
        assert self.done.get(timeout=300) == "ready"

    def rps(self, clips: list[np.ndarray], batch: int = 1) -> float:
        """Clips per second, `batch` clips to a generate() call."""
        self.jobs.put((clips, batch))
        return len(clips) / self.done.get(timeout=1800)

    def close(self) -> None:
        self.jobs.put(None)
        self.proc.join(timeout=30)


# ------------------------------------------------------------------ staged side

async def staged_rps(endpoint: str, clips: list[bytes], concurrency: int) -> float:
    from omnistage.client import AsyncOmniClient
    from omnistage.v1 import common_pb2

    queue = list(clips)
    async with AsyncOmniClient(endpoint) as client:
        async def worker():
            while queue:
                part = common_pb2.ContentPart(audio=common_pb2.AudioPart(data=queue.pop()))
                r = await client.generate(parts=[part], language="en", max_tokens=TOKENS, ignore_eos=True,
                                          timeout=600)
                assert len(r.token_ids) == TOKENS, len(r.token_ids)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(clips) / (time.perf_counter() - t0)


def serve_example(path: Path, models: Path):
    from omnistage.api import parse_pipeline
    from omnistage.local.serve import LocalPipeline

    doc = yaml.safe_load(path.read_text())
    tmp = tempfile.TemporaryDirectory()
    file = Path(tmp.name) / "pipeline.yaml"
    file.write_text(yaml.safe_dump(doc, sort_keys=False))
    local = LocalPipeline(file, parse_pipeline(doc), models, progress=lambda m: None)
    return local, tmp


def asr(quick: bool, models: Path) -> tuple[list[dict], dict]:
    rounds, n = (2, 8) if quick else (5, 24)
    samples = asr_clips(n)
    wavs = [wav_bytes(s) for s in samples]
    local, tmp = serve_example(ASR_EXAMPLE, models)
    reference = None
    try:
        endpoint = local.start()
        asyncio.run(staged_rps(endpoint, wavs[:CONCURRENCY], CONCURRENCY))  # warm the stage
        reference = Reference(models / ASR_MODEL)
        reference.rps(samples[:2])  # warm
        reference.rps(samples[:CONCURRENCY], CONCURRENCY)
        staged, ref, batched = [], [], []
        for r in range(rounds):
            staged.append(asyncio.run(staged_rps(endpoint, wavs, CONCURRENCY)))
            ref.append(reference.rps(samples))
            batched.append(reference.rps(samples, CONCURRENCY))
            print(f"  asr round {r + 1}/{rounds}: staged {staged[-1]:.2f} req/s (c{CONCURRENCY}), "
                  f"reference {ref[-1]:.2f} req/s (one at a time), {batched[-1]:.2f} req/s "
                  f"(batches of {CONCURRENCY})", flush=True)
    finally:
        if reference is not None:
            reference.close()
        local.stop()
        tmp.cleanup()
    figures = [figure(f"asr.staged_over_reference.rps_c{CONCURRENCY}",
                      statistics.median(s / r for s, r in zip(staged, ref)), "ratio"),
               figure(f"asr.staged_over_reference_batched.rps_c{CONCURRENCY}",
                      statistics.median(s / b for s, b in zip(staged, batched)), "ratio"),
               figure(f"asr.staged.rps_c{CONCURRENCY}", statistics.median(staged), "req/s"),
               figure("asr.reference.rps_c1", statistics.median(ref), "req/s"),
               figure(f"asr.reference_batched.rps_b{CONCURRENCY}", statistics.median(batched), "req/s")]
    return figures, {"asr": {"rounds": rounds, "clips": n, "tokens_per_request": TOKENS,
                             "concurrency": CONCURRENCY, "staged_rps": staged, "reference_rps": ref,
                             "reference_batched_rps": batched}}


def step_cache(quick: bool, models: Path) -> tuple[list[dict], dict]:
    """The diffusion families' step cache (`step_cache.<family>.speedup` and `.psnr_db`, with the threshold each
    was measured at): bench/step_cache.py's measurement, whose docstring defines the figures."""
    if models != MODELS:
        raise SystemExit("the step_cache row reads the tiny models from models/ (bench/step_cache.py)")
    sys.path.insert(0, str(ROOT))
    import step_cache as measurement  # bench/step_cache.py

    figures, settings = measurement.run(quick)
    return figures, {"step_cache": settings}


# One function per family: (quick, model store) -> (figures, settings).
ROWS: dict[str, Callable[[bool, Path], tuple[list[dict], dict]]] = {"asr": asr, "step_cache": step_cache}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=sorted(ROWS), action="append", help="rows to run (all by default)")
    ap.add_argument("--models", type=Path, default=MODELS)
    args = ap.parse_args()
    started = time.perf_counter()
    figures: list[dict] = []
    settings: dict = {}
    load_before = os.getloadavg()
    for name in args.only or list(ROWS):
        got, extra = ROWS[name](args.quick, args.models)
        figures += got
        settings |= extra
    print_table("Model families: staged pipeline over the family's reference", figures)
    finish("families", figures, started, {"quick": args.quick, "load_before": load_before,
                                          "load_after": os.getloadavg(), **settings})


if __name__ == "__main__":
    main()
