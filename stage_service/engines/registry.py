"""Pick the engine class for a stage: its model's family (from the family table, by the class name its
checkpoint carries), then the family's engine for the stage's engine and adapter."""

from __future__ import annotations

import json
import os
from pathlib import Path

from omnistage.api import Pipeline, Stage
from omnistage.contract.launch import model_dir
from omnistage.families import Family, adapters_for, families, family_of
from stage_service.runtime.base import Engine, EngineConfigError


class UnknownModel(EngineConfigError):
    pass


def _read_class(config: Path) -> str:
    cfg = json.loads(config.read_text())
    return cfg.get("_class_name") or (cfg.get("architectures") or [""])[0]


def _architecture(path: Path) -> str:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise UnknownModel(f"{path}: no config.json (build the tiny models with `omnistage models build`)")
    return _read_class(cfg_file)


def _family(stage: Stage, path: Path, arch: str, reader: Family | None) -> Family:
    """A diffusers stage's family is its pipeline's (model_index.json one folder up); any other stage's is
    its checkpoint's class. `reader`, the family whose engine reads the model itself (vLLM), serves a whole
    model on that engine, and one we do not recognise."""
    if reader is not None and not stage.component:
        return reader
    index = path.parent / "model_index.json"
    name = _read_class(index) if stage.component and index.exists() else arch
    family = family_of(name) or reader
    if family is None:
        raise UnknownModel(f"{path}: the {stage.engine} engine has no adapter for {name or 'this model'}")
    return family


def create_engine(pipeline: Pipeline, stage: Stage, model_root: str | os.PathLike | None = None) -> Engine:
    path = model_dir(stage, model_root)
    reader = next((f for f in families() if stage.engine in f.reads_any_model_on), None)
    reads_itself = reader is not None and not stage.component
    arch = "" if reads_itself and not (path / "config.json").exists() else _architecture(path)
    family = _family(stage, path, arch, reader)
    # What validation checked the topology against; a model of another kind would read or emit something
    # other than the edges carry.
    declared = adapters_for(stage.engine, stage.kind, stage.component)
    engines = family.engines()
    adapter = next((a for a in declared if (stage.engine, a) in engines), None)
    if adapter is None:
        if family.components != ("",) and stage.component not in family.components:
            raise UnknownModel(f'{path}: a {arch} has the components {", ".join(family.components)}; stage '
                               f'"{stage.name}" asks for component "{stage.component}"')
        served = " or ".join(a.name for (e, a) in engines if e == stage.engine) or "no"
        raise UnknownModel(f"{path}: holds a {arch or family.name}, served by the {served} adapter, but stage "
                           f'"{stage.name}" (kind {stage.kind}, component "{stage.component}") declares '
                           f"{' or '.join(a.name for a in declared) or 'no adapter'}")
    cls = engines[(stage.engine, adapter)]
    known = getattr(cls, "ARCHITECTURES", None)
    if known is not None and arch not in known:
        raise UnknownModel(f"{path}: the {stage.engine} engine has no adapter for {arch or 'this model'}")
    return cls(pipeline, stage, path)
