"""Pick the engine adapter for a stage from its `engine` and the model it points at."""

from __future__ import annotations

import json
import os
from pathlib import Path

from omnistage.launch import model_dir
from omnistage.spec import Pipeline, Stage, adapter_for

from .base import Engine, EngineConfigError


class UnknownModel(EngineConfigError):
    pass


def _architecture(path: Path) -> str:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise UnknownModel(f"{path}: no config.json (build the tiny models with `omnistage models build`)")
    cfg = json.loads(cfg_file.read_text())
    return cfg.get("_class_name") or (cfg.get("architectures") or [""])[0]


def create_engine(pipeline: Pipeline, stage: Stage, model_root: str | os.PathLike | None = None) -> Engine:
    path = model_dir(stage, model_root)
    if stage.engine == "vllm":
        from .vllm_ar import VllmEngine

        return VllmEngine(pipeline, stage, path)
    arch = _architecture(path)
    if stage.engine == "transformers":
        if arch == "Qwen3OmniMoeThinkerForConditionalGeneration":
            from .qwen3_omni import ThinkerEngine as cls
        elif arch == "Qwen3OmniMoeTalkerForConditionalGeneration":
            from .qwen3_omni import TalkerEngine as cls
        elif arch == "Qwen3OmniMoeCode2Wav":
            from .qwen3_omni import Code2WavEngine as cls
        elif arch.endswith("ForCausalLM"):
            from .hf_causal import CausalLmEngine as cls
        else:
            raise UnknownModel(f"{path}: the transformers engine has no adapter for {arch or 'this model'}")
    elif stage.engine == "diffusers":
        if arch in ("CLIPTextModel", "CLIPTextModelWithProjection"):
            from .diffusion import TextEncoderEngine as cls
        elif arch == "UNet2DConditionModel":
            from .diffusion import DenoiseEngine as cls
        elif arch == "AutoencoderKL":
            from .diffusion import VaeDecodeEngine as cls
        else:
            raise UnknownModel(f"{path}: the diffusers engine has no adapter for {arch or 'this model'}")
    else:
        raise UnknownModel(f'unknown engine "{stage.engine}"')
    declared = adapter_for(stage.engine, stage.kind, stage.component)
    if cls.ADAPTER is not declared:
        # Validation checked the topology against the declared adapter: a model of another kind would
        # read or emit something else than the edges carry.
        raise UnknownModel(f"{path}: holds a {arch}, served by the {cls.ADAPTER.name} adapter, but stage "
                           f'"{stage.name}" (kind {stage.kind}, component "{stage.component}") declares '
                           f"{declared.name if declared else 'no adapter'}")
    return cls(pipeline, stage, path)
