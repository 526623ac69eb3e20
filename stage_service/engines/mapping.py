"""The mapping check of a stage: does every tensor its loader reads land in a parameter of its module, with
the right shape, and is every parameter filled? Answered on the meta device from the checkpoint's headers
(no tensor data is read), with the classes, configs and key conversions the stage's loader uses, so a real
published checkpoint, or its hollow layout (`omnistage models hollow`), can be checked on any machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from omnistage.checkpoints.shards import ShardedCheckpoint
from omnistage.families import family_named
from stage_service.runtime.components import ComponentMapping, Piece, map_component, read_config


def map_stage(family: str, component: str, root: str | Path, dtype: torch.dtype = torch.bfloat16
              ) -> tuple[ComponentMapping, ...]:
    """The mapping of every module the stage serving `component` of `family` loads from `root` (a Thinker
    with its encoders inline)."""
    root = Path(root)
    pieces = _PIECES.get(family)
    if pieces is not None:
        ckpt = ShardedCheckpoint(root)
        return tuple(p.mapping(ckpt, dtype) for p in pieces(root, component))
    fam = family_named(family)
    if fam.pipeline:
        part = fam.pipeline[component]
        return tuple(_map_pipeline_folder(root, sub.rstrip("?"), dtype) for sub in part.weights
                     if not (sub.endswith("?") and not (root / sub.rstrip("?")).is_dir()))
    raise KeyError(f'no mapping check for family "{family}"')


# ------------------------------------------------------------------ transformers checkpoints, by family
# Each family's loaders and this check read one description of what a stage loads (its `pieces`).

def _qwen3_omni(root: Path, component: str) -> tuple[Piece, ...]:
    from stage_service.engines.omni.encoder import tower_pieces
    from stage_service.engines.qwen3_omni.engines import EncoderEngine
    from stage_service.engines.qwen3_omni.steps import _config, pieces

    cfg = _config(root, component)
    return tower_pieces(EncoderEngine.classes(), cfg.thinker_config) if component == "encoder" else \
        pieces(cfg, component)


def _qwen2_5_omni(root: Path, component: str) -> tuple[Piece, ...]:
    from transformers import Qwen2_5OmniConfig

    from stage_service.engines.omni.encoder import tower_pieces
    from stage_service.engines.qwen2_5_omni.engines import EncoderEngine
    from stage_service.engines.qwen2_5_omni.steps import pieces

    cfg = read_config(root, Qwen2_5OmniConfig, family_named("qwen2_5_omni").parts[component].config_keys)
    return tower_pieces(EncoderEngine.classes(), cfg.thinker_config) if component == "encoder" else \
        pieces(cfg, component)


_PIECES: dict[str, Callable[[Path, str], tuple[Piece, ...]]] = {"qwen3_omni": _qwen3_omni,
                                                                "qwen2_5_omni": _qwen2_5_omni}


# ------------------------------------------------------------------ diffusers pipelines

def _map_pipeline_folder(root: Path, sub: str, dtype: torch.dtype) -> ComponentMapping:
    """One component folder of a diffusers pipeline, built from its config by the class model_index.json
    names, as the stage's `PipelineDir.load` does."""
    from stage_service.engines.diffusers.layout import PipelineDir

    folder = root / sub
    cls = PipelineDir(folder).component_class(sub)
    stem = "diffusion_pytorch_model" if (folder / "diffusion_pytorch_model.safetensors").exists() or \
        (folder / "diffusion_pytorch_model.safetensors.index.json").exists() else "model"
    ckpt = ShardedCheckpoint(folder, stem)
    if cls.__module__.startswith("transformers"):
        from transformers import AutoConfig

        return _named(sub, map_component(ckpt, "", cls, AutoConfig.from_pretrained(folder), dtype))
    with torch.device("meta"):
        module = cls.from_config(cls.load_config(folder))
    expected = {k: tuple(t.shape) for k, t in module.state_dict().items()}
    found = {k: ckpt.info(k).shape for k in ckpt.keys()}
    mismatched = tuple(sorted((f"{sub}/{k}", f"checkpoint {list(found[k])} vs module {list(expected[k])}")
                              for k in found.keys() & expected.keys() if found[k] != expected[k]))
    return ComponentMapping(f"{sub}/", len(found), tuple(sorted(f"{sub}/{k}" for k in found.keys() - expected.keys())),
                            tuple(sorted(f"{sub}/{k}" for k in expected.keys() - found.keys())), mismatched)


def _named(sub: str, m: ComponentMapping) -> ComponentMapping:
    return ComponentMapping(f"{sub}/", m.tensors, tuple(f"{sub}/{k}" for k in m.unmapped),
                            tuple(f"{sub}/{k}" for k in m.missing), tuple((f"{sub}/{k}", w) for k, w in m.mismatched))
