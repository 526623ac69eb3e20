"""A memory plan per stage, from the checkpoint's config and the pipeline, before anything loads.

For each stage: its weights in the dtype it runs in (the tensors `check_stage` counts, converted from
their stored dtype), and for AR stages the KV cache: layers x KV heads x head dim x 2 (keys and values)
x dtype bytes per token, times the context (`engineArgs.max_model_len`, else the config's
`max_position_embeddings`) times the batch (`scheduler.maxBatch`). Activations of an AR stage on the
transformers engine: what its largest step holds (`ar_activation_bytes`): a joining batch prefills every
prompt in one packed step, so maxBatch x context tokens, each costing a measured multiple of its layer's
width, plus what the engine adds by construction (gathered expert weights, kept hidden rows, the logits).
Other stages' activations (vLLM, which sizes its own; diffusion and generation stages) are still an
ESTIMATE: a fixed fraction of the weights (`ACTIVATION_FRACTION`). Only headers and configs are read.
`fit.py` says whether a plan fits where its stage runs; `models check --plan` and `serve` refuse one that
does not.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from omnistage.api import Pipeline, Stage, StageDeployment
from omnistage.checkpoints.check import StageCheckError, check_stage
from omnistage.checkpoints.configs import ar_text_config, read_json
from omnistage.checkpoints.shards import DTYPES, CheckpointError, TensorInfo
from omnistage.contract.devices import AUTO_DTYPE, uses_gpus

# Estimate, not measured: activations and workspace as a share of the weights, for the stages whose
# activations are not modelled (vLLM, diffusion, generation).
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


@dataclass(frozen=True)
class StagePlan:
    stage: str
    weights_bytes: int
    kv_bytes_per_token: int    # 0 for stages without a KV cache (diffusion, generation)
    context: int               # tokens per sequence the KV cache is sized for (0 without one)
    batch: int                 # sequences at once (scheduler.maxBatch)
    kv_bytes: int
    activation_bytes: int      # transformers AR stages: `ar_activation_bytes`; others ACTIVATION_FRACTION of weights
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
    activations = int(weights * ACTIVATION_FRACTION)
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
                f"cost measured on a tiny causal LM; for other stages {ACTIVATION_FRACTION:.0%} of the weights, not "
                "modelled")
    return "\n".join(rows)
