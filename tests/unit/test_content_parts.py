"""Content parts around the request path: which parts a pipeline reads, what each stage is sent, the
client's part builders and the CLI's --image/--audio/--video in command-line order."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage import media
from omnistage.api import MAX_MESSAGE_BYTES, Limits, accepted_inputs, reads_language, stage_inputs
from omnistage.client import (
    audio_part,
    build_request,
    image_part,
    pcm_part,
    raw_image_part,
    text_part,
    video_file_part,
    video_part,
)
from omnistage.local import cli
from orchestrator_service.request_run import RequestRun, stage_params
from orchestrator_service.routing import Router
from orchestrator_service.server import MIN_RECEIVE_BYTES

from ..harness import example
from ..media_builders import png, wav

PIXELS = np.random.default_rng(1).integers(0, 256, (6, 10, 3), dtype=np.uint8)
OMNI_THINKER_READS = frozenset({"text", "image", "audio", "video"})
PNG, WAV = png(PIXELS), wav(np.zeros(800, np.float32), 8000)  # WAV: 0.1 s of silence at 8 kHz


# ------------------------------------------------------------------ what stages read

@pytest.mark.parametrize("name,accepts", [
    ("llm-tiny", {"text"}), ("text-to-image-tiny", {"text"}), ("sd3-tiny", {"text"}),
    ("qwen3-omni-tiny", OMNI_THINKER_READS), ("qwen2.5-omni-tiny", OMNI_THINKER_READS),
    ("qwen3-omni-encoders-tiny", OMNI_THINKER_READS)])
def test_a_pipeline_accepts_what_its_stages_adapters_read(name, accepts):
    assert accepted_inputs(example(name)) == accepts


@pytest.mark.parametrize("name,reads", [("qwen3-asr-tiny", True), ("qwen3-omni-tiny", False), ("llm-tiny", False)])
def test_only_a_speech_recognition_stage_reads_the_audio_language(name, reads):
    assert reads_language(example(name)) is reads


def test_only_the_omni_thinker_reads_media():
    p = example("qwen3-omni-tiny")
    assert {s.name: stage_inputs(s) for s in p.stages} == {
        "thinker": OMNI_THINKER_READS, "talker": {"text"}, "code2wav": {"text"}}


def test_with_an_encoder_stage_only_the_encoder_reads_media():
    p = example("qwen3-omni-encoders-tiny")
    assert {s.name: stage_inputs(s) for s in p.stages} == {
        "encoder": OMNI_THINKER_READS, "thinker": {"text"}, "talker": {"text"}, "code2wav": {"text"}}


def test_a_stage_is_sent_only_the_media_it_reads():
    params = build_request("And now?", parts=["Look:", image_part(PNG), audio_part(WAV), "and listen."],
                           max_tokens=5).params
    assert stage_params(params, OMNI_THINKER_READS) is params  # reads it all: the message as is
    text_only = stage_params(params, frozenset({"text"}))
    assert [p.WhichOneof("part") for p in text_only.parts] == ["text", "image", "audio", "text"]  # indices match
    assert text_only.parts[1].image.ByteSize() == 0 and text_only.parts[2].audio.ByteSize() == 0
    assert [text_only.parts[0].text, text_only.parts[3].text] == ["Look:", "and listen."]
    assert text_only.ByteSize() < 100 < params.ByteSize() - 1000
    # Every other field as it was.
    assert (text_only.prompt, text_only.text.max_tokens) == ("And now?", 5)
    text_only.ClearField("parts")
    original = type(params)()
    original.CopyFrom(params)
    original.ClearField("parts")
    assert text_only == original
    images_only = stage_params(params, frozenset({"text", "image"}))
    assert images_only.parts[1].image.data == PNG and images_only.parts[2].audio.ByteSize() == 0


def test_each_stage_call_opens_with_the_params_its_stage_reads():
    pipeline = example("qwen3-omni-tiny")
    params = build_request("Say it.", parts=[image_part(PNG)]).params
    run = RequestRun(pipeline, Router(pipeline), "r1", params, {"thinker": "text", "code2wav": "audio"})
    sent = {stage: call.header.params for stage, call in run._calls.items()}
    assert sent["thinker"] == params
    for stage in ("talker", "code2wav"):
        assert sent[stage].parts[0].WhichOneof("part") == "image" and not sent[stage].parts[0].image.data
        assert sent[stage].prompt == "Say it."


def test_the_orchestrator_receives_the_largest_request_the_limits_admit():
    assert MIN_RECEIVE_BYTES <= Limits().max_request_bytes == 16 * (16 << 20) + (1 << 20) <= MAX_MESSAGE_BYTES


# -------------------------------------------------------------------------- client

def test_client_parts_decode_to_what_was_given(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    samples = np.array([0.0, 0.5, -0.5, 1.0], np.float32)
    parts = [text_part("hi"), image_part(tmp_path / "a.png"), image_part(PNG), raw_image_part(PIXELS),
             audio_part(WAV), pcm_part(samples, 16000), pcm_part(np.stack([samples, samples], 1), 8000),
             video_part([PIXELS, tmp_path / "a.png", PNG], [0.0, 0.5, 1.0])]
    got = media.decode_parts(build_request(parts=parts).params.parts, Limits())
    assert [media.MODALITY[type(p)] for p in got] == ["text", "image", "image", "image", "audio", "audio", "audio",
                                                      "video"]
    for p in got[1:4]:
        assert np.array_equal(p.pixels, PIXELS)
    assert np.allclose(got[5].samples, samples, atol=1e-4) and got[5].sample_rate == 16000
    assert np.allclose(got[6].samples, samples, atol=1e-4) and got[6].sample_rate == 8000
    assert got[7].frames.shape == (3, 6, 10, 3) and got[7].timestamps == (0.0, 0.5, 1.0)
    assert video_file_part(b"mp4 bytes").video.data == b"mp4 bytes"


def test_client_part_builders_refuse_what_they_cannot_send():
    with pytest.raises(ValueError, match="pixels must be"):
        raw_image_part(PIXELS.astype(np.float32))
    with pytest.raises(ValueError, match="each frame needs one"):
        video_part([PIXELS], [0.0, 1.0])
    with pytest.raises(ValueError, match="samples must be"):
        pcm_part(np.zeros((2, 2, 2)), 16000)


def test_a_str_part_is_text():
    assert build_request(parts=["hi", image_part(b"x")]).params.parts[0] == text_part("hi")


# ----------------------------------------------------------------------------- CLI

def parse(*argv: str):
    return cli.build_parser().parse_args(["generate", "--endpoint", "127.0.0.1:1", *argv])


def test_media_flags_keep_their_command_line_order_and_the_prompt_comes_last(tmp_path):
    for name in ("a.png", "b.png"):
        (tmp_path / name).write_bytes(PNG)
    (tmp_path / "c.wav").write_bytes(WAV)
    frames = tmp_path / "frames"
    frames.mkdir()
    for name in ("002.png", "001.png", "003.png"):
        (frames / name).write_bytes(png(PIXELS if name != "001.png" else PIXELS[::-1]))
    args = parse("--image", str(tmp_path / "a.png"), "--audio", str(tmp_path / "c.wav"), "--prompt", "Describe.",
                 "--video", str(frames), "--image", str(tmp_path / "b.png"), "--video-fps", "4")
    assert [kind for kind, _ in args.media] == ["image", "audio", "video", "image"]
    kw = cli._gen_kwargs(args)
    assert "prompt" not in kw
    parts = kw["parts"]
    assert [p if isinstance(p, str) else p.WhichOneof("part") for p in parts] == \
        ["image", "audio", "video", "image", "Describe."]
    v = media.decode_parts([parts[2]], Limits())[0]
    assert v.timestamps == (0.0, 0.25, 0.5) and np.array_equal(v.frames[0], PIXELS[::-1])  # sorted by name


def test_without_media_the_prompt_is_the_prompt():
    assert cli._gen_kwargs(parse("--prompt", "Hello"))["prompt"] == "Hello"
    assert "parts" not in cli._gen_kwargs(parse("--prompt", "Hello"))


@pytest.mark.parametrize("argv,message", [
    ((), "--prompt is required (or --image, --audio or --video)"),
    (("--image", "/no/such/file.png"), "--image /no/such/file.png: cannot read it (No such file or directory)"),
    (("--audio", "/no/such/file.wav"), "--audio /no/such/file.wav: cannot read it (No such file or directory)"),
])
def test_cli_errors_name_the_flag_and_file(argv, message):
    with pytest.raises(ValueError) as e:
        cli._gen_kwargs(parse(*argv))
    assert str(e.value) == message


def test_an_empty_frame_folder_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="the folder has no frame files"):
        cli._gen_kwargs(parse("--video", str(tmp_path)))


def test_generate_reports_a_bad_file_without_calling(tmp_path, capsys):
    assert cli.main(["generate", "--endpoint", "127.0.0.1:1", "--image", str(tmp_path / "none.png")]) == 2
    assert "omnistage generate: --image" in capsys.readouterr().err
