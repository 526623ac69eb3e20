"""The job API's pure parts: seconds -> frames, the /v1/videos body -> GenerateRequest, a job as OpenAI's Video
object, a running job's progress, the content folder a store URL gets, and the owner a key names."""

from __future__ import annotations

import re

import grpc
import pytest
import yaml

from omnistage.api import parse_pipeline
from omnistage.contract.params import InvalidRequest
from omnistage.contract.request import build_request
from orchestrator_service.api_keys import ApiKeys
from orchestrator_service.http_api.videos import VideoRequest, frames_for, translate, video_object
from orchestrator_service.jobs.api import JobApi, JobSettings, owner_of
from orchestrator_service.jobs.replica import JobsFlagError, check_settings, content_root
from orchestrator_service.jobs.runner import percent
from orchestrator_service.jobs.store import Job, JobStatus
from orchestrator_service.servicer import Refused

from ...conftest import EXAMPLES


def wan():
    return parse_pipeline(yaml.safe_load((EXAMPLES / "wan-t2v-tiny.yaml").read_text()))


@pytest.mark.parametrize(("seconds", "fps", "frames"), [
    ("4", 16, 65), (4, 16, 65), (4.9, 16, 77), ("5", 16, 81), (0.01, 16, 1), ("1", 12, 13), (0.75, 12, 9)])
def test_seconds_become_the_nearest_frame_count_the_vae_makes(seconds, fps, frames):
    assert frames_for(seconds, fps, 81) == frames


@pytest.mark.parametrize(("seconds", "words"), [
    ("12", "12 s at 16 fps is 193 frames; this pipeline makes at most 81 frames (5.06 s at 16 fps)"),
    ("0", "above 0"), ("-1", "above 0"), ("four", "above 0"), ("nan", "above 0"), ("inf", "above 0")])
def test_seconds_refused_name_the_limit(seconds, words):
    with pytest.raises(InvalidRequest) as e:
        frames_for(seconds, 16, 81)
    assert e.value.field == "seconds" and words in str(e.value)


@pytest.mark.parametrize("seconds", ["1e308", 1e308, "1e30"])
def test_seconds_too_many_to_count_are_refused_naming_seconds(seconds):
    with pytest.raises(InvalidRequest) as e:  # not an OverflowError (an HTTP 500)
        frames_for(seconds, 16, 81)
    assert e.value.field == "seconds" and "at most 81 frames" in str(e.value)


def test_a_rate_over_the_limit_is_refused_as_the_rate_not_the_length():
    with pytest.raises(InvalidRequest) as e:
        translate(VideoRequest(prompt="x", seconds="4", fps=100), wan())
    assert e.value.field == "fps" and "between 1 and 60, got 100" in str(e.value)


def test_translate_fills_size_frames_rate_and_asks_for_video_only():
    body = VideoRequest(prompt="a cat", size="48x32", seconds="1", fps=12, seed=3, num_inference_steps=5)
    request = translate(body, wan())
    p = request.params
    assert (p.image.width, p.image.height, p.video.num_frames, p.video.fps, p.seed) == (48, 32, 13, 12, 3)
    assert p.image.num_inference_steps == 5 and list(request.outputs) == [4]  # VIDEO


def test_num_frames_given_wins_over_seconds_and_none_leaves_the_pipeline_default():
    assert translate(VideoRequest(prompt="x", seconds="4", num_frames=9), wan()).params.video.num_frames == 9
    assert translate(VideoRequest(prompt="x"), wan()).params.video.num_frames == 0


def test_input_reference_is_refused_by_name():
    with pytest.raises(InvalidRequest) as e:
        translate(VideoRequest(prompt="x", input_reference={"image_url": "data:image/png;base64,AA=="}), wan())
    assert e.value.field == "input_reference" and "text-to-video" in str(e.value)


def test_json_body_takes_seconds_as_text_or_number():
    assert VideoRequest.model_validate_json(b'{"prompt": "x", "seconds": "8"}', strict=True).seconds == "8"
    assert VideoRequest.model_validate_json(b'{"prompt": "x", "seconds": 8}', strict=True).seconds == 8


def job(**kw) -> Job:
    base = dict(id="video_" + "0" * 32, owner="", kind="video", status=JobStatus.IN_PROGRESS, request=b"",
                created_at=100.5, progress=40, meta={"model": "wan-t2v-tiny", "width": 48, "height": 32,
                                                     "num_frames": 9, "fps": 12, "seconds": 0.75})
    return Job(**(base | kw))


def test_video_object_is_openais_shape():
    v = video_object(job())
    assert {k: v[k] for k in ("object", "status", "progress", "size", "seconds", "created_at", "completed_at",
                              "error")} == {"object": "video", "status": "in_progress", "progress": 40,
                                            "size": "48x32", "seconds": "0.75", "created_at": 100,
                                            "completed_at": None, "error": None}
    failed = video_object(job(status=JobStatus.FAILED, error_code="cancelled", error_message="by its owner",
                              completed_at=200.0, expires_at=300.0, attempts=2, restarted_reason="r"))
    assert failed["error"] == {"code": "cancelled", "message": "by its owner"}
    assert (failed["completed_at"], failed["expires_at"], failed["restarted_reason"]) == (200, 300, "r")


@pytest.mark.parametrize(("steps", "frames", "want"), [
    ((0, 0), 0, 0), ((1, 4), 0, 22), ((4, 4), 0, 90), ((4, 4), 5, 95), ((4, 4), 9, 99), ((4, 4), 20, 99)])
def test_progress_is_steps_then_frames_and_never_100_before_the_end(steps, frames, want):
    assert percent(*steps, frames, 9) == want


def test_content_folder_beside_sqlite_or_named():
    assert str(content_root("sqlite:///var/jobs/jobs.db", None)) == "/var/jobs/content"
    assert str(content_root("postgresql://u:p@h/db", "/mnt/videos")) == "/mnt/videos"
    with pytest.raises(JobsFlagError, match="--jobs-content"):
        content_root("postgresql://u:p@h/db", None)


def test_owner_is_a_digest_of_the_key_never_the_key():
    keys = ApiKeys(["first-key", "second-key:3"])
    a, b = owner_of(keys, "Bearer first-key"), owner_of(keys, "Bearer second-key")
    assert a != b and a.startswith("key-") and "first-key" not in a
    assert owner_of(ApiKeys(), None) == ""


@pytest.mark.parametrize(("settings", "flag"), [
    (JobSettings(lease_s=1.0), "--jobs-lease-s 1: at least 2"), (JobSettings(concurrency=-1), "--jobs-concurrency"),
    (JobSettings(max_queued_per_key=0), "--jobs-max-queued-per-key 0"), (JobSettings(ttl_s=-1), "--jobs-ttl-s")])
def test_jobs_flags_refused_name_the_flag(settings, flag):
    with pytest.raises(JobsFlagError, match=re.escape(flag)):
        check_settings(settings)
    check_settings(JobSettings(concurrency=0, ttl_s=0.0))  # a replica that only serves the API; keep nothing


def image_pipeline():
    return parse_pipeline(yaml.safe_load((EXAMPLES / "sd3-tiny.yaml").read_text()))


async def test_a_pipeline_without_video_refuses_jobs_by_name_before_any_store():
    with pytest.raises(Refused) as e:
        await JobApi(image_pipeline(), None, None).create(build_request("a cat"), "")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.param == "model"
    assert "makes no video (it has: image)" in e.value.message
    with pytest.raises(Refused) as e:  # a video pipeline, no store: 503 saying which flag
        await JobApi(wan(), None, None).create(build_request("a cat", outputs=["video"]), "")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "--jobs-store" in e.value.message


def wan_i2v():
    return parse_pipeline(yaml.safe_load((EXAMPLES / "wan-i2v-tiny.yaml").read_text()))


@pytest.mark.parametrize("reference", [b"\x89PNG...", "data:image/png;base64,iVBORw==",
                                       {"image_url": "data:image/png;base64,iVBORw=="}])
def test_an_input_reference_becomes_the_requests_one_image_part(reference):
    request = translate(VideoRequest(prompt="x", input_reference=reference), wan_i2v())
    assert [p.WhichOneof("part") for p in request.params.parts] == ["image"]
    assert request.params.parts[0].image.data.startswith(b"\x89PNG")


@pytest.mark.parametrize(("reference", "field", "words"), [
    ("https://example.com/a.png", "input_reference", "not fetched"),
    ({"image_url": "data:audio/wav;base64,AA=="}, "input_reference.image_url", "not an image"),
    ({"file_id": "file-1"}, "input_reference.file_id", "file ids are not served"),
    ({"url": "x"}, "input_reference", "must be an image"),
    ("data:image/png;base64,***", "input_reference", "not valid base64")])
def test_an_input_reference_that_is_no_inline_image_is_refused_by_name(reference, field, words):
    with pytest.raises(InvalidRequest) as e:
        translate(VideoRequest(prompt="x", input_reference=reference), wan_i2v())
    assert e.value.field == field and words in str(e.value)
