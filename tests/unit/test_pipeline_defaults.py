"""What a diffusion request that leaves its guidance or size unset gets: the published pipeline's own defaults,
taken from its family when the pipeline file leaves the limit open (WanPipeline: guidance 5.0 and 832 x 480;
StableDiffusion3Pipeline: 7.0; StableDiffusionPipeline: 7.5 at its checkpoint's square side), what the file
sets kept as written, and the fallbacks (7.5, a 512 square) where neither says."""

from __future__ import annotations

import pytest
import yaml

from omnistage.api import Limits, parse_pipeline, validate
from omnistage.checkpoints.defaults import with_model_limits
from omnistage.client import build_request
from omnistage.contract.params import fill_resolved, resolve

from ..conftest import EXAMPLES
from ..harness import example


def params(**kw):
    return build_request(**{"prompt": "a cat", **kw}).params


def limits_edit(drop=(), **kw):
    def edit(doc):
        limits = doc["spec"]["topology"].setdefault("limits", {})
        for key in drop:
            limits.pop(key, None)
        limits.update(kw)
    return edit


@pytest.mark.parametrize("name, guidance", [("wan-t2v-tiny", 5.0), ("sd3-tiny", 7.0), ("text-to-image-tiny", 7.5)],
                         ids=["WanPipeline", "StableDiffusion3Pipeline", "StableDiffusionPipeline"])
def test_the_default_guidance_is_the_published_pipelines(model_dir, name, guidance):
    filled, notes = with_model_limits(example(name), model_dir)
    assert resolve(params(), filled.limits).guidance_scale == guidance
    assert filled.limits.default_guidance_scale == guidance
    assert resolve(params(guidance_scale=1.0), filled.limits).guidance_scale == 1.0  # a request's own wins
    assert any(n.startswith(f"limits.default_guidance_scale = {guidance}") for n in notes)


def test_a_wan_video_with_no_size_is_wan_pipelines_832_by_480(model_dir):
    wan = example("wan-t2v-tiny", limits_edit(drop=("defaultImageSide",), maxImageSide=832))
    filled, notes = with_model_limits(wan, model_dir)
    p = resolve(params(), filled.limits)
    assert (p.width, p.height) == (832, 480)
    assert (filled.limits.default_width, filled.limits.default_height) == (832, 480)
    assert (resolve(params(width=64), filled.limits).width, resolve(params(height=64), filled.limits).height) == \
        (64, 64)
    assert resolve(fill_resolved(params(), p), filled.limits) == p  # the stages are sent the same size


def test_the_files_own_values_win(model_dir):
    # the tiny example's square side (the tiny model's size) and a guidance the file sets
    wan = example("wan-t2v-tiny", limits_edit(defaultGuidanceScale=3.5))
    filled, _ = with_model_limits(wan, model_dir)
    assert (filled.limits.default_width, filled.limits.default_height, filled.limits.default_image_side) == (0, 0, 32)
    p = resolve(params(), filled.limits)
    assert (p.width, p.height, p.guidance_scale) == (32, 32, 3.5)
    sized = example("wan-t2v-tiny", limits_edit(drop=("defaultImageSide",), defaultWidth=64, defaultHeight=48))
    p = resolve(params(), with_model_limits(sized, model_dir)[0].limits)
    assert (p.width, p.height) == (64, 48)


def test_a_family_size_past_max_image_side_is_not_taken_and_the_note_says_why(model_dir):
    wan = example("wan-t2v-tiny", limits_edit(drop=("defaultImageSide",)))  # maxImageSide 256
    filled, notes = with_model_limits(wan, model_dir)
    assert (filled.limits.default_width, filled.limits.default_height) == (0, 0)
    assert any("832x480" in n and "maxImageSide 256" in n for n in notes)
    p = resolve(params(), filled.limits)
    assert (p.width, p.height) == (256, 256)  # the square fallback within maxImageSide


def test_with_nothing_said_the_fallbacks_are_todays():
    p = resolve(params(), Limits())
    assert (p.width, p.height, p.guidance_scale) == (512, 512, 7.5)


@pytest.mark.parametrize("kw, message", [
    ({"defaultWidth": 1040}, "defaultWidth"),
    ({"defaultHeight": 1040}, "defaultHeight"),
    ({"defaultGuidanceScale": 101}, "defaultGuidanceScale"),
])
def test_default_sizes_and_guidance_that_cannot_hold_are_refused(kw, message):
    doc = yaml.safe_load((EXAMPLES / "wan-t2v-tiny.yaml").read_text())
    doc["spec"]["topology"]["limits"].update(kw, maxImageSide=1024)
    errors = validate(doc)
    assert any(message in e for e in map(str, errors)), errors
    with pytest.raises(Exception, match=message):
        parse_pipeline(doc)
