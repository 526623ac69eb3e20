"""Reading a checkpoint's JSON files with errors that name the file and the key (no torch: the orchestrator
reads its limits with it)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

# Where an AR component's decoder config lives, first found wins: an omni Thinker's and Talker's
# `<component>_config.text_config` (Qwen2.5-Omni's Talker is flat: `talker_config`), a causal LM's root.
AR_CONFIG_PATHS = ("{c}_config.text_config", "{c}_config", "text_config", "")


class CheckpointError(Exception):
    """A checkpoint that cannot be served; the message names the file or key."""


def read_json(file: Path) -> dict:
    """A JSON object from `file`; a missing file means the folder is not a checkpoint."""
    file = Path(file)
    if not file.exists():
        raise CheckpointError(f"{file.parent}: no {file.name} (not a checkpoint)")
    try:
        data = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    return data


GENERATION_CONFIG = "generation_config.json"


def generation_config(root: Path) -> dict:
    """The checkpoint's generation_config.json (its sampling defaults, its end-of-sequence ids); {} without one."""
    file = Path(root) / GENERATION_CONFIG
    return read_json(file) if file.exists() else {}


def require_keys(file: Path, data: dict, keys: tuple[str, ...]) -> None:
    """Every dotted key (`talker_config.accept_hidden_layer`) is in the file itself: a config class would
    fill a missing sub-config with its defaults, which are another model's values."""
    for dotted in keys:
        node = data
        for name in dotted.split("."):
            if not isinstance(node, dict) or name not in node:
                raise CheckpointError(f"{file}: missing key {dotted}")
            node = node[name]


def ar_text_config(config: Mapping, component: str) -> Mapping:
    """The decoder config of an AR component: under its family's part config where the family names one (a
    Qwen3-TTS `tts_talker`: `talker_config`), else as AR_CONFIG_PATHS find it."""
    sub = _part_config(config, component)
    paths = ((f"{sub}.text_config", sub) if sub else ()) + tuple(p.format(c=component) for p in AR_CONFIG_PATHS)
    for path in paths:
        node: object = config
        for name in filter(None, path.split(".")):
            node = node.get(name) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and "num_hidden_layers" in node:
            return node
    raise CheckpointError(f"config.json: no decoder config for component {component or '(model)'!r} "
                          f"(looked in {', '.join(p or 'the root' for p in paths)})")


def _part_config(config: Mapping, component: str) -> str:
    """The sub-config key of the checkpoint's family's part `component` ("" when it names none)."""
    from omnistage.families import family_of

    architectures = config.get("architectures") or [""]
    family = family_of(str(architectures[0]))
    part = family.parts.get(component) if family is not None else None
    return part.config if part is not None and not part.folder else ""
