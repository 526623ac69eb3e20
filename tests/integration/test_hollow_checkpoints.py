"""The real models at real size, without their weights: the hollow layouts of Qwen3-Omni-30B-A3B-Instruct,
Qwen2.5-Omni-7B, Stable Diffusion 3.5 Medium, Wan2.1-T2V-1.3B and Wan2.1-I2V-14B-480P (`omnistage models hollow`)
pass `omnistage models check` with their real bytes per stage, and every stage's loader maps every tensor of its
component onto its modules on the meta device, reading headers only. Broken copies are refused in one line."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from omnistage.checkpoints.check import StageCheckError, check_pipeline, check_stage
from omnistage.checkpoints.defaults import with_model_limits
from omnistage.checkpoints.fit import misfit
from omnistage.checkpoints.hollow import PUBLISHED_MODELS, write_sparse_safetensors
from omnistage.checkpoints.plan import plan_pipeline
from omnistage.checkpoints.shards import DTYPES, ShardedCheckpoint
from omnistage.contract.params import InvalidRequest, resolve
from omnistage.local.gpu_placement import assign_gpus
from omnistage.v1 import common_pb2
from stage_service.engines.mapping import map_stage

from ..harness import example, hollow_store

GiB = 1 << 30
# The examples' model names: the hollow layouts stand in for their tiny models; Wan's are the real-size
# examples' own (examples/wan2.1-t2v-1.3b.yaml, examples/wan2.1-i2v-14b-480p.yaml).
MODEL_NAMES = {"qwen3_omni": "qwen3-omni-tiny", "qwen2_5_omni": "qwen2.5-omni-tiny", "sd3": "sd3-tiny",
               "wan": "Wan2.1-T2V-1.3B-Diffusers", "wan_i2v": "Wan2.1-I2V-14B-480P-Diffusers"}
# Weights per stage, GiB: the published sizes (Qwen3-Omni 70.5 GB, Qwen2.5-Omni 22.4 GB, SD3.5 Medium's
# 2.5 B-parameter MMDiT in bfloat16, its text encoders in float16; Wan2.1-T2V-1.3B in float32: UMT5-XXL's
# 5.7 B parameters, the 1.42 B DiT, the 127 M VAE; Wan2.1-I2V-14B-480P: the same UMT5-XXL and VAE, the 16.4 B
# DiT in float32 (65.6 GB: 61.1 GiB, published as 14 shards of about 4.85 GB), and the image encoder's stage
# reading CLIP ViT-H/14's 632 M parameters in bfloat16 (1.26 GB, as published) beside the whole VAE file).
STAGE_GIB = {
    "qwen3-omni-tiny": {"thinker": (58, 61), "talker": (6, 6.5), "code2wav": (0.3, 0.5)},
    "qwen3-omni-encoders-tiny": {"encoder": (2.0, 2.5), "thinker": (58, 61)},
    "qwen2.5-omni-tiny": {"thinker": (16, 17.5), "talker": (2.2, 2.6), "token2wav": (1.5, 1.8)},
    "sd3-tiny": {"text-encoder": (10, 11), "denoise": (4.4, 4.8), "vae-decode": (0.1, 0.2)},
    "wan2.1-t2v-1.3b": {"text-encoder": (21, 21.5), "denoise": (5.2, 5.4), "vae-decode": (0.45, 0.5)},
    "wan2.1-i2v-14b-480p": {"text-encoder": (21, 21.5), "image-encoder": (1.6, 1.7), "denoise": (60.5, 61.5),
                            "vae-decode": (0.45, 0.5)},
}
STAGES = [(family, component) for family, components in (
    ("qwen3_omni", ("encoder", "thinker", "talker", "code2wav")),
    ("qwen2_5_omni", ("encoder", "thinker", "talker", "token2wav")),
    ("sd3", ("text_encoder", "transformer", "vae")),
    ("wan", ("text_encoder", "transformer", "vae")),
    ("wan_i2v", ("text_encoder", "image_encoder", "transformer", "vae"))) for component in components]


@pytest.fixture(scope="module")
def hollow_root(tmp_path_factory) -> Path:
    return hollow_store(tmp_path_factory.mktemp("hollow"), MODEL_NAMES.items())


@pytest.fixture
def no_data_read(monkeypatch):
    """Any read of tensor data fails the test: the checks read headers and configs only."""
    def refuse(self, key, *args):
        raise AssertionError(f"read the data of {key}")
    monkeypatch.setattr(ShardedCheckpoint, "_read", refuse)


def _disk_bytes(root: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in root.rglob("*") if f.is_file())


def test_hollow_layouts_are_the_published_size_on_no_disk(hollow_root):
    for family, name in MODEL_NAMES.items():
        root = hollow_root / name
        shards = sorted(root.rglob("*.safetensors"))
        assert sum(f.stat().st_size for f in shards) > 5 * GiB
        assert _disk_bytes(root) < 64 << 20, name  # headers and configs only
        for w in PUBLISHED_MODELS[family].weights:
            folder = root / w.folder
            assert len(list(folder.glob(f"{w.stem}*.safetensors"))) == w.shards
    index = json.loads((hollow_root / "qwen3-omni-tiny" / "model.safetensors.index.json").read_text())
    assert "thinker.model.layers.47.mlp.experts.127.down_proj.weight" in index["weight_map"]  # as published
    # Wan's tensor counts as published (published/README.md): the DiT's 825; UMT5's 242, its embedding saved
    # once as `shared.weight` (the encoder's copy is the same parameter); the VAE's decoder 108 of its 194.
    wan = hollow_root / MODEL_NAMES["wan"]
    dit = json.loads((wan / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    umt5 = json.loads((wan / "text_encoder" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(dit["weight_map"]) == 825
    assert len(umt5) == 242 and "shared.weight" in umt5 and "encoder.embed_tokens.weight" not in umt5
    vae = ShardedCheckpoint(wan / "vae", "diffusion_pytorch_model").keys()
    assert len([k for k in vae if k.startswith(("decoder.", "post_quant_conv."))]) == 108
    # The image-to-video DiT: the CLIP embeddings' projection (1280 -> 5120) and each block's own image
    # keys / values beside the text's, 36 channels into its patch embedding.
    i2v = ShardedCheckpoint(hollow_root / MODEL_NAMES["wan_i2v"] / "transformer", "diffusion_pytorch_model")
    assert i2v.info("condition_embedder.image_embedder.ff.net.2.weight").shape == (5120, 1280)
    assert i2v.info("blocks.39.attn2.add_k_proj.weight").shape == (5120, 5120)
    assert i2v.info("patch_embedding.weight").shape == (5120, 36, 1, 2, 2)


@pytest.mark.parametrize("name", sorted(STAGE_GIB))
def test_models_check_passes_with_real_bytes_per_stage(hollow_root, no_data_read, name):
    plans, errors = check_pipeline(example(name), hollow_root)
    assert errors == []
    sizes = {p.stage: p.weight_bytes / GiB for p in plans}
    for stage, (low, high) in STAGE_GIB[name].items():
        assert low <= sizes[stage] <= high, (stage, sizes[stage])


@pytest.mark.parametrize("family,component", STAGES)
def test_every_stage_maps_tensor_for_tensor(hollow_root, no_data_read, family, component):
    mappings = map_stage(family, component, hollow_root / MODEL_NAMES[family])
    assert mappings
    for m in mappings:
        assert m.tensors > 0
        assert (m.unmapped, m.missing, m.mismatched) == ((), (), ()), m.describe()


@pytest.mark.parametrize("name", ["wan2.1-t2v-1.3b", "wan2.1-i2v-14b-480p"])
def test_the_wan_examples_serve_480p_videos_of_81_frames(hollow_root, name):
    pipeline, _ = with_model_limits(example(name), hollow_root)
    limits = pipeline.limits
    assert (limits.default_width, limits.default_height, limits.default_inference_steps) == (832, 480, 50)  # Wan's
    plain = resolve(common_pb2.GenerationParams(prompt="a red fox in snow"), limits)
    assert (plain.width, plain.height, plain.num_frames, plain.fps, plain.num_inference_steps) == (832, 480, 81, 16, 50)
    p = common_pb2.GenerationParams(prompt="a red fox in snow")
    p.image.width, p.image.height = 832, 480
    wide = resolve(p, limits)
    assert (wide.width, wide.height, wide.num_frames) == (832, 480, 81)
    p.video.num_frames = 85
    with pytest.raises(InvalidRequest) as e:
        resolve(p, limits)
    assert e.value.field == "params.video.num_frames"
    p.video.num_frames, p.image.width = 81, 848
    with pytest.raises(InvalidRequest) as e:
        resolve(p, limits)
    assert e.value.field == "params.image.width"


def test_the_wan_example_has_a_memory_plan(hollow_root, no_data_read):
    """`models check --plan` and `serve` (before it starts anything on GPUs) plan every stage of a video
    pipeline: its weights as the stage runs them (bfloat16, the VAE float32), its activations an estimate."""
    plans, errors = plan_pipeline(example("wan2.1-t2v-1.3b"), hollow_root)
    assert errors == []
    weights = {p.stage: p.weights_bytes / GiB for p in plans}
    assert 10.5 <= weights["text-encoder"] <= 10.8 and 2.6 <= weights["denoise"] <= 2.7  # float32 -> bfloat16
    assert 0.45 <= weights["vae-decode"] <= 0.5 and all(p.activation_bytes > 0 for p in plans)


def test_the_wan_i2v_example_fits_two_80_gib_gpus(hollow_root, no_data_read):
    """The 14B DiT in bfloat16 (half its float32 bytes) alone on one GPU; the text encoder in bfloat16, the image
    encoder (CLIP + the VAE) and the VAE decoder in float32 sharing the other; the planner finds every stage
    fits its share of an 80 GiB GPU and that `omnistage serve` packs them so, and refuses the DiT 0.4 of one."""
    pipeline = example("wan2.1-i2v-14b-480p")
    plans, errors = plan_pipeline(pipeline, hollow_root)
    assert errors == []
    weights = {p.stage: p.weights_bytes / GiB for p in plans}
    assert 30.4 <= weights["denoise"] <= 30.7 and 10.5 <= weights["text-encoder"] <= 10.8
    assert 2.7 <= weights["image-encoder"] <= 2.9 and 0.45 <= weights["vae-decode"] <= 0.5  # float32: 2.35 + 0.47
    deployment = pipeline.deployment.stages
    placed = assign_gpus({s.name: deployment[s.name] for s in pipeline.stages}, ["0", "1"])
    assert placed[("denoise", 0)] == ("0",) and {placed[(s, 0)] for s in ("text-encoder", "image-encoder",
                                                                          "vae-decode")} == {("1",)}
    for p in plans:
        assert misfit(p, pipeline.stage(p.stage), deployment[p.stage], 80 * GiB) is None, p.stage
    denoise = next(p for p in plans if p.stage == "denoise")
    small = replace(deployment["denoise"], gpu_memory_fraction=0.4)  # 32 GiB: not the weights and a step
    refusal = misfit(denoise, pipeline.stage("denoise"), small, 80 * GiB)
    assert refusal is not None and refusal.startswith("denoise needs 33.")


# ------------------------------------------------------------------ bad input

def _linked_copy(src: Path, dst: Path) -> Path:
    """A copy whose shards are links to `src`'s (a hollow shard copied would be written out in full)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            os.symlink(f, dst / f.name)
        else:
            shutil.copyfile(f, dst / f.name)
    return dst


def test_shapes_that_do_not_match_the_config_are_named(hollow_root, tmp_path, no_data_read):
    root = _linked_copy(hollow_root / "qwen3-omni-tiny", tmp_path / "qwen3-omni-tiny")
    config = json.loads((root / "config.json").read_text())
    config["code2wav_config"]["hidden_size"] = 512  # the shards hold 1024-wide tensors
    (root / "config.json").write_text(json.dumps(config))
    (m,) = map_stage("qwen3_omni", "code2wav", root)
    assert m.mismatched and not m.unmapped
    name, why = m.mismatched[0]
    assert name.startswith("code2wav.") and "1024" in why and "512" in why
    line = m.describe()
    assert "\n" not in line and f"{len(m.mismatched)} shape mismatches" in line


def test_an_index_naming_tensors_no_stage_reads_is_refused(hollow_root, tmp_path):
    root = _linked_copy(hollow_root / "qwen2.5-omni-tiny", tmp_path / "qwen2.5-omni-tiny")
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["speech_decoder.proj.weight"] = "model-00001-of-00005.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    _, errors = check_pipeline(example("qwen2.5-omni-tiny"), tmp_path)
    assert len(errors) == 3
    for e in errors:
        assert "model.safetensors.index.json" in str(e) and "1 tensor under no part a stage reads" in str(e)
        assert "speech_decoder.proj.weight" in str(e) and "\n" not in str(e)


def _with_dtype(model_dir: Path, tmp_path: Path, key: str, dtype: str) -> Path:
    """A copy of a tiny model whose shard holding `key` declares `dtype` for it (sparse, no data)."""
    root = tmp_path / "qwen3-omni-tiny"
    shutil.copytree(model_dir / "qwen3-omni-tiny", root)
    info = ShardedCheckpoint(root).info(key)
    header = {k: (i.dtype, i.shape) for k, i in ShardedCheckpoint(root)._header(info.file).items()}
    header[key] = (dtype, info.shape)
    write_sparse_safetensors(info.file, header)
    return root


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "U16", "U32", "U64", "F8_E8M0"])
def test_low_precision_and_unsigned_dtypes_are_read(model_dir, tmp_path, dtype):
    key = "code2wav.code_embedding.weight"
    root = _with_dtype(model_dir, tmp_path, key, dtype)
    _, errors = check_pipeline(example("qwen3-omni-tiny"), tmp_path)
    assert errors == []
    assert ShardedCheckpoint(root).read(key).dtype == DTYPES[dtype]


def test_a_dtype_omnistage_cannot_read_is_refused_by_name(model_dir, tmp_path):
    key = "code2wav.code_embedding.weight"
    _with_dtype(model_dir, tmp_path, key, "F4")
    pipeline = example("qwen3-omni-tiny")
    with pytest.raises(StageCheckError) as e:
        check_stage(pipeline, pipeline.stage("code2wav"), tmp_path)
    msg = str(e.value)
    assert "(code2wav)" in msg and key in msg and "dtype F4" in msg and "cannot read" in msg and "\n" not in msg
    assert check_stage(pipeline, pipeline.stage("thinker"), tmp_path).weight_bytes > 0  # other parts still serve


def test_the_command_writes_a_layout_or_names_the_families(tmp_path, capsys):
    from omnistage.local.cli import main

    assert main(["models", "hollow", "sd3", str(tmp_path / "sd3")]) == 0
    out = capsys.readouterr().out
    assert "stabilityai/stable-diffusion-3.5-medium" in out and "no data written" in out
    assert (tmp_path / "sd3" / "model_index.json").is_file()
    assert main(["models", "hollow", "flux", str(tmp_path / "flux")]) == 2
    assert "known: qwen3_omni, qwen2_5_omni, sd3, wan, wan_i2v" in capsys.readouterr().err
