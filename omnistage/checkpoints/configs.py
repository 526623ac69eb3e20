"""Reading a checkpoint's JSON files with errors that name the file and the key."""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.checkpoints.shards import CheckpointError


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


def require_keys(file: Path, data: dict, keys: tuple[str, ...]) -> None:
    """Every dotted key (`talker_config.accept_hidden_layer`) is in the file itself: a config class would
    fill a missing sub-config with its defaults, which are another model's values."""
    for dotted in keys:
        node = data
        for name in dotted.split("."):
            if not isinstance(node, dict) or name not in node:
                raise CheckpointError(f"{file}: missing key {dotted}")
            node = node[name]
