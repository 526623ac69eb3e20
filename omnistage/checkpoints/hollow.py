"""Hollow checkpoints: the exact published layout of a real model, with no weights in it.

`omnistage models hollow FAMILY DIR` writes what the published repository holds: its `config.json`
(or, for a diffusers pipeline, `model_index.json` and each component's config), the tensor names and
shapes the library's model classes give when built from those configs on the meta device (in the
published naming: per-expert MoE tensors, as transformers saves them), the shard index with the
published shard count, and shards that are real safetensors headers over a sparse hole: the file has
its full size, no data is written and no disk is used. `omnistage models check` and the meta-device
mapping check of each stage (`stage_service.engines.mapping`) read nothing but headers and configs, so
they run on these as they would on the real download.

The published configs are shipped in `published/`; `published/README.md` says where each value came from.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from omnistage.checkpoints.names import PROCESSOR_CONFIG, QWEN2_5_OMNI_SPEAKERS, TOKENIZER_FILES

PUBLISHED = Path(__file__).with_name("published")
PLACEHOLDER_NOTE = "hollow checkpoint: a stand-in, not the published file"

# safetensors dtype names by torch dtype name (the ones a published checkpoint of these families holds)
_SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int64": "I64", "int32": "I32",
                      "uint8": "U8", "bool": "BOOL"}
# bits per element of every safetensors dtype (F4 packs two to a byte)
_DTYPE_BITS = {"F64": 64, "F32": 32, "BF16": 16, "F16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U64": 64,
               "U32": 32, "U16": 16, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4}


@dataclass(frozen=True)
class Weights:
    """One set of weights of a published repository: a model class and how its tensors are sharded."""
    folder: str          # "" for the root of a transformers checkpoint, else the diffusers sub-folder
    library: str         # "transformers" or "diffusers"
    cls: str             # the model class that gives the tensor names and shapes
    stem: str = "model"  # model / diffusion_pytorch_model
    shards: int = 1      # the published shard count (1: a single `<stem>.safetensors`)
    dtype: str = "bfloat16"  # the published storage dtype
    # Tensors of the class's state dict the published files leave out: a tied copy saved once (UMT5's
    # `encoder.embed_tokens.weight`, the same parameter as `shared.weight`).
    omit: tuple[str, ...] = ()


@dataclass(frozen=True)
class PublishedModel:
    """A real model as published: its repository id, the configs shipped in `published/<family>/`,
    and its weights."""
    family: str
    repo: str
    weights: tuple[Weights, ...]
    placeholders: tuple[str, ...] = ()   # files a stage's check asks for, written as stand-ins (README.md)
    # Component folders whose published configs are another published model's, unchanged: (family, folders).
    shared: tuple[str, tuple[str, ...]] = ("", ())

    @property
    def configs(self) -> Path:
        return PUBLISHED / self.family


# The Wan 2.1 diffusers repositories share their UMT5-XXL text encoder, tokenizer and video VAE, as published.
_WAN_VAE = Weights("vae", "diffusers", "AutoencoderKLWan", "diffusion_pytorch_model", dtype="float32")
_WAN_TEXT_ENCODER = Weights("text_encoder", "transformers", "UMT5EncoderModel", shards=5, dtype="float32",
                            omit=("encoder.embed_tokens.weight",))
_WAN_TOKENIZER = tuple(f"tokenizer/{f}" for f in ("special_tokens_map.json", "spiece.model", *TOKENIZER_FILES))

PUBLISHED_MODELS = {m.family: m for m in (
    PublishedModel("qwen3_omni", "Qwen/Qwen3-Omni-30B-A3B-Instruct",
                   (Weights("", "transformers", "Qwen3OmniMoeForConditionalGeneration", shards=15),),
                   (*TOKENIZER_FILES, PROCESSOR_CONFIG)),
    PublishedModel("qwen2_5_omni", "Qwen/Qwen2.5-Omni-7B",
                   (Weights("", "transformers", "Qwen2_5OmniForConditionalGeneration", shards=5),),
                   (*TOKENIZER_FILES, PROCESSOR_CONFIG, QWEN2_5_OMNI_SPEAKERS)),
    PublishedModel("sd3", "stabilityai/stable-diffusion-3.5-medium", (
        Weights("transformer", "diffusers", "SD3Transformer2DModel", "diffusion_pytorch_model"),
        Weights("vae", "diffusers", "AutoencoderKL", "diffusion_pytorch_model"),
        Weights("text_encoder", "transformers", "CLIPTextModelWithProjection", dtype="float16"),
        Weights("text_encoder_2", "transformers", "CLIPTextModelWithProjection", dtype="float16"),
        Weights("text_encoder_3", "transformers", "T5EncoderModel", shards=2, dtype="float16"),
    ), tuple(f"{t}/{f}" for t in ("tokenizer", "tokenizer_2", "tokenizer_3") for f in TOKENIZER_FILES)),
    PublishedModel("wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", (
        Weights("transformer", "diffusers", "WanTransformer3DModel", "diffusion_pytorch_model", shards=2,
                dtype="float32"),
        _WAN_VAE, _WAN_TEXT_ENCODER,
    ), _WAN_TOKENIZER),
    PublishedModel("wan_i2v", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", (
        Weights("transformer", "diffusers", "WanTransformer3DModel", "diffusion_pytorch_model", shards=14,
                dtype="float32"),
        _WAN_VAE, _WAN_TEXT_ENCODER,
        Weights("image_encoder", "transformers", "CLIPVisionModel"),
    ), _WAN_TOKENIZER, shared=("wan", ("scheduler", "text_encoder", "vae"))),
)}


@dataclass(frozen=True)
class HollowCheckpoint:
    directory: Path
    files: tuple[str, ...]   # the shards written, relative to `directory`
    tensors: int
    nbytes: int              # what the shards would hold (their apparent size)


def write_hollow(family: str, directory: str | os.PathLike) -> HollowCheckpoint:
    """Write the hollow layout of `family`'s published model into `directory` (created; files there are
    overwritten)."""
    model = PUBLISHED_MODELS.get(family)
    if model is None:
        raise KeyError(f'no published layout for "{family}" (known: {", ".join(PUBLISHED_MODELS)})')
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    _copy_tree(model.configs, root)
    other, subs = model.shared
    for sub in subs:
        _copy_tree(PUBLISHED / other / sub, root / sub)
    for name in model.placeholders:
        _write_placeholder(root / name)
    files: list[str] = []
    tensors = nbytes = 0
    for w in model.weights:
        folder = root / w.folder if w.folder else root
        layout = tensor_layout(w, folder)
        files += [f"{w.folder}/{f}" if w.folder else f for f in write_shards(folder, layout, w.stem, w.shards)]
        tensors += len(layout)
        nbytes += sum(_nbytes(dt, shape) for dt, shape in layout.values())
    return HollowCheckpoint(root, tuple(files), tensors, nbytes)


def _write_placeholder(file: Path) -> None:
    """A stand-in for a file the mapping check does not read (tokenizer, processor, speakers): present, so
    `models check` finds it, and marked as what it is."""
    file.parent.mkdir(parents=True, exist_ok=True)
    body: dict
    if file.name == "tokenizer.json":  # a one-word tokenizer the tokenizers library can open
        body = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                "pre_tokenizer": None, "post_processor": None, "decoder": None,
                "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"}}
    elif file.suffix == ".json":
        body = {"_hollow": PLACEHOLDER_NOTE}
    else:
        file.write_bytes(b"")
        return
    file.write_text(json.dumps(body, indent=2) + "\n")


def _copy_tree(src: Path, dst: Path) -> None:
    for path in sorted(src.rglob("*")):
        if path.is_file():
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


# ------------------------------------------------------------------ names and shapes from the model classes

def tensor_layout(weights: Weights, config_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{published tensor name: (safetensors dtype, shape)} of `weights.cls` built on the meta device from
    the config in `config_dir`, named as the library saves it (its weight conversions reverted)."""
    import torch

    dtype = getattr(torch, weights.dtype)
    if weights.library == "diffusers":
        import diffusers

        cls = getattr(diffusers, weights.cls)
        with torch.device("meta"):
            module = cls.from_config(cls.load_config(config_dir))
        state = {k: t.to(dtype) if t.is_floating_point() else t for k, t in module.state_dict().items()}
    else:
        import transformers
        from transformers.core_model_loading import revert_weight_conversion

        cls = getattr(transformers, weights.cls)
        config = transformers.AutoConfig.from_pretrained(config_dir)
        with torch.device("meta"):
            module = cls._from_config(config, dtype=dtype)  # modules the class keeps in float32 stay so
        state = revert_weight_conversion(module, module.state_dict())
    return {k: (_SAFETENSORS_DTYPE[str(t.dtype).removeprefix("torch.")], tuple(t.shape)) for k, t in state.items()
            if k not in weights.omit}


def _nbytes(dtype: str, shape: Iterable[int]) -> int:
    n = _DTYPE_BITS[dtype]
    for d in shape:
        n *= d
    return (n + 7) // 8


# ------------------------------------------------------------------ sparse safetensors shards

def write_shards(folder: Path, layout: dict[str, tuple[str, tuple[int, ...]]], stem: str = "model",
                 shards: int = 1) -> list[str]:
    """Write `layout` as `shards` sparse safetensors files (and their index when more than one), in
    name order, each holding about the same bytes. Returns the shard names."""
    folder.mkdir(parents=True, exist_ok=True)
    items = sorted(layout.items(), key=lambda kv: _natural(kv[0]))
    sizes = [_nbytes(dt, shape) for _, (dt, shape) in items]
    total = sum(sizes)
    groups: list[list[int]] = [[] for _ in range(shards)]
    running = 0
    for i, n in enumerate(sizes):
        groups[min(running * shards // max(total, 1), shards - 1)].append(i)  # where its first byte falls
        running += n
    names = ([f"{stem}.safetensors"] if shards == 1 else
             [f"{stem}-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)])
    weight_map = {}
    for name, members in zip(names, groups):
        write_sparse_safetensors(folder / name, {items[i][0]: items[i][1] for i in members})
        weight_map.update({items[i][0]: name for i in members})
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def write_sparse_safetensors(file: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """A safetensors file whose header lists `tensors` {name: (dtype, shape)} and whose data is a hole:
    the file is truncated to its full size, nothing is written past the header. Returns its size."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    size = 8 + len(raw) + offset
    with open(file, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(size)
    return size


def _natural(key: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]
