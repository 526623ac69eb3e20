"""The shard reader: only the asked tensors are read, every byte counted, broken shards named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from omnistage.checkpoints.shards import CheckpointError, ShardedCheckpoint


@pytest.fixture
def sharded(tmp_path):
    """Two parts in two shards, with the index published checkpoints carry."""
    g = torch.Generator().manual_seed(0)
    a = {"a.w": torch.randn(8, 4, generator=g), "a.b": torch.arange(5, dtype=torch.int64)}
    b = {"b.w": torch.randn(16, 16, generator=g).to(torch.bfloat16)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in a},
                                            **{k: "model-00002-of-00002.safetensors" for k in b}}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path, {**a, **b}


def test_reads_one_part_only_and_counts_its_bytes(sharded):
    root, tensors = sharded
    ckpt = ShardedCheckpoint(root)
    sd = ckpt.state_dict("a.")
    assert set(sd) == {"w", "b"} and ckpt.stats.keys == set()        # nothing read yet
    assert torch.equal(sd["w"][...], tensors["a.w"]) and torch.equal(sd["b"][...], tensors["a.b"])
    assert ckpt.stats.files == {"model-00001-of-00002.safetensors"}   # the other shard never opened
    assert ckpt.stats.keys == {"a.w", "a.b"}
    header = (root / "model-00001-of-00002.safetensors").stat().st_size - ckpt.nbytes("a.")
    assert ckpt.stats.bytes == ckpt.nbytes("a.") + header == 8 * 4 * 4 + 5 * 8 + header


def test_rows_reads_only_those_rows(sharded):
    root, tensors = sharded
    ckpt = ShardedCheckpoint(root)
    ckpt.info("b.w")
    before = ckpt.stats.bytes
    rows = ckpt.rows("b.w", [3, 0, 15])
    assert torch.equal(rows, tensors["b.w"][[3, 0, 15]])
    assert ckpt.stats.bytes - before == 3 * 16 * 2


def test_lazy_tensor_speaks_the_slice_protocol(sharded):
    root, _ = sharded
    t = ShardedCheckpoint(root).state_dict("b.")["w"]
    assert t.get_dtype() == "BF16" and t.get_shape() == [16, 16] and t.dtype == torch.bfloat16


def test_broken_checkpoints_are_named(sharded):
    root, _ = sharded
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        ShardedCheckpoint(root / "nothing-here")
    with pytest.raises(CheckpointError, match=r"no tensor c\.w"):
        ShardedCheckpoint(root).info("c.w")
    shard = root / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    ckpt = ShardedCheckpoint(root)
    ckpt.verify("a.")                       # the intact part still verifies
    with pytest.raises(CheckpointError, match=f"{shard}: truncated"):
        ckpt.verify("b.")
    shard.write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="no safetensors header"):
        ShardedCheckpoint(root).verify("b.")
    (root / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        ShardedCheckpoint(root)


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.safetensors", "sub/model.safetensors", "..", ""])
def test_an_index_may_place_tensors_only_in_files_of_its_own_folder(tmp_path, name):
    """An index naming an absolute path or one outside the checkpoint would read weights from anywhere."""
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(CheckpointError, match=r"w is placed in .*not a file name in the checkpoint's folder"):
        ShardedCheckpoint(tmp_path)
