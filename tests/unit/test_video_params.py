"""Video requests and pipelines: frame count and rate resolved against the limits (a count the video VAE
cannot make refused with the nearest it can), the limits' own checks, and a `video` output in the spec."""

from __future__ import annotations

import copy

import pytest
import yaml

from omnistage.api import Limits, validate
from omnistage.client import build_request
from omnistage.contract.params import InvalidRequest, fill_resolved, nearest_frames, resolve

from ..conftest import EXAMPLES

WAN = yaml.safe_load((EXAMPLES / "wan-t2v-tiny.yaml").read_text())


def params(**kw):
    return build_request(**{"prompt": "a cat", **kw}).params


def test_frames_and_fps_default_to_the_pipelines_and_pass_through_when_given():
    p = resolve(params(), Limits())
    assert (p.num_frames, p.fps) == (81, 16)              # WanPipeline's 81 frames, Wan's 16 fps
    assert (resolve(params(), Limits(default_frames=17, default_fps=24)).num_frames,
            resolve(params(), Limits(default_frames=17, default_fps=24)).fps) == (17, 24)
    given = resolve(params(num_frames=33, fps=8), Limits())
    assert (given.num_frames, given.fps) == (33, 8)
    # maxFrames below the pipeline's own default: the largest count the VAE makes within it
    assert resolve(params(), Limits(max_frames=50)).num_frames == 49


@pytest.mark.parametrize("frames, nearest", [(50, "49 or 53"), (48, "49 or 45"), (2, "1 or 5"), (80, "81 or 77")])
def test_a_frame_count_the_video_vae_cannot_make_is_refused_naming_the_nearest_it_can(frames, nearest):
    with pytest.raises(InvalidRequest) as e:
        resolve(params(num_frames=frames), Limits())
    assert e.value.field == "params.video.num_frames"
    assert "4k + 1 frames" in str(e.value) and f": {nearest}, got {frames}" in str(e.value)


def test_the_nearest_counts_stay_within_max_frames():
    assert nearest_frames(80, 79) == [77]
    with pytest.raises(InvalidRequest, match=r": 77, got 78"):
        resolve(params(num_frames=78), Limits(max_frames=79))


@pytest.mark.parametrize("kw, field, message", [
    ({"num_frames": 85}, "params.video.num_frames", "must be between 1 and 81, got 85"),
    ({"fps": 61}, "params.video.fps", "must be between 1 and 60, got 61"),
])
def test_frames_and_fps_over_the_limits_are_refused_by_name(kw, field, message):
    with pytest.raises(InvalidRequest) as e:
        resolve(params(**kw), Limits())
    assert e.value.field == field and message in str(e.value)


def test_the_resolved_frames_and_fps_are_what_the_stages_are_sent():
    limits = Limits(default_frames=9, default_fps=12)
    resolved = resolve(params(), limits)
    sent = fill_resolved(params(), resolved)
    assert (sent.video.num_frames, sent.video.fps) == (9, 12)
    other = Limits(default_frames=21, default_fps=30)  # a stage resolving again applies no defaults of its own
    assert resolve(sent, other) == resolved


def variant(edit) -> dict:
    doc = copy.deepcopy(WAN)
    edit(doc)
    return doc


def limits(**kw):
    def edit(doc):
        doc["spec"]["topology"]["limits"].update(kw)
    return edit


def test_the_wan_example_outputs_video_from_its_vae_stage():
    assert validate(WAN) == []


@pytest.mark.parametrize("kw, message", [
    ({"defaultFrames": 50}, "spec.topology.limits.defaultFrames: must be 4k + 1 frames (what the video VAE "
                            "makes), got 50"),
    ({"defaultFrames": 85, "maxFrames": 81}, "spec.topology.limits.defaultFrames: must be <= maxFrames (81), got 85"),
    ({"defaultFps": 30, "maxFps": 24}, "spec.topology.limits.defaultFps: must be <= maxFps (24), got 30"),
    ({"maxFps": 0}, "spec.topology.limits.maxFps"),
])
def test_video_limits_that_cannot_hold_are_refused(kw, message):
    errors = [str(e) for e in validate(variant(limits(**kw)))]
    assert any(message in e for e in errors), errors


def test_a_video_output_needs_a_stage_that_emits_video():
    def edit(doc):
        doc["spec"]["topology"]["stages"][2]["emits"] = ["image"]
    errors = [str(e) for e in validate(variant(edit))]
    assert any('stage "vae-decode" does not emit video (it emits image)' in e for e in errors), errors
