"""The transcription door's pure parts: the multipart form read from bytes, the upload translated into a
GenerateRequest (audio part, instruction, text out only), and the subtitle times."""

from __future__ import annotations

import httpx
import pytest

from omnistage.contract.modalities import MODALITY_CODES
from omnistage.contract.params import InvalidRequest, resolve
from orchestrator_service.http_api import multipart_form, transcriptions
from orchestrator_service.http_api.errors import ApiError

from ..harness import example

OMNI = example("qwen3-omni-tiny")
IMAGES = example("text-to-image-tiny")
ASR = example("qwen3-asr-tiny")
AUDIO = b"RIFF....WAVEfmt "  # the bytes are the request path's to decode: any will do here


def form(fields: dict | None = None, files: dict | None = None) -> tuple[bytes, str]:
    """A body and its Content-Type as an HTTP client (httpx, as the openai SDK uses) encodes the form."""
    request = httpx.Request("POST", "http://127.0.0.1/", data=fields or {},
                            files=files if files is not None else {"file": ("clip.wav", AUDIO, "audio/wav")})
    return request.read(), request.headers["content-type"]


def upload(pipeline=OMNI, task=transcriptions.TRANSCRIBE, **fields) -> transcriptions.Transcription:
    body, content_type = form({"model": pipeline.name, **fields})
    parse = transcriptions.transcription if task == transcriptions.TRANSCRIBE else transcriptions.translation
    return parse(body, content_type, pipeline)


def test_the_form_keeps_files_apart_from_text_fields_and_lists_in_order():
    body, content_type = form({"model": "m", "include[]": ["a", "b"]},
                              {"file": ("clip.wav", AUDIO, "audio/wav")})
    parsed = multipart_form.parse(body, content_type)
    assert parsed.text("model") == "m" and parsed.texts("include") == ["a", "b"]
    assert parsed.files["file"] == [multipart_form.Upload("clip.wav", "audio/wav", AUDIO)]


@pytest.mark.parametrize("content_type, why", [
    ("application/json", "must be multipart/form-data"),
    ("multipart/form-data", "has no boundary"),
])
def test_a_body_that_is_not_a_form_is_refused(content_type, why):
    with pytest.raises(ApiError) as e:
        multipart_form.parse(b"{}", content_type)
    assert e.value.status == 400 and why in e.value.message


def test_too_many_fields_are_refused_at_the_first_past_the_bound():
    body, content_type = form({f"f{i}": "x" for i in range(multipart_form.MAX_FIELDS + 1)})
    with pytest.raises(ApiError, match=f"more than {multipart_form.MAX_FIELDS} fields"):
        multipart_form.parse(body, content_type)


def test_a_transcription_is_the_audio_then_the_instruction_with_text_out_only():
    plan = upload(language="fr", prompt="Names: Zoë.", temperature="0.2")
    params = plan.request.params
    assert params.parts[0].audio.data == AUDIO and "Transcribe" in params.parts[1].text
    assert '"fr"' in params.parts[1].text and params.parts[1].text.count("Names: Zoë.") == 1
    assert params.system_prompt == transcriptions.SYSTEM_PROMPT
    assert list(plan.request.outputs) == [MODALITY_CODES["text"]]
    assert params.text.temperature == pytest.approx(0.2)
    assert (plan.task, plan.response_format, plan.language, plan.stream) == ("transcribe", "json", "fr", False)
    # refusals of the request path name the form's fields
    assert plan.fields["params.parts[0]"] == "file" and plan.fields["params.parts[1]"] == "prompt"


def test_a_translation_asks_for_english():
    plan = upload(task=transcriptions.TRANSLATE, response_format="verbose_json")
    assert "into English" in plan.request.params.parts[1].text and plan.language == "english"


@pytest.mark.parametrize("fields, param", [
    ({"response_format": "xml"}, "response_format"),
    ({"response_format": "vtt", "stream": "true"}, "response_format"),
    ({"stream": "maybe"}, "stream"),
    ({"temperature": "nan"}, "temperature"),
    ({"language": "English please"}, "language"),
    ({"include[]": "logprobs"}, "include"),
    ({"timestamp_granularities[]": "word"}, "timestamp_granularities"),
    ({"chunking_strategy": '{"type": "server_vad"}'}, "chunking_strategy"),
])
def test_fields_it_cannot_honour_are_refused_by_name(fields, param):
    with pytest.raises(InvalidRequest) as e:
        upload(**fields)
    assert e.value.field == param


def test_a_speech_recognition_pipeline_gets_the_audio_alone_with_its_context_and_language():
    plan = upload(ASR, language="fr", prompt="Names: Zoë.", temperature="0.2")
    params = plan.request.params
    assert [p.WhichOneof("part") for p in params.parts] == ["audio"] and params.parts[0].audio.data == AUDIO
    assert params.system_prompt == "Names: Zoë." and params.audio.language == "fr"
    assert list(plan.request.outputs) == [MODALITY_CODES["text"]]
    assert params.text.temperature == pytest.approx(0.2)
    assert plan.fields["params.system_prompt"] == "prompt" and plan.fields["params.audio.language"] == "language"
    assert plan.fields["params.parts[0]"] == "file" and plan.language == "fr"


def test_a_speech_recognition_pipeline_does_not_translate_and_bounds_the_prompt_as_the_system_prompt():
    with pytest.raises(InvalidRequest) as e:
        upload(ASR, task=transcriptions.TRANSLATE)
    assert e.value.field == "model" and "transcribes" in str(e.value)
    # The prompt is the system prompt, bounded where every request's is (resolve), refused naming `prompt`.
    plan = upload(ASR, prompt="x" * (ASR.limits.max_prompt_chars + 1))
    with pytest.raises(InvalidRequest) as e:
        resolve(plan.request.params, ASR.limits)
    assert plan.fields[e.value.field] == "prompt"
    resolve(upload(ASR, prompt="x" * ASR.limits.max_prompt_chars).request.params, ASR.limits)
    # A region is dropped: the model forces a language, not a variant of it.
    assert upload(ASR, language="en-US").request.params.audio.language == "en"


def test_a_pipeline_that_hears_no_audio_is_refused_naming_model():
    with pytest.raises(InvalidRequest) as e:
        upload(IMAGES)
    assert e.value.field == "model" and "takes audio" in str(e.value)


def test_no_file_is_refused_naming_file():
    body, content_type = form({"model": OMNI.name}, files={})
    with pytest.raises(InvalidRequest) as e:
        transcriptions.transcription(body, content_type, OMNI)
    assert e.value.field == "file"


@pytest.mark.parametrize("seconds, srt, vtt", [
    (0, "00:00:00,000", "00:00:00.000"),
    (1.5, "00:00:01,500", "00:00:01.500"),
    (3725.0004, "01:02:05,000", "01:02:05.000"),
])
def test_cue_times(seconds, srt, vtt):
    assert transcriptions.cue_time(seconds, ",") == srt and transcriptions.cue_time(seconds, ".") == vtt
