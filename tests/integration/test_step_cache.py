"""The denoise loop's step cache (`engineArgs.step_cache_threshold`, step_cache.py) on the tiny SD3, Qwen-Image and
Wan DiTs behind real stages: off by default; on, requests really skip the DiT's blocks after the first (counted on the
second block) and their pixels stay close to the uncached ones for the same seed; with a threshold no step
passes it is the uncached loop bit for bit; a request gets the same latents alone as batched with another at
other steps; a stage that cannot cache refuses the setting by name; each tiny DiT's split forward is its own
forward."""

from __future__ import annotations

import json

import pytest
import torch

from stage_service.engines.registry import create_engine
from stage_service.runtime.errors import EngineConfigError

from ..harness import call_stage, example, header, start_stage, tensor_of
from ..step_cache_support import SecondBlockRows, pixels, psnr_db, step_cache
from .test_stage_support import assert_denoise_steps_shared, assert_nothing_held

THRESHOLD = 0.1        # Wan's choice in bench/step_cache.py (SD3's and Qwen-Image's are 0.3: their first block's
                       # residual moves more)
SEED = 5
NEVER = 1e-9           # no step's first block stays this still: every step computed
PSNR_BOUND_DB = 30.0
# The cached latents' mean distance from the uncached ones over the mean distance denoising moved them: about
# 0.01 on both tiny DiTs at THRESHOLD; reused steps without their residual (the later blocks dropped) make 0.1.
LATENTS_BOUND = 0.03
CASES = {  # model, request, the vae-decode stage's tensor
    "sd3": ("sd3-tiny", dict(width=32, height=32, num_inference_steps=12, guidance_scale=7.0), "image", 0.3),
    # Under true CFG (a negative prompt): two rows a step, as the others'
    "qwen_image": ("qwen-image-tiny", dict(width=32, height=32, num_inference_steps=12, guidance_scale=4.0), "image",
                   0.3),
    "wan": ("wan-t2v-tiny", dict(width=32, height=32, num_frames=5, num_inference_steps=12, guidance_scale=5.0),
            "video", THRESHOLD),
}


def cached_steps(srv) -> float:
    return srv.metrics.registry.get_sample_value("omnistage_stage_cached_steps_total",
                                                 {"stage": srv.stage.name}) or 0.0


@pytest.mark.parametrize("case", sorted(CASES))
async def test_cached_steps_skip_the_later_blocks_and_the_pixels_stay_close(model_dir, case):
    model, params, output, threshold = CASES[case]
    steps, rows = params["num_inference_steps"], 2  # guided: [unconditional, conditional]
    stages = {"plain": (example(model), "denoise"), "cached": (example(model, step_cache(threshold)), "denoise"),
              "exact": (example(model, step_cache(NEVER)), "denoise"), "text": (example(model), "text-encoder"),
              "vae": (example(model), "vae-decode")}
    servers = {}
    try:
        for name, (pipeline, stage) in stages.items():
            servers[name] = await start_stage(pipeline, stage, model_dir)
        assert servers["plain"].engine.step_cache is None  # off by default
        counted = {name: SecondBlockRows(servers[name]) for name in ("plain", "cached", "exact")}
        head = header(prompt="a red car on a road", negative_prompt="blurry", seed=SEED, **params)
        emb = await call_stage(servers["text"].port, head)
        latents = {name: await call_stage(servers[name].port, head, emb) for name in ("plain", "cached", "exact")}
        final = {name: tensor_of(chunks[-1], "latents") for name, chunks in latents.items()}

        # Every step through every block without the cache, and with it where no step passes the threshold.
        assert counted["plain"].rows == counted["exact"].rows == steps * rows
        assert torch.equal(final["exact"], final["plain"]) and cached_steps(servers["exact"]) == 0
        # With it, steps really skipped: the first and last always computed, most between reused.
        reused = cached_steps(servers["cached"])
        assert 0 < reused <= steps - 2 and counted["cached"].rows == (steps - reused) * rows
        assert not torch.equal(final["cached"], final["plain"])
        images = {name: pixels(await call_stage(servers["vae"].port, head, latents[name]), output)
                  for name in ("plain", "cached")}
        assert psnr_db(images["cached"], images["plain"]) >= PSNR_BOUND_DB
        # The tiny DiTs move their latents little, so their pixels barely show a wrong residual: the latents'
        # distance, against how far denoising moved them from the seed's noise, does.
        noise = torch.randn(final["plain"].shape, generator=torch.Generator().manual_seed(SEED))
        moved = (final["plain"] - noise).abs().mean()
        assert (final["cached"] - final["plain"]).abs().mean() / moved < LATENTS_BOUND
        await assert_nothing_held(servers["cached"])  # its cache went with the request
    finally:
        for srv in servers.values():
            await srv.drain()


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_cached_request_gets_the_same_latents_alone_as_batched_at_other_steps(model_dir, case):
    """Each request's reuse decision is its own: batched with another request at other steps (and another row
    count), it reuses on the same steps and ends with the latents it gets alone, bit for bit."""
    model, params, what, threshold = CASES[case]
    size = {k: v for k, v in params.items() if k in ("width", "height", "num_frames")}

    def reused(den) -> None:
        assert cached_steps(den) > 0

    await assert_denoise_steps_shared(
        model_dir, model, dict(prompt="an astronaut riding a horse", num_inference_steps=60, seed=1, **size),
        dict(prompt="a cat", num_inference_steps=8, seed=2, guidance_scale=1.0, **size), what,
        edit=step_cache(threshold), check=reused)


async def test_a_stage_that_cannot_cache_refuses_the_setting_by_name(model_dir):
    """A UNet (no first transformer block) and a text encoder (no steps to reuse)."""
    unet = example("text-to-image-tiny", step_cache(THRESHOLD))
    with pytest.raises(EngineConfigError, match=r"spec\.deployment\.stages\.denoise\.engineArgs\."
                                                r"step_cache_threshold: a UNet2DConditionModel has no "
                                                r"step-cache split"):
        srv = await start_stage(unet, "denoise", model_dir)
        await srv.drain()
    text = example("sd3-tiny", step_cache(THRESHOLD, stage="text-encoder"))
    with pytest.raises(EngineConfigError, match=r"spec\.deployment\.stages\.text-encoder\.engineArgs\."
                                                r"step_cache_threshold: this engine .* has no step cache"):
        create_engine(text, text.stage("text-encoder"), model_dir)
    def variant(doc):
        step_cache(THRESHOLD)(doc)
        doc["spec"]["deployment"]["stages"]["denoise"]["engineArgs"]["batch_invariant"] = False
    with pytest.raises(EngineConfigError, match=r"step_cache_threshold: needs batch invariance"):
        srv = await start_stage(example("sd3-tiny", variant), "denoise", model_dir)
        await srv.drain()
    bad = example("sd3-tiny", step_cache(1.5))
    with pytest.raises(EngineConfigError, match=r"spec\.deployment\.stages\.denoise\.engineArgs\."
                                                r"step_cache_threshold: expected a number above 0 and at most 1"):
        create_engine(bad, bad.stage("denoise"), model_dir)


@pytest.mark.parametrize("model", ["sd3-tiny", "wan-t2v-tiny", "wan-i2v-tiny"])
def test_each_dits_split_forward_is_its_own_forward_bit_for_bit(model_dir, model):
    """Every row through every block (no request has a residual yet), the DENOISERS entry's split forward of each
    tiny DiT (Wan's image-to-video one with its image embeddings and condition channels) is the model's own
    forward on a batch of a guided and an unguided request at different timesteps."""
    import diffusers

    from stage_service.engines.diffusers.denoisers import DENOISERS
    from stage_service.engines.diffusers.step_cache import (
        CachedRequest,
        StepCachePolicy,
        StepCacheState,
        cached_forward,
    )
    from stage_service.runtime.invariance import make_batch_invariant

    folder = model_dir / model / "transformer"
    cfg = json.loads((folder / "config.json").read_text())
    dit = getattr(diffusers, cfg["_class_name"]).from_pretrained(folder).eval()
    make_batch_invariant(dit, patch_embed_3d=True)
    g = torch.Generator().manual_seed(0)
    video = cfg["_class_name"] == "WanTransformer3DModel"
    latents = (3, cfg["in_channels"], 3, 4, 6) if video else (3, cfg["in_channels"], 8, 8)
    forward = {"hidden_states": torch.randn(latents, generator=g), "timestep": torch.tensor([900.0, 900.0, 500.0])}
    call = DENOISERS[cfg["_class_name"]]
    for ti in call.text + (call.image if cfg.get("image_dim") else ()):
        shape = (3, 7, cfg[ti.width]) if ti.per_token else (3, cfg[ti.width])
        forward[ti.kwarg] = torch.randn(shape, generator=g)
    assert call.blocks is not None
    requests = [CachedRequest(StepCacheState(), 2, 0, 10), CachedRequest(StepCacheState(), 1, 0, 10)]
    with torch.inference_mode():
        want = dit(**forward, return_dict=False)[0]
        got, reused = cached_forward(dit, call.blocks, StepCachePolicy(THRESHOLD), requests, forward)
    assert reused == 0 and torch.equal(got, want)
    assert all(r.cache.residual is not None and r.cache.computed == 1 for r in requests)
