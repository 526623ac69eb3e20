"""The denoise loop's step cache (`engineArgs.step_cache_threshold`, stage_service/engines/diffusers/step_cache.py):
how much faster a denoise stage runs with it, and how far its images move, on the tiny SD3, FLUX.1, Qwen-Image and
Wan models.

Per family, in this one process (one torch thread, as every stage process runs): the example's text-encoder and
vae-decode stages, and two denoise stages of the same example side by side: `uncached` (the example as it is)
and `cached` (`engineArgs.step_cache_threshold` as chosen below). The same prompts and seeds go to both; each
round sends all of a family's requests at once to one side (they share the loop's steps), then to the other,
the order alternating between rounds.

- `step_cache.<family>.speedup`: the uncached side's wall time for the round's requests (every denoise step
  of every request, from the first sent to the last answered) over the cached side's, the median over the
  rounds (each round's ratio);
- `step_cache.<family>.psnr_db`: the cached side's decoded pixels against the uncached side's for the same
  request (PSNR over 8-bit RGB; a video's over all its frames), the lowest over the requests;
- `step_cache.<family>.latents_moved_off`: the cached side's final latents' mean distance from the uncached
  side's over the mean distance the uncached side's moved from the seed's noise, the highest over the requests
  (the tiny DiTs' latents move little, so their pixels show little of any error: this shows more);
- `step_cache.<family>.skipped_rows`: the share of (row, step) passes through the DiT's blocks after the first
  that the cached side skipped (counted on its second block).

The thresholds (on the relative change of the first block's residual), SD3 0.3, FLUX 0.3, Qwen-Image 0.3 and Wan
0.1: every threshold of the sweep in docs/benchmarks.md kept PSNR near 50 dB or above on the tiny models, so the 30 dB
floor does not choose them; each is where about 0.6-0.7 of the later blocks' passes are skipped with the cached latents
under 0.01 off (past it the latents' distance grows faster than the speed).
`--threshold FAMILY=VALUE` runs another (and writes no results).

    flock /tmp/omnistage-bench.lock .venv/bin/python bench/step_cache.py [--quick] [--threshold sd3=0.3]

Prints a table and writes bench/results/step_cache.json (with the settings and the load averages before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from common import exit_on_sigterm, figure, print_table, write_results

from stage_service.server import StageServer
from tests.harness import call_stage, example, header, tensor_of
from tests.step_cache_support import SecondBlockRows, pixels, psnr_db, step_cache

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
ROUNDS, QUICK_ROUNDS = 5, 2
CALL_BOUND_S = 600  # a safety bound on a call to a tiny model's stage on a loaded machine, never a figure
PROMPTS = ("a red car on a road", "an astronaut riding a horse", "a bowl of fruit on a wooden table",
           "a lighthouse at dusk")
PSNR_CAP_DB = 100.0  # identical pixels (JSON has no inf)
SEED = 10


@dataclass(frozen=True)
class Family:
    example: str
    threshold: float
    ask: dict = field(default_factory=dict)
    output: str = "image"  # the vae-decode stage's tensor


FAMILIES = {
    # SD3's default 28 steps and guidance 7.0 (two rows: [negative, prompt])
    "sd3": Family("sd3-tiny", 0.3, dict(width=64, height=64, num_inference_steps=28, guidance_scale=7.0,
                                        negative_prompt="blurry")),
    # FluxPipeline's default 28 steps and guidance 3.5 (FLUX.1-dev's guidance embedding: one row, no negative prompt)
    "flux": Family("flux-tiny", 0.3, dict(width=64, height=64, num_inference_steps=28, guidance_scale=3.5)),
    # QwenImagePipeline's default 50 steps and true_cfg_scale 4.0, with a negative prompt (two rows: true CFG)
    "qwen_image": Family("qwen-image-tiny", 0.3, dict(width=64, height=64, num_inference_steps=50, guidance_scale=4.0,
                                                      negative_prompt="blurry")),
    # Wan's guidance 5.0; 17 frames (5 latent frames) keep the VAE's decode, outside what is timed, short
    "wan": Family("wan-t2v-tiny", 0.1, dict(width=64, height=64, num_frames=17, num_inference_steps=30,
                                            guidance_scale=5.0, negative_prompt="blurry"), output="video"),
}


def moved_off(cached: torch.Tensor, plain: torch.Tensor, seed: int) -> float:
    """The cached final latents' mean distance from the uncached ones over the mean distance denoising moved the
    uncached ones from the seed's noise (the loop's starting latents on the flow-matching schedulers here)."""
    noise = torch.randn(plain.shape, generator=torch.Generator().manual_seed(seed))
    return float((cached - plain).abs().mean() / (plain - noise).abs().mean())


async def measure(name: str, family: Family, threshold: float, rounds: int, prompts: int) -> list[dict]:
    plain, cached = example(family.example), example(family.example, step_cache(threshold))
    servers: dict[str, StageServer] = {}
    try:
        for key, pipe, stage in (("text", plain, "text-encoder"), ("uncached", plain, "denoise"),
                                 ("cached", cached, "denoise"), ("vae", plain, "vae-decode")):
            servers[key] = StageServer(pipe, stage, "127.0.0.1", 0, model_root=str(MODELS))
            await servers[key].start()
        seeds = [SEED + i for i in range(prompts)]
        heads = [header(f"{name}-{i}", prompt=p, seed=seed, **family.ask)
                 for i, (p, seed) in enumerate(zip(PROMPTS, seeds))]
        embeddings = [await call_stage(servers["text"].port, h, timeout=CALL_BOUND_S) for h in heads]
        counts = {side: SecondBlockRows(servers[side]) for side in ("uncached", "cached")}
        walls: dict[str, list[float]] = {"uncached": [], "cached": []}
        latents: dict[str, list] = {}
        for r in range(rounds):
            for side in (("uncached", "cached") if r % 2 == 0 else ("cached", "uncached")):
                t0 = time.perf_counter()
                latents[side] = await asyncio.gather(*[call_stage(servers[side].port, h, e, timeout=CALL_BOUND_S)
                                                       for h, e in zip(heads, embeddings)])
                walls[side].append(time.perf_counter() - t0)
        decoded = {side: [pixels(await call_stage(servers["vae"].port, h, lat, timeout=CALL_BOUND_S), family.output)
                          for h, lat in zip(heads, latents[side])] for side in latents}
        rows = {side: c.rows for side, c in counts.items()}
    finally:
        for srv in servers.values():
            await srv.drain()
    ratios = [u / c for u, c in zip(walls["uncached"], walls["cached"])]
    quality = [min(PSNR_CAP_DB, psnr_db(a, b)) for a, b in zip(decoded["cached"], decoded["uncached"])]
    moved = [moved_off(tensor_of(c[-1], "latents"), tensor_of(u[-1], "latents"), seed)
             for c, u, seed in zip(latents["cached"], latents["uncached"], seeds)]
    print(f"{name}: threshold {threshold}; uncached {[round(w, 2) for w in walls['uncached']]} s, cached "
          f"{[round(w, 2) for w in walls['cached']]} s; PSNR per request {[round(q, 1) for q in quality]} dB; "
          f"latents moved off {[round(m, 4) for m in moved]}; rows through block 2: {rows['cached']} of "
          f"{rows['uncached']}")
    return [figure(f"step_cache.{name}.speedup", statistics.median(ratios), "ratio"),
            figure(f"step_cache.{name}.psnr_db", min(quality), "dB"),
            figure(f"step_cache.{name}.latents_moved_off", max(moved), "ratio"),
            figure(f"step_cache.{name}.skipped_rows", 1 - rows["cached"] / rows["uncached"], "fraction"),
            figure(f"step_cache.{name}.threshold", threshold, "relative L1")]


def run(quick: bool, names: list[str] | None = None, override: dict[str, float] | None = None
        ) -> tuple[list[dict], dict]:
    """The figures for `names` (all families by default) at their chosen thresholds (or `override`'s), and the
    settings they were measured with. bench/families.py's `step_cache` row runs this too."""
    torch.set_num_threads(1)
    override = override or {}
    rounds, prompts = (QUICK_ROUNDS, 2) if quick else (ROUNDS, len(PROMPTS))
    figures = []
    for name in names or sorted(FAMILIES):
        family = FAMILIES[name]
        figures += asyncio.run(measure(name, family, override.get(name, family.threshold), rounds, prompts))
    settings = {name: {"example": f.example, "threshold": override.get(name, f.threshold), **f.ask}
                for name, f in FAMILIES.items() if name in (names or FAMILIES)}
    return figures, {"rounds": rounds, "requests": prompts, "settings": settings}


def main() -> None:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds of 2 requests")
    ap.add_argument("--family", choices=sorted(FAMILIES), action="append",
                    help="only these (default: all; results not written)")
    ap.add_argument("--threshold", action="append", default=[], metavar="FAMILY=VALUE",
                    help="another threshold than the chosen one (a sweep; results not written)")
    args = ap.parse_args()
    override = {k: float(v) for k, v in (t.split("=", 1) for t in args.threshold)}
    started, load_before = time.perf_counter(), os.getloadavg()
    figures, settings = run(args.quick, args.family, override)
    print_table("diffusion step cache: cached against uncached denoise stages, same prompts and seeds", figures)
    if override or args.family:
        return
    path = write_results("step_cache", figures, {"quick": args.quick, **settings,
                                                 "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                                                 "runtime_s": round(time.perf_counter() - started, 1)})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
