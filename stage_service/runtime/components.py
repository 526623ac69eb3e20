"""Loading one component of a published checkpoint into its transformers class.

The stage gives the checkpoint root, the component's name prefix (`talker.`) and the component's
class and config (a sub-config of the combined model's `config.json`). Only that component's tensors
are read (`ShardedCheckpoint`), straight into the model as transformers' loader places them; the
combined model's weight conversions (for example fusing per-expert MoE weights) apply to the
component as they do to the whole, because the checkpoint was written for the whole.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.checkpoints.configs import read_json, require_keys
from omnistage.checkpoints.shards import CheckpointError, ShardedCheckpoint


def load_component(ckpt: ShardedCheckpoint, prefix: str, cls, config, dtype: torch.dtype,
                   combined_model_type: str | None = None, without: tuple[str, ...] = (),
                   device: torch.device | str = "cpu", **kwargs):
    """`cls` with the tensors under `prefix`, in `dtype` on `device`; refuses a missing tensor by name
    (never random-fills).
    `without` names sub-modules (`visual`) left out: none of their tensors is read, and the sub-module
    is removed from the model once built."""
    if not ckpt.keys(prefix):
        raise CheckpointError(f"{ckpt.index_file if ckpt.index_file.exists() else ckpt.root}: "
                              f"no tensors under {prefix!r} (the checkpoint has no {prefix.rstrip('.')} part)")
    if combined_model_type:
        _borrow_conversions(cls, combined_model_type)
    skip = tuple(f"{name}." for name in without)
    state = {k: v for k, v in ckpt.state_dict(prefix).items() if not k.startswith(skip)} if skip else \
        ckpt.state_dict(prefix)
    model, info = cls.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                      output_loading_info=True, **kwargs)
    for name in without:
        setattr(model, name, None)
    missing = sorted(k for k in info.get("missing_keys") or () if not (skip and k.startswith(skip)))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        where = ckpt.index_file if ckpt.index_file.exists() else ckpt.root
        raise CheckpointError(f"{where}: tensor {prefix}{missing[0]}{more} missing from the checkpoint")
    return model.to(device).eval()


def _borrow_conversions(cls, combined_model_type: str) -> None:
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    if get_checkpoint_conversion_mapping(cls.__name__) is None:
        mapping = get_checkpoint_conversion_mapping(combined_model_type)
        if mapping:
            register_checkpoint_conversion_mapping(cls.__name__, mapping)


def read_config(root: Path, config_cls, required: tuple[str, ...] = ()):
    """The combined model's config, with the dotted keys `required` present in config.json itself, or
    one line naming config.json and the key."""
    file = Path(root) / "config.json"
    require_keys(file, read_json(file), required)
    try:
        return config_cls.from_pretrained(root)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise CheckpointError(f"{file}: {e}") from None
