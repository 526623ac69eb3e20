"""Pick the engine adapter for a stage from its `engine` and the model it points at."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from omnistage.checkpoints.families import family_of
from omnistage.contract.launch import model_dir
from omnistage.api import Pipeline, Stage
from omnistage.api.engines import adapters_for

from stage_service.runtime.base import Engine, EngineConfigError


class UnknownModel(EngineConfigError):
    pass


# Combined-checkpoint families (omnistage/checkpoints/families.py: which class names, aliases included)
# and the module whose ENGINES serve their parts.
FAMILY_ENGINES = {"qwen3_omni": ".qwen3_omni", "qwen2_5_omni": ".qwen2_5_omni"}


def _architecture(path: Path) -> str:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise UnknownModel(f"{path}: no config.json (build the tiny models with `omnistage models build`)")
    cfg = json.loads(cfg_file.read_text())
    return cfg.get("_class_name") or (cfg.get("architectures") or [""])[0]


def create_engine(pipeline: Pipeline, stage: Stage, model_root: str | os.PathLike | None = None) -> Engine:
    path = model_dir(stage, model_root)
    arch = ""
    if stage.engine == "vllm":
        if stage.component == "thinker":
            from stage_service.engines.vllm.thinker import VllmThinkerEngine as cls
        else:  # vLLM reads the model itself (its config.json, or another format it knows)
            from stage_service.engines.vllm.ar import VllmEngine

            return VllmEngine(pipeline, stage, path)
    elif stage.engine == "transformers":
        arch = _architecture(path)
        family = family_of(arch)
        if family is not None and family.name in FAMILY_ENGINES:  # one combined checkpoint: the stage's part
            ENGINES = importlib.import_module(FAMILY_ENGINES[family.name], __package__).ENGINES
            cls = ENGINES.get(stage.component)
            if cls is None:
                raise UnknownModel(f'{path}: a {arch} has the components {", ".join(ENGINES)}; stage '
                                   f'"{stage.name}" asks for component "{stage.component}"')
        elif arch.endswith("ForCausalLM"):
            from stage_service.engines.transformers.causal_lm import CausalLmEngine as cls
        else:
            raise UnknownModel(f"{path}: the transformers engine has no adapter for {arch or 'this model'}")
    elif stage.engine == "diffusers":
        from stage_service.engines.diffusers.denoisers import DENOISERS

        arch = _architecture(path)
        if arch in ("CLIPTextModel", "CLIPTextModelWithProjection"):
            from stage_service.engines.diffusers.engines import TextEncoderEngine as cls
        elif arch in DENOISERS:  # UNet or DiT: one denoise loop, a table entry per class
            from stage_service.engines.diffusers.engines import DenoiseEngine as cls
        elif arch == "AutoencoderKL":
            from stage_service.engines.diffusers.engines import VaeDecodeEngine as cls
        else:
            raise UnknownModel(f"{path}: the diffusers engine has no adapter for {arch or 'this model'}")
    else:
        raise UnknownModel(f'unknown engine "{stage.engine}"')
    # Every family's adapter for such a stage (Qwen3- and Qwen2.5-Omni share thinker and talker stages).
    declared = adapters_for(stage.engine, stage.kind, stage.component)
    served = getattr(cls, "ADAPTERS", None) or (cls.ADAPTER,)  # a class may serve several catalog entries
    if not set(declared) & set(served):
        # Validation checked the topology against the declared adapter: a model of another kind would
        # read or emit something else than the edges carry.
        names = " or ".join(a.name for a in served)
        raise UnknownModel(f"{path}: holds a {arch}, served by the {names} adapter, but stage "
                           f'"{stage.name}" (kind {stage.kind}, component "{stage.component}") declares '
                           f"{' or '.join(a.name for a in declared) or 'no adapter'}")
    return cls(pipeline, stage, path)
