"""A memory plan per stage, from the checkpoint's config and the pipeline, before anything loads.

For each stage: its weights in the dtype it runs in (the tensors `check_stage` counts, converted from
their stored dtype), and for AR stages the KV cache: layers x KV heads x head dim x 2 (keys and values)
x dtype bytes per token, times the context (`engineArgs.max_model_len`, else the config's
`max_position_embeddings`) times the batch (`scheduler.maxBatch`). Activations are an ESTIMATE until
measured: a fixed fraction of the weights (`ACTIVATION_FRACTION`). Only headers and configs are read.
Placement and refusal do not use the plan yet.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from omnistage.api import Pipeline, Stage, StageDeployment
from omnistage.checkpoints.check import check_stage
from omnistage.checkpoints.configs import read_json
from omnistage.checkpoints.shards import DTYPES, CheckpointError, TensorInfo
from omnistage.contract.devices import AUTO_DTYPE

# Estimate, not measured: activations and workspace as a share of the weights, until the tiny-model
# measurement of peak memory per stage replaces it.
ACTIVATION_FRACTION = 0.1
# Where an AR component's decoder config lives, first found wins: an omni Thinker's and Talker's
# `<component>_config.text_config` (Qwen2.5-Omni's Talker is flat: `talker_config`), a causal LM's root.
AR_CONFIG_PATHS = ("{c}_config.text_config", "{c}_config", "text_config", "")


@dataclass(frozen=True)
class StagePlan:
    stage: str
    weights_bytes: int
    kv_bytes_per_token: int    # 0 for stages without a KV cache (diffusion, generation)
    context: int               # tokens per sequence the KV cache is sized for (0 without one)
    batch: int                 # sequences at once (scheduler.maxBatch)
    kv_bytes: int
    activation_bytes: int      # an estimate until measured: ACTIVATION_FRACTION of the weights
    total_bytes: int


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


def ar_text_config(config: Mapping, component: str) -> Mapping:
    """The decoder config of an AR component (see AR_CONFIG_PATHS)."""
    for pattern in AR_CONFIG_PATHS:
        node: object = config
        for name in filter(None, pattern.format(c=component).split(".")):
            node = node.get(name) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and "num_hidden_layers" in node:
            return node
    raise CheckpointError(f"config.json: no decoder config for component {component or '(model)'!r} "
                          f"(looked in {', '.join(p.format(c=component) or 'the root' for p in AR_CONFIG_PATHS)})")


def weights_in_dtype(tensors: Iterable[TensorInfo], dtype: str) -> int:
    """Bytes of `tensors` once loaded in `dtype`: floating tensors converted, others (ids, masks) as stored."""
    out = 0
    for info in tensors:
        stored = DTYPES[info.dtype]
        out += info.nbytes // stored.itemsize * dtype_bytes(dtype) if stored.is_floating_point else info.nbytes
    return out


def plan_stage(pipeline: Pipeline, stage: Stage, root: str | os.PathLike | None = None) -> StagePlan:
    """The stage's memory plan; raises what `check_stage` raises for a checkpoint it cannot serve."""
    load = check_stage(pipeline, stage, root)
    dep = pipeline.deployment.stages.get(stage.name)
    dtype = stage_dtype(dep, load.device)
    weights = weights_in_dtype(load.tensors, dtype)
    per_token = context = kv = 0
    batch = dep.scheduler.max_batch if dep is not None else 1
    if stage.kind == "ar":
        text = ar_text_config(read_json(load.directory / "config.json"), stage.component)
        per_token = kv_bytes_per_token(text, dtype_bytes(dtype))
        engine_args = dep.engine_args if dep is not None else {}
        context = int(engine_args.get("max_model_len") or text["max_position_embeddings"])
        kv = per_token * context * batch
    activations = int(weights * ACTIVATION_FRACTION)
    return StagePlan(stage.name, weights, per_token, context, batch, kv, activations, weights + kv + activations)


def describe_plans(plans: list[StagePlan]) -> str:
    """A table in GiB, one row per stage."""
    gib = float(1 << 30)
    rows = [f"{'stage':<16}{'weights':>10}{'KV/token':>12}{'context':>9}{'batch':>7}{'KV':>10}{'activ.*':>10}"
            f"{'total':>10}"]
    for p in plans:
        gibs = "".join(f"{n / gib:>10.3f}" for n in (p.kv_bytes, p.activation_bytes, p.total_bytes))
        rows.append(f"{p.stage:<16}{p.weights_bytes / gib:>10.3f}{p.kv_bytes_per_token:>10} B{p.context:>9}"
                    f"{p.batch:>7}{gibs}")
    rows.append(f"GiB except KV/token; * activations are an estimate ({ACTIVATION_FRACTION:.0%} of the weights) "
                "until measured")
    return "\n".join(rows)
