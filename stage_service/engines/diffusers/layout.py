"""A diffusers pipeline directory as its authors publish it: `model_index.json` and one folder per component.

`model_index.json` names the pipeline class and, per component, its library and class (`null` for a
component the pipeline goes without, such as SD3's T5 encoder). Each stage serves one component
folder; this module is how it finds the rest it needs (the tokenizer next to a text encoder, the
scheduler and the VAE's config next to a denoiser) and loads a component by the class the index names,
as `DiffusionPipeline.from_pretrained` does, but only a class on the allowlist unless the stage trusts remote
code (`omnistage/checkpoints/components.py`). Every refusal names the file or the entry.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from omnistage.checkpoints.components import refusal
from stage_service.runtime.errors import EngineConfigError

MODEL_INDEX = "model_index.json"
SCHEDULER_CONFIG = "scheduler_config.json"


class PipelineDir:
    """The pipeline directory around one component folder (a stage's `model/component`)."""

    def __init__(self, component_dir: Path, trust_remote_code: bool = False):
        self.component = component_dir.name
        self.trust_remote_code = trust_remote_code
        self.root = component_dir.parent
        self.index_file = self.root / MODEL_INDEX
        self.index = _read_json(self.index_file, f"{self.root} is not a diffusers pipeline directory")

    @property
    def pipeline_class(self) -> str:
        name = self.index.get("_class_name")
        if not isinstance(name, str):
            raise EngineConfigError(f"{self.index_file}: no _class_name (the pipeline class)")
        return name

    def has(self, component: str) -> bool:
        """Whether the pipeline has this component (an entry `[null, null]` means it goes without)."""
        entry = self.index.get(component)
        return isinstance(entry, list) and len(entry) == 2 and entry[1] is not None

    def component_class(self, component: str) -> type:
        """The class `model_index.json` names for a component, imported from its library."""
        if not self.has(component):
            raise EngineConfigError(f'{self.index_file}: the {self.pipeline_class} has no component "{component}"')
        why = refusal(component, self.index[component], self.trust_remote_code)
        if why:
            raise EngineConfigError(f"{self.index_file}: {why}")
        library, name = self.index[component]
        try:
            return getattr(importlib.import_module(library), name)
        except (ImportError, AttributeError):
            raise EngineConfigError(f'{self.index_file}: component "{component}" is a {library}.{name}, '
                                    f"which this installation of {library} does not have") from None

    def load(self, component: str, device: torch.device | str = "cpu", **kwargs: Any):
        """A component loaded from its folder by the class the index names (models: in eval mode, on
        `device`)."""
        folder = self.root / component
        if not folder.is_dir():
            raise EngineConfigError(f'{folder}: missing (model_index.json lists component "{component}")')
        obj = self.component_class(component).from_pretrained(folder, **kwargs)
        return obj.to(device).eval() if isinstance(obj, torch.nn.Module) else obj

    def config(self, component: str) -> dict[str, Any]:
        """A component's own config file (`config.json`; the scheduler's `scheduler_config.json`)."""
        name = SCHEDULER_CONFIG if component == "scheduler" else "config.json"
        return _read_json(self.root / component / name, f'the {self.pipeline_class} needs its "{component}" config')

    def scheduler_class(self) -> type:
        """The scheduler class of `scheduler/scheduler_config.json`: a fresh object per image holds its state."""
        import diffusers

        cfg = self.config("scheduler")
        name = cfg.get("_class_name", "")
        cls = getattr(diffusers, name, None) if name else None
        if cls is None:
            raise EngineConfigError(f"{self.root / 'scheduler' / SCHEDULER_CONFIG}: _class_name "
                                    f"{name!r} is not a diffusers scheduler")
        return cls


def _read_json(path: Path, why: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineConfigError(f"{path}: missing ({why})") from None
    except (OSError, ValueError) as e:
        raise EngineConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise EngineConfigError(f"{path}: expected a JSON object")
    return data
