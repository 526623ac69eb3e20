"""`omnistage models check`: what each stage of a pipeline will load, or why it cannot.

For every stage: which directory, which files and how many bytes of weights it reads, on which
device; or one line naming the stage (by field path), the file or config key, and what is wrong.
Only headers and configs are read. `serve` and the stage service run the same check before any
weights are loaded, so a broken checkpoint is refused before a process starts (or, on Kubernetes,
in the stage container's exit message).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omnistage.api import Pipeline, Stage
from omnistage.api.model_sources import missing_hint
from omnistage.checkpoints.components import refusal
from omnistage.checkpoints.configs import read_json, require_keys
from omnistage.checkpoints.names import TOKENIZER_FILES
from omnistage.checkpoints.shards import DTYPES, CheckpointError, ShardedCheckpoint, TensorInfo
from omnistage.contract.devices import uses_gpus
from omnistage.contract.launch import checkpoint_dir
from omnistage.families import Part, family_of, served_architectures


@dataclass(frozen=True)
class LoadPlan:
    stage: str
    family: str                          # e.g. qwen3_omni/talker, sd3/transformer
    directory: Path
    weights: tuple[tuple[str, int], ...]  # (file relative to directory, bytes of this stage's tensors in it)
    other_files: tuple[str, ...]         # configs, tokenizers, speaker files read besides the weights
    device: str
    tensors: tuple[TensorInfo, ...] = ()  # the headers of this stage's tensors (read once, here)

    @property
    def weight_bytes(self) -> int:
        return sum(n for _, n in self.weights)


class StageCheckError(Exception):
    """One stage's model cannot be served: `field` is the stage's path in the pipeline file."""

    def __init__(self, field: str, stage: str, message: str):
        super().__init__(f"{field} ({stage}): {message}")
        self.field, self.stage, self.message = field, stage, message


def check_pipeline(pipeline: Pipeline, root: str | os.PathLike | None = None, only: str | None = None
                   ) -> tuple[list[LoadPlan], list[StageCheckError]]:
    """Every stage's plan or refusal (`only`: that stage's alone)."""
    plans, errors = [], []
    for stage in pipeline.stages if only is None else [pipeline.stage(only)]:
        try:
            plans.append(check_stage(pipeline, stage, root))
        except StageCheckError as e:
            errors.append(e)
    return plans, errors


def check_stage(pipeline: Pipeline, stage: Stage, root: str | os.PathLike | None = None) -> LoadPlan:
    i = next(i for i, s in enumerate(pipeline.stages) if s.name == stage.name)
    field = f"spec.topology.stages[{i}]"
    path = checkpoint_dir(stage, root)
    dep = pipeline.deployment.stages.get(stage.name)
    device = "cuda" if dep is not None and uses_gpus(dep) else "cpu"
    try:
        if not path.is_dir():
            hint = missing_hint(stage.model)
            raise CheckpointError(f"{path}: no such model directory" + (f" ({hint})" if hint else ""))
        if (path / "model_index.json").exists():
            family, weights, others, tensors = _diffusers(path, stage.component, stage.trust_remote_code)
        else:
            family, weights, others, tensors = _transformers(path, stage.component)
    except CheckpointError as e:
        raise StageCheckError(f"{field}.model", stage.name, str(e)) from None
    return LoadPlan(stage.name, family, path, weights, others, device, tensors)


# ------------------------------------------------------------------ transformers checkpoints

def _transformers(path: Path, component: str):
    config = read_json(path / "config.json")
    architecture = (config.get("architectures") or [""])[0]
    family = family_of(architecture)
    if family is None or not family.parts:
        raise CheckpointError(f"{path / 'config.json'}: architecture {architecture or '(none)'} is not one "
                              f"omnistage serves ({served_architectures()})")
    part = family.parts.get(component)
    if part is None:
        parts = ", ".join(p or '""' for p in family.parts)
        what = f'component "{component}"' if component else "the whole model"
        raise CheckpointError(f"{path}: {architecture} has no {what} to serve (components: {parts})")
    base = path / part.folder
    own_config = read_json(base / "config.json") if part.folder else config
    require_keys(base / "config.json", own_config, part.config_keys)
    ckpt = ShardedCheckpoint(base)
    if not ckpt.keys(part.prefix):
        raise CheckpointError(f"{ckpt.index_file if ckpt.index_file.exists() else base}: no tensors under "
                              f"{part.prefix!r} (the checkpoint lacks its {component} part)")
    if not part.folder:  # a nested sub-model holds parts no stage serves (the speech tokenizer's encoder)
        _no_stray_tensors(ckpt, [p for p in family.parts.values() if not p.folder])
    for key in part.borrows:
        ckpt.info(key)
    others = ["config.json", *([f"{part.folder}/config.json"] if part.folder else []), *_files(path, part)]
    weights = ckpt.bytes_by_file(part.prefix)
    tensors = _readable(ckpt, part.prefix)
    return f"{family.name}/{component or 'model'}", weights, tuple(others), tensors


def _no_stray_tensors(ckpt: ShardedCheckpoint, parts) -> None:
    """Every tensor the index names is under some part a stage serves: any other is a checkpoint of another
    layout (or a renamed part) whose weights no stage would read."""
    prefixes = tuple(p for part in parts for p in ((part.prefix,) if isinstance(part.prefix, str) else part.prefix))
    stray = [k for k in ckpt.keys() if not k.startswith(prefixes)]
    if stray:
        where = ckpt.index_file if ckpt.index_file.exists() else ckpt.root
        raise CheckpointError(f"{where}: {len(stray)} tensor{'s' * (len(stray) != 1)} under no part a stage reads "
                              f"(first: {stray[0]}; parts: {', '.join(prefixes)})")


def _readable(ckpt: ShardedCheckpoint, prefix: str = "") -> tuple[TensorInfo, ...]:
    """The headers of the tensors under `prefix`, each in a dtype omnistage reads: any other is refused by name
    before anything loads."""
    keys = ckpt.keys(prefix)
    infos = tuple(ckpt.info(key) for key in keys)
    for key, info in zip(keys, infos):
        if info.dtype not in DTYPES:
            raise CheckpointError(f"{info.file}: {key} has dtype {info.dtype} ({info.nbytes} bytes), which "
                                  f"omnistage cannot read (it reads {', '.join(DTYPES)})")
    return infos


def _files(path: Path, part: Part) -> list[str]:
    found = []
    if part.tokenizer:
        present = [f for f in TOKENIZER_FILES if (path / f).exists()]
        if not present:
            raise CheckpointError(f"{path}: no tokenizer ({' or '.join(TOKENIZER_FILES)})")
        found += present
    for name in part.files:
        if not (path / name).exists():
            raise CheckpointError(f"{path / name}: missing")
        found.append(name)
    found += [name for name in part.optional_files if (path / name).exists()]
    found += [f"rows of {key}" for key in part.borrows]
    return found


# ------------------------------------------------------------------ diffusers pipelines

def _diffusers(path: Path, component: str, trust_remote_code: bool = False):
    index = read_json(path / "model_index.json")
    cls = index.get("_class_name", "")
    family = family_of(cls)
    if family is None or not family.pipeline:
        raise CheckpointError(f"{path / 'model_index.json'}: pipeline {cls or '(none)'} is not one omnistage serves "
                              f"({served_architectures()})")
    name, stages = family.name, family.pipeline
    if component not in stages:
        raise CheckpointError(f"{path}: a {cls} has no stage component \"{component}\" "
                              f"(components: {', '.join(stages)})")
    weights: list[tuple[str, int]] = []
    tensors: list[TensorInfo] = []
    others: list[str] = ["model_index.json"]
    reads = stages[component]
    for sub in (s.rstrip("?") for s in (*reads.weights, *reads.configs)):   # the classes the stage imports
        entry = index.get(sub)
        if entry is None or entry == [None, None]:   # absent, or a component the pipeline goes without
            continue
        why = refusal(sub, entry, trust_remote_code)
        if why:
            raise CheckpointError(f"{path / 'model_index.json'}: {why}")
    for sub, with_weights in [*((w, True) for w in reads.weights), *((c, False) for c in reads.configs)]:
        folder = _sub_folder(path, index, sub)
        if folder is None:
            continue
        if not with_weights:   # a model's config.json only, or a tokenizer's / scheduler's files
            if (folder / "config.json").exists():
                others.append(f"{folder.name}/config.json")
            else:
                others += [f"{folder.name}/{f.name}" for f in sorted(folder.iterdir())
                           if f.suffix in (".json", ".txt", ".model")]
            continue
        others.append(f"{folder.name}/config.json")
        read_json(folder / "config.json")
        stem = next((s for s in ("diffusion_pytorch_model", "model")
                     if (folder / f"{s}.safetensors").exists() or (folder / f"{s}.safetensors.index.json").exists()),
                    None)
        if stem is None:
            raise CheckpointError(f"{folder}: no weights (diffusion_pytorch_model.safetensors or model.safetensors)")
        ckpt = ShardedCheckpoint(folder, stem)
        weights += [(f"{folder.name}/{name}", n) for name, n in ckpt.bytes_by_file()]
        tensors += _readable(ckpt)
    return f"{name}/{component}", tuple(weights), tuple(others), tuple(tensors)


def _sub_folder(path: Path, index: dict, sub: str) -> Path | None:
    """A component sub-folder the stage reads; None for an optional one the pipeline leaves out."""
    optional = sub.endswith("?")
    sub = sub.rstrip("?")
    entry = index.get(sub)
    if not isinstance(entry, list) or not entry or entry[0] is None:
        if optional:
            return None
        raise CheckpointError(f"{path / 'model_index.json'}: no component {sub}")
    folder = path / sub
    if not folder.is_dir() or not any(folder.iterdir()):
        raise CheckpointError(f"{folder}: missing (model_index.json lists {sub})")
    return folder


# ------------------------------------------------------------------ report

def describe(plans: list[LoadPlan]) -> str:
    lines = []
    for p in plans:
        lines.append(f"{p.stage}: {p.family} from {p.directory} on {p.device}: "
                     f"{_size(p.weight_bytes)} of weights in {len(p.weights)} file{'s' * (len(p.weights) != 1)}")
        lines += [f"    {name}  {_size(n)}" for name, n in p.weights]
        lines.append(f"    also reads: {', '.join(p.other_files)}")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} TiB"
