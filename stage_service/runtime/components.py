"""Loading one component of a published checkpoint into its transformers class.

The stage gives the checkpoint root, the component's name prefix (`talker.`) and the component's
class and config (a sub-config of the combined model's `config.json`). Only that component's tensors
are read (`ShardedCheckpoint`), straight into the model as transformers' loader places them; the
combined model's weight conversions (for example fusing per-expert MoE weights) apply to the
component as they do to the whole, because the checkpoint was written for the whole.
`map_component` answers, from the headers alone, where each tensor would land.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.checkpoints.configs import read_json, require_keys
from omnistage.checkpoints.shards import DTYPES, CheckpointError, ShardedCheckpoint


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


@dataclass(frozen=True)
class Piece:
    """One module a stage loads: the tensors under `prefix` into `cls` built from `config`, with the combined
    model's key conversions (`combined_model_type`). The stage loads it and the mapping check maps it from
    this one description, so the check builds what the stage builds."""
    prefix: str
    cls: Any
    config: Any
    combined_model_type: str | None = None
    without: tuple[str, ...] = ()
    dtype: torch.dtype | None = None  # kept in this dtype whatever the stage's (Token2Wav: float32)
    kwargs: tuple[tuple[str, Any], ...] = ()

    def load(self, ckpt: ShardedCheckpoint, dtype: torch.dtype, device: torch.device | str = "cpu"):
        return load_component(ckpt, self.prefix, self.cls, self.config, self.dtype or dtype, self.combined_model_type,
                              self.without, device, **dict(self.kwargs))

    def mapping(self, ckpt: ShardedCheckpoint, dtype: torch.dtype) -> ComponentMapping:
        return map_component(ckpt, self.prefix, self.cls, self.config, self.dtype or dtype, self.combined_model_type,
                             self.without, **dict(self.kwargs))


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


# ------------------------------------------------------------------ mapping without data

@dataclass(frozen=True)
class ComponentMapping:
    """Where the checkpoint's tensors under `prefix` land in the component's module, found on the meta
    device: `unmapped` (in the checkpoint, no parameter takes them), `missing` (a parameter no tensor
    fills), `mismatched` (name, checkpoint shape, module shape, or the conversion that failed)."""
    prefix: str
    tensors: int
    unmapped: tuple[str, ...]
    missing: tuple[str, ...]
    mismatched: tuple[tuple[str, str], ...]

    @property
    def ok(self) -> bool:
        return not (self.unmapped or self.missing or self.mismatched)

    def describe(self) -> str:
        """One line: the counts, then the first name of each kind."""
        head = (f"{self.prefix or '(root)'}: {self.tensors} tensors, {len(self.unmapped)} unmapped, "
                f"{len(self.missing)} missing, {len(self.mismatched)} shape mismatches")
        first = [f"unmapped {self.unmapped[0]}" if self.unmapped else "",
                 f"missing {self.missing[0]}" if self.missing else "",
                 f"{self.mismatched[0][0]} {self.mismatched[0][1]}" if self.mismatched else ""]
        return "; ".join([head, *(f for f in first if f)])


def map_component(ckpt: ShardedCheckpoint, prefix: str, cls, config, dtype: torch.dtype,
                  combined_model_type: str | None = None, without: tuple[str, ...] = (), **kwargs) -> ComponentMapping:
    """What `load_component` with the same arguments would place where, reading only the headers: the
    module is built on the meta device and the checkpoint's names and shapes go through transformers'
    own loading (its key renaming and weight conversions, e.g. per-expert MoE tensors fused), as meta
    tensors. A dtype omnistage cannot read is refused by name."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    if combined_model_type:
        _borrow_conversions(cls, combined_model_type)
    skip = tuple(f"{name}." for name in without)
    state = {}
    for key in ckpt.keys(prefix):
        name = key[len(prefix):]
        if skip and name.startswith(skip):
            continue
        info = ckpt.info(key)
        if info.dtype not in DTYPES:
            raise CheckpointError(f"{info.file}: {key} has dtype {info.dtype}, which omnistage cannot read "
                                  f"(it reads {', '.join(DTYPES)})")
        state[name] = torch.empty(info.shape, dtype=DTYPES[info.dtype], device="meta")
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype, **kwargs)
    conversions = get_model_conversion_mapping(model, None, None)
    for c in conversions:
        if isinstance(c, WeightConverter):
            c.force_cpu = False  # the loader converts big fused tensors on the CPU; meta tensors stay meta
    info, _ = convert_and_load_state_dict_in_model(
        model, state, LoadStateDictConfig(device_map={"": "meta"}, dtype=dtype, weight_mapping=conversions))
    mismatched = [(k, f"checkpoint {list(a)} vs module {list(b)}") for k, a, b in info.mismatched_keys]
    mismatched += [(k, "does not convert: " + _last_line(e)) for k, e in info.conversion_errors.items()]
    failed = {k for k, _ in mismatched}
    missing = set(info.missing_keys)
    # As `from_pretrained` ties: a tied copy the checkpoint saves once (UMT5's encoder embedding, which is
    # `shared.weight`) is filled from the other, not missing.
    model.tie_weights(missing_keys=missing, recompute_mapping=False)
    return ComponentMapping(
        prefix, len(state), tuple(sorted(prefix + k for k in info.unexpected_keys)),
        tuple(sorted(prefix + k for k in missing if k not in failed and not (skip and k.startswith(skip)))),
        tuple(sorted((prefix + k, why) for k, why in mismatched)))


def _last_line(error: str) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if line.startswith(("RuntimeError", "ValueError"))), lines[-1] if lines else "")
