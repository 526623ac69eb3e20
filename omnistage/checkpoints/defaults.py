"""The request limits a pipeline file leaves to the model (0), read from its checkpoints.

The orchestrator fills them at start from the model store (`omnistage serve`'s `--models`; on Kubernetes
the model volume, mounted read-only), reading configs only:

- `maxTokens`: the text stage's context: its `engineArgs.max_model_len`, else its decoder config's
  `max_position_embeddings` (the text stage: the one the `text` output comes from, else the first AR stage);
- `defaultMaxTokens`: that checkpoint's `generation_config.json` `max_new_tokens`, else
  MODEL_LIMIT_FALLBACKS (256), at most `maxTokens`;
- `defaultImageSide`: the denoise stage's component `sample_size` (latent pixels) x the VAE's scale factor
  (2 ** (number of `block_out_channels` - 1)): 128 x 8 = 1024 for SD3.5, 64 x 8 = 512 for SD 1.5; at most
  `maxImageSide`;
- `defaultInferenceSteps`: the published pipeline's own default (the family's `default_inference_steps`:
  28 for SD3, 50 for SD), at most `maxInferenceSteps`;
- `defaultGuidanceScale`: the published pipeline's own default (the family's `default_guidance_scale`: 5.0 for
  Wan, 7.0 for SD3, 7.5 for SD);
- `defaultWidth` / `defaultHeight`: a pipeline whose frames are not square and whose checkpoint gives no side
  (the family's `default_size`: 832 x 480 for Wan), when the file sets no size at all (a `defaultImageSide`
  it sets is its size) and it fits `maxImageSide`.

A value the file sets is kept as written. A checkpoint that cannot be read leaves the limit to the
fallbacks `resolve` applies (`omnistage.api.MODEL_LIMIT_FALLBACKS`), with a note saying why.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from omnistage.api import MODEL_LIMIT_FALLBACKS, Pipeline, Stage
from omnistage.checkpoints.configs import CheckpointError, ar_text_config, read_json
from omnistage.contract.launch import checkpoint_dir
from omnistage.families import family_of

_UNREADABLE = (CheckpointError, OSError, KeyError, TypeError, ValueError)


def text_stage(pipeline: Pipeline) -> Stage | None:
    """The stage whose tokens the text limits bound: the `text` output's, else the first AR stage."""
    for out in pipeline.outputs:
        if out.modality == "text" and pipeline.stage(out.stage).kind == "ar":
            return pipeline.stage(out.stage)
    return next((s for s in pipeline.topo_order() if s.kind == "ar"), None)


def image_stage(pipeline: Pipeline) -> Stage | None:
    return next((s for s in pipeline.topo_order() if s.kind == "diffusion"), None)


def text_limits(pipeline: Pipeline, stage: Stage, root: str | os.PathLike | None) -> dict[str, tuple[int, str]]:
    """`max_tokens` and `default_max_tokens` from the text stage's checkpoint, each with where it came from."""
    directory = checkpoint_dir(stage, root)
    text = ar_text_config(read_json(directory / "config.json"), stage.component)
    dep = pipeline.deployment.stages.get(stage.name)
    set_len = dep.engine_args.get("max_model_len") if dep is not None else None
    context = int(set_len or text["max_position_embeddings"])
    source = (f"{stage.name}'s engineArgs.max_model_len" if set_len
              else f"{stage.name}'s max_position_embeddings ({directory / 'config.json'})")
    out = {"max_tokens": (context, source)}
    generation = directory / "generation_config.json"
    new = read_json(generation).get("max_new_tokens") if generation.is_file() else None
    most = pipeline.limits.max_tokens or context
    if isinstance(new, int) and new > 0:
        out["default_max_tokens"] = (min(new, most), f"max_new_tokens of {generation}")
    else:
        out["default_max_tokens"] = (min(MODEL_LIMIT_FALLBACKS["default_max_tokens"], most),
                                     f"no max_new_tokens in {generation.name}: the fallback")
    return out


def vae_scale(directory: Path) -> int:
    """Pixels per latent of a diffusers pipeline's VAE: 2 ** (number of its `block_out_channels` - 1)."""
    return 2 ** (len(read_json(directory / "vae" / "config.json")["block_out_channels"]) - 1)


def native_side(directory: Path, component: str) -> tuple[int, int]:
    """The denoiser's native image side (its `sample_size` x the VAE's scale), and that sample size."""
    sample = read_json(directory / component / "config.json")["sample_size"]
    sample = int(sample[0] if isinstance(sample, list) else sample)
    return sample * vae_scale(directory), sample


def image_limits(pipeline: Pipeline, stage: Stage,
                 root: str | os.PathLike | None) -> dict[str, tuple[int | float, str]]:
    """`default_image_side`, `default_inference_steps`, `default_guidance_scale` and the family's
    `default_width` / `default_height` from the denoise stage's pipeline checkpoint."""
    directory = checkpoint_dir(stage, root)
    index = read_json(directory / "model_index.json")
    limits = pipeline.limits
    out = {}
    # A video DiT (Wan's) has no native square side (no `sample_size`): the side's fallback applies, its steps not.
    if "sample_size" in read_json(directory / stage.component / "config.json"):
        side, sample = native_side(directory, stage.component)
        out["default_image_side"] = (min(side, limits.max_image_side),
                                     f"{stage.component}.sample_size {sample} x the VAE's scale {side // sample}")
    family = family_of(index.get("_class_name", ""))
    if family is not None and family.default_inference_steps:
        out["default_inference_steps"] = (min(family.default_inference_steps, limits.max_inference_steps),
                                          f"the {index['_class_name']} default")
    if family is not None and family.default_guidance_scale:
        out["default_guidance_scale"] = (family.default_guidance_scale, f"the {index['_class_name']} default")
    if family is not None and family.default_size and not (limits.default_width or limits.default_height):
        width, height = family.default_size
        source = f"the {index['_class_name']} default {width}x{height}"
        if max(width, height) <= limits.max_image_side:
            out["default_width"], out["default_height"] = (width, source), (height, source)
        else:  # a size the limits refuse is no default: left at 0, the square side's fallback applies
            why = (0, f"{source} exceeds maxImageSide {limits.max_image_side}: not taken, the square fallback applies")
            out["default_width"], out["default_height"] = why, why
    return out


def with_model_limits(pipeline: Pipeline, root: str | os.PathLike | None = None) -> tuple[Pipeline, list[str]]:
    """`pipeline` with each limit it leaves at 0 read from its checkpoints, and one note per limit: its value
    and where it came from, or why it stays with the fallback."""
    limits = pipeline.limits
    wanted = {name for name in ("max_tokens", "default_max_tokens", "default_image_side", "default_inference_steps",
                                "default_guidance_scale", "default_width", "default_height")
              if not getattr(limits, name)}
    if limits.default_image_side:  # the file's square side is its size: no other default width or height
        wanted -= {"default_width", "default_height"}
    found: dict[str, tuple[int | float, str]] = {}
    notes: list[str] = []
    readers = ((text_limits, text_stage(pipeline), {"max_tokens", "default_max_tokens"}),
               (image_limits, image_stage(pipeline), {"default_image_side", "default_inference_steps",
                                                      "default_guidance_scale", "default_width", "default_height"}))
    for read, stage, names in readers:
        if stage is None or not wanted & names:
            continue
        try:
            found.update(read(pipeline, stage, root))
        except _UNREADABLE as e:
            notes.append(f"{stage.name}: {Path(checkpoint_dir(stage, root))}: cannot read its limits "
                         f"({type(e).__name__}: {e}); the fallbacks apply")
    values = {name: found[name][0] for name in wanted if name in found}
    notes += [f"limits.{name} = {found[name][0]} ({found[name][1]})" for name in sorted(values)]
    return dataclasses.replace(pipeline, limits=dataclasses.replace(limits, **values)), notes
