"""A memory plan per stage, from the checkpoint's config and the pipeline, before anything loads.

For each stage: its weights in the dtype it runs in (the tensors `check_stage` counts, converted from
their stored dtype), and for AR stages the KV cache: layers x KV heads x head dim x 2 (keys and values)
x dtype bytes per token, times the context (`engineArgs.max_model_len`, else the config's
`max_position_embeddings`) times the batch (`scheduler.maxBatch`). Activations of an AR stage on the
transformers engine: what its largest step holds (`ar_activation_bytes`): a joining batch prefills every
prompt in one packed step, so maxBatch x context tokens, each costing a measured multiple of its layer's
width, plus what the engine adds by construction (gathered expert weights, kept hidden rows, the logits).
Diffusion, decoder and text-encoder stages: their largest step's shape from the component's config
(`generation_activation_bytes`): a DiT's tokens per image x its layer's width x images (two rows each under
guidance) at the example's default image side; a decoder's largest feature map (output channels x samples
or pixels) x the chunks or images of a step; a text encoder's prompts x tokens x its layer's width, and the
embeddings it hands on; each at a per-element cost measured on one tiny model (see the constants). vLLM
stages size their own activations, and a UNet's, the omni encoders' and a video pipeline's DiT and VAE
(Wan's) are not modelled: for those an ESTIMATE, a fixed fraction of the weights (`ACTIVATION_FRACTION`).
Only headers and configs are read.
`fit.py` says whether a plan fits where its stage runs; `models check --plan` and `serve` refuse one that
does not.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.api import MODEL_LIMIT_FALLBACKS, Pipeline, Stage, StageDeployment
from omnistage.checkpoints.check import LoadPlan, StageCheckError, check_stage
from omnistage.checkpoints.configs import ar_text_config, read_json
from omnistage.checkpoints.defaults import image_stage, native_side, vae_scale
from omnistage.checkpoints.shards import DTYPES, CheckpointError, TensorInfo
from omnistage.contract.devices import AUTO_DTYPE, uses_gpus
from omnistage.families import family_of

# Estimate, not measured: activations and workspace as a share of the weights, for the stages whose
# activations are not modelled (vLLM, which sizes its own; a diffusers UNet).
ACTIVATION_FRACTION = 0.1
# Activations of a transformers AR stage: bytes per token of a step = ACTIVATION_WIDTHS_PER_TOKEN x (hidden +
# MLP intermediate) x dtype bytes, plus STEP_WORKSPACE_BYTES once (the math library's buffers). Both measured
# on ONE model, the causal LM (qwen2-tiny on the transformers engine, float32, maxBatch 32, contexts 128, 256
# and 512): the peak minus the loaded bytes and the KV held is a line in step tokens x width x 4 B, of slope
# 3.85 and intercept 10.16 MB (residuals under 1 kB). Evaluated, not fitted, on the omni Thinkers and the
# Qwen3-Omni Talker: bench/real_scale_memory.py, figures memory_plan.<family>.<stage>.predicted_over_measured.
ACTIVATION_WIDTHS_PER_TOKEN = 3.85
STEP_WORKSPACE_BYTES = 10_160_000
# Rows the transformers engine pads a step's logits to, at most (invariance.MIN_MATMUL_ROWS on AVX-512).
MIN_HEAD_ROWS = 16

# Generation stages (`generation_activation_bytes`); each figure is bytes of a step over (elements x dtype
# bytes) of the shape named, on the tiny model (float32, CPU, bench/real_scale_memory.py's meter), the slope
# between two sizes of one step where it says so. Every step also counts STEP_WORKSPACE_BYTES: the measured
# intercepts are 9.6 MB (sd3 denoise), 9.2 MB (code2wav), 4.9 MB (sd3 vae), 4.4 MB (sd3 text encoders), so
# the tiny VAEs and text encoders are planned ~1.3-1.4x their peak; at real sizes the slope is what counts.
# - a DiT's tokens x (hidden + MLP hidden): measured on sd3-tiny's denoise (SD3Transformer2DModel, maxBatch
#   8 images x 2 rows under guidance, slope between sides 64 and 256: 2269 B per token row); also used,
#   not checked alone, for Qwen2.5-Omni Token2Wav's DiT (that stage is fitted as a whole, below);
DIT_WIDTHS_PER_TOKEN = 3.55
# - a diffusers VAE decoder's output pixels x block_out_channels[0] (its full-resolution feature map):
#   measured on sd3-tiny's vae (8 latents, slope between sides 64 and 256: 416 B per pixel at 16
#   channels), checked on sd-tiny's (6.19 there);
VAE_DECODER_WIDTHS = 6.5
# An image-editing encoder stage (FLUX.1 Kontext's, `kind: encoder, component: vae`) encodes each image at its
# preferred Kontext resolution, whatever the size made: planned at the largest of them (800 x 1328 in
# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS), its full-resolution feature map at the decoder's factor
# (not measured for the encoder alone).
EDIT_IMAGE_PIXELS = 800 * 1328
# - Qwen3-Omni Code2Wav's samples x its last block's channels (decoder_dim / 2 ** upsample stages), per
#   frame total_upsample samples: measured on qwen3-omni-tiny's code2wav (slope between 2 and 8 chunks of
#   50 frames: 140 kB a frame); fitted, not checked (the only model of its kind);
CODE2WAV_WIDTHS = 4.54
# - Qwen2.5-Omni Token2Wav's BigVGAN: mel frames x hop samples x its last block's channels
#   (upsample_initial_channel / 2 ** upsample stages), the mel frames taken as the DiT window's: fitted on
#   qwen2.5-omni-tiny's token2wav at the example's largest CPU step (3 chunks of the steady 60-token window:
#   20.3 MB beyond STEP_WORKSPACE_BYTES, less its DiT's share at DIT_WIDTHS_PER_TOKEN), not checked (the only
#   model of its kind). Its slope alone is smaller (3.59 MB a chunk from 3 to 8 chunks, against 6.78 here):
#   past 3 chunks the plan runs above the measurement (1.3x at 8).
BIGVGAN_WIDTHS = 28.0
# Text encoders (CLIP, T5) are transformer layers: ACTIVATION_WIDTHS_PER_TOKEN x (hidden + intermediate) per
# token, evaluated (not fitted) on sd3-tiny's text-encoder; plus the embeddings they hand on.
# What the engines fix and the plan follows (tests/integration/test_memory_plan.py checks they agree):
MIN_CONV_BATCH = 2             # a decoder's convolution batch is padded to this (invariance.MIN_CONV_BATCH)
CODE2WAV_LEFT_CONTEXT = 25     # frames of history a Code2Wav chunk decodes again (Code2Wav.LEFT_CONTEXT)
TOKEN2WAV_WINDOW_BLOCKS = 3    # DiT blocks around a Token2Wav chunk (Token2Wav.LEFT_BLOCKS + RIGHT_BLOCKS)
CPU_MAX_BATCHED_FRAMES = {"code2wav": 100, "token2wav": 200}  # on a CPU, by component (AudioDecoderEngine)
CLIP_TOKENS = 77               # the CLIP tokenizers' model_max_length
SD3_T5_TOKENS = 256            # StableDiffusion3Pipeline's max_sequence_length (diffusers/text.py)
QWEN_IMAGE_PROMPT_TOKENS = 34 + 1024  # QwenImagePipeline's most tokens a prompt encodes (diffusers/text.py)
DIT_MLP_RATIO = 4              # diffusers' FeedForward default (SD3's joint blocks)


@dataclass(frozen=True)
class StagePlan:
    stage: str
    weights_bytes: int
    kv_bytes_per_token: int    # 0 for stages without a KV cache (diffusion, generation)
    context: int               # tokens per sequence the KV cache is sized for (0 without one)
    batch: int                 # sequences at once (scheduler.maxBatch)
    kv_bytes: int
    activation_bytes: int      # transformers AR stages: `ar_activation_bytes`; diffusion, decoder, text-encoder
                               # stages `generation_activation_bytes`; others ACTIVATION_FRACTION of weights
    total_bytes: int
    # A transformers AR stage with a KV budget (engineArgs.kvCacheBytes, or on a GPU its gpuMemoryFraction):
    # its caches never hold more than the budget, and `kv_bytes` is at most kvCacheBytes (fit.py).
    kv_bounded: bool = False


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a stage dtype (float32, bfloat16, float16)."""
    return getattr(torch, dtype).itemsize


def stage_dtype(dep: StageDeployment | None, device: str) -> str:
    """The dtype the stage runs in: its deployment's, `auto` resolved for its device as the engines do."""
    dtype = dep.dtype if dep is not None else "auto"
    return AUTO_DTYPE[device] if dtype == "auto" else dtype


def kv_bytes_per_token(text_config: Mapping, dtype_bytes: int) -> int:
    """Keys and values of one token over every layer: layers x KV heads x head dim x 2 x dtype bytes."""
    heads = text_config["num_attention_heads"]
    kv_heads = text_config.get("num_key_value_heads") or heads
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // heads
    return text_config["num_hidden_layers"] * kv_heads * head_dim * 2 * dtype_bytes


def weights_in_dtype(tensors: Iterable[TensorInfo], dtype: str) -> int:
    """Bytes of `tensors` once loaded in `dtype`: floating tensors converted, others (ids, masks) as stored."""
    out = 0
    for info in tensors:
        stored = DTYPES[info.dtype]
        out += info.nbytes // stored.itemsize * dtype_bytes(dtype) if stored.is_floating_point else info.nbytes
    return out


def mlp_width(text_config: Mapping) -> int:
    """Intermediate rows per token of the widest MLP: a dense layer's `intermediate_size`, or a sparse layer's
    experts per token x `moe_intermediate_size` plus its shared expert's."""
    dense = text_config.get("intermediate_size") or 0
    if not moe_experts(text_config):
        return dense
    sparse = (text_config["num_experts_per_tok"] * text_config["moe_intermediate_size"]
              + (text_config.get("shared_expert_intermediate_size") or 0))
    all_sparse = not text_config.get("mlp_only_layers") and text_config.get("decoder_sparse_step", 1) == 1
    return sparse if all_sparse else max(sparse, dense)


def moe_experts(text_config: Mapping) -> int:
    """Experts per sparse layer (0: a dense model)."""
    n = text_config.get("num_experts") or text_config.get("num_local_experts") or 0
    return n if n > 1 and text_config.get("moe_intermediate_size") else 0


def ar_activation_bytes(text_config: Mapping, step_tokens: int, batch: int, dtype_bytes: int,
                        batch_invariant: bool = True, keeps_hidden: bool = False) -> int:
    """The most a transformers AR stage's step of `step_tokens` tokens over `batch` sequences holds beside the
    weights and the KV cache:
    - every token's working set, ACTIVATION_WIDTHS_PER_TOKEN x (hidden + `mlp_width`), and the math library's
      STEP_WORKSPACE_BYTES (both measured, see there);
    - batch-invariant MoE experts run as one matmul per (token, expert) pair (transformers' `batched_mm`),
      which gathers each pair's gate-up projection and then its down projection while the first is held:
      experts per token x hidden x 3 x moe_intermediate per token;
    - an engine that keeps every layer's hidden rows (a Thinker, for its Talker): layers + 1 rows per token;
    - the logits of the step's last rows, padded to MIN_HEAD_ROWS for batch invariance."""
    hidden = text_config["hidden_size"]
    per_token = ACTIVATION_WIDTHS_PER_TOKEN * (hidden + mlp_width(text_config))
    if batch_invariant and moe_experts(text_config):
        per_token += text_config["num_experts_per_tok"] * hidden * 3 * text_config["moe_intermediate_size"]
    if keeps_hidden:
        per_token += (text_config["num_hidden_layers"] + 1) * hidden
    head_rows = max(batch, MIN_HEAD_ROWS) if batch_invariant else batch
    return int((per_token * step_tokens + head_rows * text_config["vocab_size"]) * dtype_bytes) + STEP_WORKSPACE_BYTES


def step_tokens(engine_args: Mapping, context: int, batch: int) -> int:
    """Tokens of the transformers engine's largest step: maxBatch prompts of the whole context prefilled at
    once, or with `engineArgs.max_num_batched_tokens` what a step takes at most: prompts join a step while
    their tokens fit it, and a prompt longer than it steps alone, so max(budget, context)."""
    budget = engine_args.get("max_num_batched_tokens")
    return batch * context if not budget else min(batch * context, max(int(budget), context))


def plan_stage(pipeline: Pipeline, stage: Stage, root: str | os.PathLike | None = None) -> StagePlan:
    """The stage's memory plan; raises what `check_stage` raises for a checkpoint it cannot serve."""
    load = check_stage(pipeline, stage, root)
    dep = pipeline.deployment.stages.get(stage.name)
    dtype = stage_dtype(dep, load.device)
    weights = weights_in_dtype(load.tensors, dtype)
    per_token = context = kv = 0
    batch = dep.scheduler.max_batch if dep is not None else 1
    activations = (int(weights * ACTIVATION_FRACTION) if stage.kind == "ar" or stage.engine == "vllm"
                   else generation_activation_bytes(pipeline, stage, load, weights, dtype_bytes(dtype)))
    bounded = False
    if stage.kind == "ar":
        engine_args = dep.engine_args if dep is not None else {}
        per_token, context, ar_activations = ar_plan(read_json(load.directory / "config.json"), stage, dep, dtype)
        kv = per_token * context * batch
        if stage.engine == "transformers":
            activations = ar_activations
            given = engine_args.get("kvCacheBytes")
            bounded = given is not None or (dep is not None and uses_gpus(dep) and dep.gpu_memory_fraction > 0)
            kv = min(kv, given) if isinstance(given, int) else kv
    return StagePlan(stage.name, weights, per_token, context, batch, kv, activations, weights + kv + activations,
                     bounded)


def ar_plan(config: Mapping, stage: Stage, dep: StageDeployment | None, dtype: str) -> tuple[int, int, int]:
    """An AR stage's KV bytes per token, its context (`engineArgs.max_model_len`, else the decoder config's
    `max_position_embeddings`) and the activations of its largest step on the transformers engine, from its
    checkpoint's `config` in `dtype`: what the plan counts and what a running stage leaves beside its KV
    budget (stage_service/runtime/base.py `bound_kv`), one rule for both."""
    text = ar_text_config(config, stage.component)
    engine_args = dep.engine_args if dep is not None else {}
    batch = dep.scheduler.max_batch if dep is not None else 1
    per_token = kv_bytes_per_token(text, dtype_bytes(dtype))
    context = int(engine_args.get("max_model_len") or text["max_position_embeddings"])
    activations = ar_activation_bytes(text, step_tokens(engine_args, context, batch), batch, dtype_bytes(dtype),
                                      batch_invariant=engine_args.get("batch_invariant", True),
                                      keeps_hidden="hidden" in stage.emits)
    return per_token, context, activations


def code2wav_config(root: Path, config: Mapping) -> Mapping:
    """A code2wav stage's decoder config: its part's sub-config, in the part's own folder where it has one."""
    part = family_of((config.get("architectures") or [""])[0]).parts["code2wav"]  # type: ignore[union-attr]
    return read_json(root / part.folder / "config.json")[part.config] if part.folder else config[part.config]


def generation_activation_bytes(pipeline: Pipeline, stage: Stage, load: LoadPlan, weights: int,
                                dtype_bytes: int) -> int:
    """What the largest step of a non-AR stage holds beside its weights, from its component's config (see the
    constants for each factor); ACTIVATION_FRACTION of `weights` for a kind not modelled (a UNet, a video DiT
    or VAE)."""
    dep = pipeline.deployment.stages.get(stage.name)
    batch = dep.scheduler.max_batch if dep is not None else 1
    engine_args = dep.engine_args if dep is not None else {}
    root = load.directory
    if stage.engine == "diffusers":
        cfg = read_json(root / stage.component / "config.json")
        rows = 2  # [negative, prompt]: the default guidance (7.5) is above 1
        if stage.kind == "diffusion" and cfg.get("_class_name") == "SD3Transformer2DModel":
            per_row = dit_bytes_per_row(cfg, image_side(pipeline, stage, root), root)
            return int(per_row * batch * rows * dtype_bytes) + STEP_WORKSPACE_BYTES
        if stage.component == "vae" and "block_out_channels" in cfg:  # an image VAE (a video VAE: not modelled)
            side = image_side(pipeline, stage, root)
            per_image = EDIT_IMAGE_PIXELS if stage.kind == "encoder" else side * side  # the image to edit's
            pixels = batch * per_image * cfg["block_out_channels"][0]
            return int(VAE_DECODER_WIDTHS * pixels * dtype_bytes) + STEP_WORKSPACE_BYTES
        if stage.kind == "generation" and stage.component.startswith("text_encoder"):
            return int(text_encoder_bytes_per_prompt(root) * batch * rows * dtype_bytes) + STEP_WORKSPACE_BYTES
        return int(weights * ACTIVATION_FRACTION)
    config = read_json(root / "config.json")
    bound = engine_args.get("max_batched_frames") or (CPU_MAX_BATCHED_FRAMES.get(stage.component)
                                                      if load.device == "cpu" else None)
    chunk = pipeline.stage(stage.inputs[0].source).chunk_size if stage.inputs else 0
    if stage.component == "code2wav":
        c = code2wav_config(root, config)
        frames = CODE2WAV_LEFT_CONTEXT + chunk
        chunks = max(MIN_CONV_BATCH, steps_chunks(batch, frames, bound))
        upsample = math.prod(c["upsample_rates"]) * math.prod(c["upsampling_ratios"])
        channels = c["decoder_dim"] // 2 ** len(c["upsample_rates"])
        return int(CODE2WAV_WIDTHS * chunks * frames * upsample * channels * dtype_bytes) + STEP_WORKSPACE_BYTES
    if stage.component == "token2wav":
        dit, vocoder = config["token2wav_config"]["dit_config"], config["token2wav_config"]["bigvgan_config"]
        tokens = TOKEN2WAV_WINDOW_BLOCKS * dit["block_size"] // dit["repeats"] + chunk
        chunks = steps_chunks(batch, tokens, bound)
        mel = tokens * dit["repeats"]  # a chunk window's frames: the DiT's (two rows, guided and not), the vocoder's
        width = dit["hidden_size"] * (1 + dit["ff_mult"])
        dit_rows = DIT_WIDTHS_PER_TOKEN * 2 * chunks * mel * width
        channels = vocoder["upsample_initial_channel"] // 2 ** len(vocoder["upsample_rates"])
        hop = math.prod(vocoder["upsample_rates"])
        vocoder_rows = BIGVGAN_WIDTHS * max(chunks, MIN_CONV_BATCH) * mel * hop * channels
        return int((dit_rows + vocoder_rows) * 4) + STEP_WORKSPACE_BYTES  # Token2Wav runs in float32, any dtype
    return int(weights * ACTIVATION_FRACTION)


def steps_chunks(batch: int, cost: int, bound: int | None) -> int:
    """Chunks of `cost` in a decoder's largest step: maxBatch, or as many as its step bound takes (one at least)."""
    return batch if bound is None else max(1, min(batch, int(bound) // cost))


def image_side(pipeline: Pipeline, stage: Stage, root) -> int:
    """The side of the images the plan sizes: limits.defaultImageSide, else the denoiser's sample_size x the
    VAE's scale (as the orchestrator resolves it from the checkpoint), at most maxImageSide."""
    limits = pipeline.limits
    if limits.default_image_side:
        return limits.default_image_side
    denoiser = image_stage(pipeline)
    side = MODEL_LIMIT_FALLBACKS["default_image_side"]
    if denoiser is not None:
        with contextlib.suppress(KeyError, CheckpointError, OSError):
            side = native_side(Path(root), denoiser.component)[0]
    return min(side, limits.max_image_side)


def dit_bytes_per_row(cfg: Mapping, side: int, root) -> float:
    """Elements an SD3-style DiT holds per row of a step (one image, or one of its two rows under guidance):
    its image tokens and the prompt's (CLIP's, then T5's) x (hidden + MLP hidden) x DIT_WIDTHS_PER_TOKEN."""
    scale = vae_scale(Path(root))
    tokens = (side // scale // cfg["patch_size"]) ** 2 + CLIP_TOKENS + SD3_T5_TOKENS
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    return DIT_WIDTHS_PER_TOKEN * tokens * hidden * (1 + DIT_MLP_RATIO)


def text_encoder_bytes_per_prompt(root) -> float:
    """Elements a diffusers pipeline's text encoders hold per prompt: the widest encoder's layer working set
    (they run one after another) and the embeddings handed on (CLIP's tokens, then T5's, at the widest
    encoder's width, and the pooled rows)."""
    index = read_json(root / "model_index.json")
    qwen = index.get("_class_name") == "QwenImagePipeline"
    layers, widths = [], []
    for name in sorted(index):
        entry = index[name]
        if not (name.startswith("text_encoder") and isinstance(entry, list) and entry[1] is not None):
            continue
        c = read_json(root / name / "config.json")
        c = c.get("text_config") or c  # a multimodal model's language model (Qwen-Image's Qwen2.5-VL)
        t5 = "d_model" in c
        hidden, inner = (c["d_model"], c["d_ff"]) if t5 else (c["hidden_size"], c["intermediate_size"])
        layers.append((SD3_T5_TOKENS if t5 else QWEN_IMAGE_PROMPT_TOKENS if qwen else CLIP_TOKENS) * (hidden + inner))
        widths.append(hidden)
    sd3 = index.get("_class_name", "").startswith("StableDiffusion3")
    handed = (CLIP_TOKENS + (SD3_T5_TOKENS if sd3 else 0)) * max(widths) + sum(widths)
    return ACTIVATION_WIDTHS_PER_TOKEN * max(layers) + handed


def plan_pipeline(pipeline: Pipeline, root: str | os.PathLike | None = None) -> tuple[list[StagePlan], list[str]]:
    """Every stage's plan, and one line per stage whose checkpoint cannot be planned (as `check_stage` says)."""
    plans, errors = [], []
    for stage in pipeline.stages:
        try:
            plans.append(plan_stage(pipeline, stage, root))
        except (StageCheckError, CheckpointError) as e:
            errors.append(str(e))
    return plans, errors


def describe_plans(plans: list[StagePlan]) -> str:
    """A table in GiB, one row per stage."""
    gib = float(1 << 30)
    rows = [f"{'stage':<16}{'weights':>10}{'KV/token':>12}{'context':>9}{'batch':>7}{'KV':>10}{'activ.*':>10}"
            f"{'total':>10}"]
    for p in plans:
        gibs = "".join(f"{n / gib:>10.3f}" for n in (p.kv_bytes, p.activation_bytes, p.total_bytes))
        rows.append(f"{p.stage:<16}{p.weights_bytes / gib:>10.3f}{p.kv_bytes_per_token:>10} B{p.context:>9}"
                    f"{p.batch:>7}{gibs}")
    rows.append("GiB except KV/token; * activations are an estimate: for transformers AR stages their largest step "
                "(maxBatch prompts of the whole context, or engineArgs.max_num_batched_tokens) at a per-token "
                "cost measured on a tiny causal LM; for diffusion, decoder and text-encoder stages their largest step "
                "(maxBatch images at the default side, or chunks) at factors measured on tiny models; for vLLM stages, "
                f"a UNet, the omni encoders and a video DiT and VAE {ACTIVATION_FRACTION:.0%} of the weights, "
                "not modelled")
    return "\n".join(rows)
