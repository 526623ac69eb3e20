"""The Wan family's declarations and what is read from its checkpoint without loading a model: the family
table, the VAE's compression, the limits taken from the published pipeline, what a request may carry."""

from __future__ import annotations

import dataclasses

from omnistage.api import accepted_inputs, one_of_each_input
from omnistage.checkpoints.components import allowed
from omnistage.checkpoints.defaults import with_model_limits
from omnistage.families import family_of
from stage_service.engines.diffusers.engines import vae_scales
from stage_service.engines.diffusers.layout import PipelineDir

from ..harness import example

MODEL = "wan-t2v-tiny"


def test_a_wan_pipeline_is_the_wan_family_and_its_classes_load_without_remote_code(model_dir):
    family = family_of("WanPipeline")
    assert family is not None and family.name == "wan"
    assert family.components == ("text_encoder", "transformer", "vae")
    pipe = PipelineDir(model_dir / MODEL / "transformer")
    for component in ("text_encoder", "tokenizer", "transformer", "vae", "scheduler"):
        assert allowed(*pipe.index[component]), component


def test_the_vae_compresses_8x_in_space_and_4x_in_time_and_an_image_vae_not_in_time(model_dir):
    assert vae_scales(PipelineDir(model_dir / MODEL / "transformer")) == (8, 4)
    assert vae_scales(PipelineDir(model_dir / "sd3-tiny" / "transformer")) == (2, 1)


def test_limits_left_open_take_wan_pipelines_default_steps_and_the_side_fallback(model_dir):
    pipeline = example(MODEL)
    open_limits = dataclasses.replace(pipeline, limits=dataclasses.replace(
        pipeline.limits, default_image_side=0, default_inference_steps=0))
    filled, notes = with_model_limits(open_limits, model_dir)
    assert filled.limits.default_inference_steps == 50  # WanPipeline.__call__'s own default
    assert filled.limits.default_image_side == 0        # no square native side: resolve()'s fallback applies
    assert not any("cannot read" in n for n in notes)


def test_a_text_to_video_pipeline_accepts_text_only():
    assert accepted_inputs(example(MODEL)) == {"text"}


def test_a_published_vae_config_without_its_scale_factors_takes_the_classs_defaults(model_dir, tmp_path):
    """Wan2.1's published vae/config.json predates `scale_factor_spatial` / `scale_factor_temporal`: diffusers
    fills in AutoencoderKLWan's defaults (8, 4), and so does the denoise stage."""
    import json
    import shutil

    root = tmp_path / MODEL
    shutil.copytree(model_dir / MODEL, root)
    cfg_file = root / "vae" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["scale_factor_spatial"], cfg["scale_factor_temporal"]
    cfg_file.write_text(json.dumps(cfg))
    assert vae_scales(PipelineDir(root / "transformer")) == (8, 4)


def test_an_image_to_video_pipeline_is_its_own_family_reading_one_image_and_loading_without_remote_code(model_dir):
    family = family_of("WanImageToVideoPipeline")
    assert family is not None and family.name == "wan_i2v"
    assert family.components == ("text_encoder", "image_encoder", "transformer", "vae")
    pipe = PipelineDir(model_dir / "wan-i2v-tiny" / "transformer")
    for component in ("text_encoder", "tokenizer", "image_encoder", "image_processor", "transformer", "vae",
                      "scheduler"):
        assert allowed(*pipe.index[component]), component
    pipeline = example("wan-i2v-tiny")
    assert accepted_inputs(pipeline) == {"text", "image"}
    assert one_of_each_input(pipeline) == {"image": "image-encoder"}
    assert one_of_each_input(example(MODEL)) == {}


def test_first_last_frame_and_two_expert_image_to_video_transformers_are_refused_by_name():
    from stage_service.engines.diffusers.denoisers import wan_unserved

    index = {"_class_name": "WanImageToVideoPipeline", "transformer_2": [None, None]}
    assert wan_unserved(index, {"image_dim": 1280}) == ""
    assert "FLF2V" in wan_unserved(index, {"image_dim": 1280, "pos_embed_seq_len": 514})
    assert "two-expert" in wan_unserved({**index, "transformer_2": ["diffusers", "WanTransformer3DModel"]}, {})


def test_the_first_frame_mask_covers_the_reference_frame_and_none_after_it():
    from stage_service.engines.diffusers.image_condition import first_frame_mask

    mask = first_frame_mask(num_frames=9, temporal=4, latent_h=2, latent_w=3)
    assert mask.shape == (1, 4, 3, 2, 3)  # 4 frames per latent frame as channels, 3 latent frames
    assert mask[:, :, 0].eq(1).all() and mask[:, :, 1:].eq(0).all()
