"""A request's media totals (limits.maxRequestAudioSeconds, maxRequestImagePixels, maxRequestVideoFrames,
maxRequestVideoPixels): parts whose sum passes a total are refused naming the total, its limit and the amount,
from the part's header before it is decoded and as decoding counts; a request just under is decoded; the
defaults (0) let every request of one part at its per-part most through; and bad values in a spec are
refused naming the field."""

from __future__ import annotations

import copy

import pytest
import yaml

from omnistage import media
from omnistage.api import Limits, SpecError, parse_pipeline
from omnistage.contract.params import InvalidRequest

from ..conftest import EXAMPLES
from ..media_builders import video_file
from .test_media import PIXELS, audio, encode_audio, encode_image, frame, image, png_header, sine, text, video

RATE = 8000
PNG = encode_image(PIXELS, "PNG")  # 20x12 = 240 pixels
FRAME = frame(PNG)


def flac(seconds: float) -> bytes:
    return encode_audio(sine(440, RATE, seconds), RATE, "FLAC")


def pcm(seconds: float):
    return audio(b"\x00\x00" * int(RATE * seconds), sample_rate=RATE)


def refusal(parts, limits: Limits) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        media.decode_parts(parts, limits)
    return e.value


@pytest.mark.parametrize("keep", [True, False])
def test_audio_parts_past_the_request_total_are_refused_naming_it(keep):
    limits = Limits(max_audio_seconds=1, max_request_audio_seconds=1.5)
    parts = [audio(flac(0.6)), text("and"), pcm(0.6), audio(flac(0.6))]
    with pytest.raises(InvalidRequest) as e:
        media.decode_parts(parts, limits, keep=keep)
    assert e.value.field == "params.parts[3].audio"
    assert str(e.value) == "params.parts[3].audio: brings the request's audio to 1.8 s; the limit per request " \
                           "is 1.5 s (maxRequestAudioSeconds)"
    decoded = media.decode_parts(parts[:3] + [pcm(0.25)], limits, keep=keep)  # 1.45 s: just under
    assert [d.modality for d in decoded] == (["audio", "text", "audio", "audio"] if keep else [])


def test_the_audio_total_is_checked_from_the_header_before_the_samples_are_read():
    limits = Limits(max_audio_seconds=1, max_request_audio_seconds=1)
    # part 1's header says 0.6 s; its samples are cut short (reading them would refuse it as corrupt, or count
    # fewer): the header alone passes the total
    cut = flac(0.6)[:200]
    assert str(refusal([pcm(0.6), audio(cut)], limits)) == \
        "params.parts[1].audio: brings the request's audio to 1.2 s; the limit per request is 1 s " \
        "(maxRequestAudioSeconds)"


def test_images_past_the_request_total_are_refused_from_their_headers():
    limits = Limits(max_request_image_pixels=600)
    assert str(refusal([image(PNG), image(PNG), image(PNG)], limits)) == \
        "params.parts[2].image: brings the request's images to 720 pixels; the limit per request is 600 " \
        "(maxRequestImagePixels)"
    # a header that claims 20x20 over a few bytes of pixel data: refused for the total, not as corrupt (no
    # pixel of it was decoded)
    assert str(refusal([image(PNG), image(png_header(20, 20))], limits)) == \
        "params.parts[1].image: brings the request's images to 640 pixels; the limit per request is 600 " \
        "(maxRequestImagePixels)"
    raw = image(PIXELS.tobytes(), width=20, height=12)
    assert len(media.decode_parts([image(PNG), raw, text("two")], limits)) == 3  # 480: under


def test_video_frames_and_pixels_past_the_request_totals_are_refused():
    two = video([FRAME, FRAME], [0.0, 0.5])
    assert str(refusal([two, two], Limits(max_video_frames=2, max_request_video_frames=3))) == \
        "params.parts[1].video: brings the request's video to 4 frames; the limit per request is 3 " \
        "(maxRequestVideoFrames)"
    assert str(refusal([two, two, two], Limits(max_request_video_pixels=1000))) == \
        "params.parts[2].video: brings the request's video to 1440 pixels; the limit per request is 1000 " \
        "(maxRequestVideoPixels)"
    assert len(media.decode_parts([two, two], Limits(max_video_frames=2, max_request_video_frames=4,
                                                     max_request_video_pixels=960))) == 2


def test_an_encoded_videos_frames_count_toward_the_request_total_as_they_are_decoded():
    pytest.importorskip("av")
    clip = video(data=video_file("mp4", frames=3))
    [decoded] = media.decode_parts([clip], Limits())
    per_frame = decoded.frames.shape[1] * decoded.frames.shape[2]
    limits = Limits(max_request_video_frames=4)
    assert str(refusal([clip, clip], limits)) == \
        "params.parts[1].video: brings the request's video to 5 frames; the limit per request is 4 " \
        "(maxRequestVideoFrames)"
    limits = Limits(max_request_video_pixels=5 * per_frame)
    assert str(refusal([clip, clip], limits)) == \
        f"params.parts[1].video: brings the request's video to {6 * per_frame} pixels; the limit per request " \
        f"is {5 * per_frame} (maxRequestVideoPixels)"


def test_no_part_after_the_one_that_passes_a_total_is_decoded():
    """The refusal comes before the rest: a corrupt part after it is not reached."""
    limits = Limits(max_audio_seconds=1)
    err = refusal([pcm(0.6), pcm(0.6), image(b"not an image")], limits)
    assert err.field == "params.parts[1].audio" and "maxRequestAudioSeconds" in str(err)


def test_totals_count_each_kind_apart():
    limits = Limits(max_audio_seconds=1, max_request_image_pixels=240, max_request_video_pixels=480)
    parts = [pcm(1.0), image(PNG), video([FRAME, FRAME], [0.0, 0.5])]
    assert [d.modality for d in media.decode_parts(parts, limits)] == ["audio", "image", "video"]


def test_the_default_totals_let_one_part_at_its_most_through():
    d = Limits()
    assert (d.request_audio_seconds, d.request_image_pixels, d.request_video_frames, d.request_video_pixels) == \
        (d.max_audio_seconds, d.max_video_pixels, d.max_video_frames, d.max_video_pixels)
    # a one-part request at each per-part most, with limits made small enough to build one here
    assert media.decode_parts([pcm(1.0)], Limits(max_audio_seconds=1))
    assert media.decode_parts([image(PNG)], Limits(max_image_pixels=240, max_video_pixels=100))  # images: the larger
    frames = video([FRAME] * 4, [0.0, 0.5, 1.0, 1.5])
    assert media.decode_parts([frames], Limits(max_video_frames=4, max_video_pixels=960))
    # and the totals still hold a request of many such parts
    assert "maxRequestAudioSeconds" in str(refusal([pcm(1.0), pcm(0.01)], Limits(max_audio_seconds=1)))
    assert "maxRequestVideoFrames" in str(refusal([frames, frames], Limits(max_video_frames=4)))


# --------------------------------------------------------------------------- spec

BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())


def with_limits(**limits) -> dict:
    doc = copy.deepcopy(BASE)
    doc["spec"]["topology"].setdefault("limits", {}).update(limits)
    return doc


@pytest.mark.parametrize("limits,message", [
    ({"maxRequestAudioSeconds": -1}, "spec.topology.limits.maxRequestAudioSeconds: must be >= 0, got -1"),
    ({"maxRequestImagePixels": "lots"}, "spec.topology.limits.maxRequestImagePixels: must be an integer"),
    ({"maxRequestVideoFrames": 100}, "spec.topology.limits.maxRequestVideoFrames: must be 0 or at least "
                                     "maxVideoFrames (128), got 100"),
    ({"maxAudioSeconds": 60, "maxRequestAudioSeconds": 30},
     "spec.topology.limits.maxRequestAudioSeconds: must be 0 or at least maxAudioSeconds (60), got 30"),
    ({"maxRequestVideoPixels": 1}, "spec.topology.limits.maxRequestVideoPixels: must be 0 or at least "
                                   "maxVideoPixels (90316800), got 1"),
])
def test_bad_totals_in_a_spec_are_refused_naming_the_field(limits, message):
    with pytest.raises(SpecError) as e:
        parse_pipeline(with_limits(**limits))
    messages = [str(x) for x in e.value.errors]
    assert any(m.startswith(message) for m in messages), messages


def test_totals_in_a_spec_reach_the_limits():
    p = parse_pipeline(with_limits(maxRequestAudioSeconds=900, maxRequestImagePixels=0))
    assert p.limits.max_request_audio_seconds == 900 and p.limits.request_audio_seconds == 900
    assert p.limits.request_image_pixels == p.limits.max_video_pixels
    example = parse_pipeline(BASE).limits
    assert example.max_request_audio_seconds == 0 and example.request_audio_seconds == example.max_audio_seconds
