"""Qwen3-Omni stages on the checkpoint as published: each stage reads its own part of the one set of
shards (files and tensor names counted by the checkpoint reader), and a broken checkpoint is refused
with one line naming the file or key."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from omnistage.checkpoints.shards import CheckpointError, ShardedCheckpoint
from stage_service.engines.qwen3_omni.steps import CODE2WAV, TALKER, THINKER, THINKER_EMBED, Code2Wav, Talker, Thinker

from ..harness import example, stage_servers_fixture

PIPELINE = example("qwen3-omni-tiny")
MODEL = "qwen3-omni-tiny"
PREFIX = {"thinker": THINKER, "talker": TALKER, "code2wav": CODE2WAV}
TTS_ROWS = 3  # the Talker reads the Thinker's embeddings of tts_bos, tts_eos and tts_pad


stages = stage_servers_fixture(PIPELINE, tuple(PREFIX))


def header_bytes(file: Path) -> int:
    with open(file, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.mark.parametrize("component", list(PREFIX))
def test_a_stage_reads_only_its_component(stages, model_dir, component):
    index = ShardedCheckpoint(model_dir / MODEL)  # where each tensor lies (the index only)
    read = stages[component].engine.checkpoint.stats
    prefix = PREFIX[component]
    borrowed = {THINKER_EMBED} if component == "talker" else set()
    wanted = set(index.keys(prefix)) | borrowed
    assert read.keys == wanted
    holding = {index.weight_map[k] for k in wanted}
    assert read.files == {f.name for f in holding}
    only_others = {f.name for f in index.files()} - read.files
    if component != "thinker":  # the Thinker's tensors are in every shard but the code2wav one
        assert only_others, "the checkpoint should have shards holding only other parts"
    # Bytes: the component's tensors, the borrowed rows alone, and the headers of the shards opened.
    embed = index.info(THINKER_EMBED)
    rows = TTS_ROWS * embed.nbytes // embed.shape[0] if borrowed else 0
    assert read.bytes == index.nbytes(prefix) + rows + sum(header_bytes(f) for f in holding)
    assert read.bytes / index.nbytes(prefix) <= 1.05


# ------------------------------------------------------------------ broken checkpoints

def linked_copy(src: Path, dst: Path) -> Path:
    """The checkpoint at `dst`: small files copied, shards linked (`own` one before changing it)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    return dst


def own(path: Path) -> Path:
    """A private copy of a linked shard, so changing it never touches the shared models."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    return path


def shard_of(root: Path, key: str) -> Path:
    return root / json.loads((root / "model.safetensors.index.json").read_text())["weight_map"][key]


def edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


KEY = "talker.codec_head.weight"  # a Talker tensor of its own (no weight conversion applies to it)


def truncate_shard(root):
    shard = own(shard_of(root, KEY))
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    return shard.name


def index_names_missing_shard(root):
    missing = "model-00099-of-00099.safetensors"
    edit_json(root / "model.safetensors.index.json", lambda d: d["weight_map"].__setitem__(KEY, missing))
    return missing


def tensor_gone_from_index(root):
    edit_json(root / "model.safetensors.index.json", lambda d: d["weight_map"].pop(KEY))
    return KEY


def tensor_gone_from_shard(root):
    shard = shard_of(root, KEY)
    tensors = load_file(str(shard))
    del tensors[KEY]
    shard.unlink()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return KEY


def no_talker_config(root):
    edit_json(root / "config.json", lambda d: d.pop("talker_config"))
    return "talker_config"


def accept_layer_beyond_the_thinker(root):
    edit_json(root / "config.json", lambda d: d["talker_config"].__setitem__("accept_hidden_layer", 7))
    return "talker_config.accept_hidden_layer is 7"


@pytest.mark.parametrize("loader,corrupt,named_file", [
    (Talker, truncate_shard, None),
    (Talker, index_names_missing_shard, "model.safetensors.index.json"),
    (Talker, tensor_gone_from_index, None),
    (Talker, tensor_gone_from_shard, None),
    (Thinker, no_talker_config, "config.json"),
    (Talker, no_talker_config, "config.json"),
    (Thinker, accept_layer_beyond_the_thinker, "config.json"),
])
def test_a_broken_checkpoint_is_refused_naming_the_file_or_key(model_dir, tmp_path, loader, corrupt, named_file):
    root = linked_copy(model_dir / MODEL, tmp_path / MODEL)
    named = corrupt(root)
    with pytest.raises(CheckpointError) as e:
        loader(root)
    message = str(e.value)
    assert "\n" not in message and named in message
    if named_file:
        assert re.search(rf"{re.escape(str(root / named_file))}\b", message)


def test_the_code2wav_stage_never_needs_the_other_parts(model_dir, tmp_path):
    """Only its own shard is there: the Thinker's and Talker's shards are all gone."""
    root = linked_copy(model_dir / MODEL, tmp_path / MODEL)
    index = ShardedCheckpoint(root)
    keep = {index.weight_map[k] for k in index.keys(CODE2WAV)}
    for shard in index.files():
        if shard not in keep:
            shard.unlink()
    c2w = Code2Wav(root)
    assert c2w.checkpoint.stats.files == {f.name for f in keep}
