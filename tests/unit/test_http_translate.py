"""OpenAI request bodies -> GenerateRequests (orchestrator_service/http_api/translate.py), pure: what each
field becomes, which OpenAI field a request-path field maps back to, and every refusal naming its field."""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest

from omnistage.api import load_pipeline
from omnistage.contract.modalities import MODALITY_CODES
from omnistage.contract.params import InvalidRequest
from orchestrator_service.http_api import translate
from orchestrator_service.http_api.errors import UnknownModel
from orchestrator_service.http_api.schemas import ChatCompletionRequest, ImageRequest, SpeechRequest

from ..conftest import EXAMPLES

OMNI = load_pipeline(EXAMPLES / "qwen3-omni-tiny.yaml")
IMAGES = load_pipeline(EXAMPLES / "text-to-image-tiny.yaml")
PNG_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()
WAV_B64 = base64.b64encode(b"RIFF fake").decode()


def chat(**kw) -> translate.Translated:
    body = {"model": OMNI.name, "messages": [{"role": "user", "content": "hi"}], **kw}
    return translate.chat(ChatCompletionRequest.model_validate(body), OMNI)


def kinds(request) -> list[str]:
    return [p.WhichOneof("part") for p in request.params.parts]


def test_messages_become_turns_over_the_parts_in_order():
    t = chat(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image_url", "image_url": {"url": PNG_URL}},
            {"type": "input_audio", "input_audio": {"data": WAV_B64, "format": "wav"}},
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}])
    p = t.request.params
    assert not p.system_prompt and not p.prompt
    assert [(x.role, x.parts) for x in p.turns] == [("system", 1), ("user", 4)]
    assert p.parts[0].text == "Be brief.\n\nBe kind."   # the leading system messages: one system prompt
    assert kinds(t.request) == ["text", "text", "image", "audio", "video"]
    assert p.parts[2].image.data == b"\x89PNG fake" and p.parts[3].audio.data == b"RIFF fake"
    assert t.fields["params.parts[2]"] == "messages[2].content[1]"
    assert t.fields["params.turns[1]"] == "messages[2]"


def test_a_conversation_with_tool_calls_becomes_turns_and_tools():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object", "properties": {}}}}]
    t = chat(tools=tools, parallel_tool_calls=False, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
        {"role": "user", "content": "Thanks"}])
    p = t.request.params
    assert [(x.role, x.parts) for x in p.turns] == [("user", 1), ("assistant", 0), ("tool", 1), ("assistant", 1),
                                                    ("user", 1)]
    assert [x.text for x in p.parts] == ["Weather?", "sunny", "Sunny.", "Thanks"]
    assert p.turns[1].tool_calls[0].name == "get_weather" and p.turns[2].tool_call_id == "call_1"
    assert p.tools[0].name == "get_weather" and json.loads(p.tools[0].parameters) == tools[0]["function"]["parameters"]
    assert t.tools == translate.ToolUse(max_calls=1) and not p.answer_prefix
    named = chat(tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.request.params.answer_prefix == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert named.tools.prefix == named.request.params.answer_prefix
    assert not chat(tools=tools, tool_choice="none").request.params.tools


def test_an_earlier_audio_answer_is_a_text_part_the_door_fills():
    t = chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "audio": {"id": "audio_x"}},
                       {"role": "user", "content": "Again"}])
    assert t.audio_refs == (translate.AudioRef(1, "audio_x", "messages[1].audio.id"),)


def test_a_conversation_ending_with_an_answer_is_refused_by_the_request_path_naming_the_message():
    from omnistage.api import Limits
    from omnistage.contract.params import resolve
    from orchestrator_service.http_api.errors import openai_param

    t = chat(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(InvalidRequest) as e:
        resolve(t.request.params, Limits())
    assert openai_param(e.value.field, t.fields) == "messages[1].role"


def test_sampling_fields_and_modalities():
    t = chat(max_completion_tokens=7, max_tokens=3, temperature=0.5, top_p=0.9, top_k=5, seed=42, ignore_eos=True,
             modalities=["text", "audio"], audio={"voice": "chelsie", "format": "mp3"}, stop="END")
    p = t.request.params
    assert (p.text.max_tokens, p.text.temperature, round(p.text.top_p, 3), p.text.top_k, p.seed) == (7, 0.5, 0.9, 5, 42)
    assert p.text.ignore_eos and p.audio.speaker == "chelsie"
    assert list(t.request.outputs) == [MODALITY_CODES["text"], MODALITY_CODES["audio"]]
    assert t.audio_format == "mp3" and t.stops == ("END",)
    assert t.fields["params.text.max_tokens"] == "max_completion_tokens"
    assert t.fields["params.audio.speaker"] == "audio.voice" and t.fields["outputs[1]"] == "modalities[1]"


def test_defaults_text_only_greedy_and_a_wav_or_a_pcm16_stream():
    t = chat()
    assert list(t.request.outputs) == [MODALITY_CODES["text"]] and t.audio_format is None
    assert not t.request.params.text.HasField("temperature") and not t.request.params.HasField("seed")
    assert chat(modalities=["text", "audio"]).audio_format == "wav"
    assert chat(modalities=["text", "audio"], stream=True).audio_format == "pcm16"
    assert chat(top_k=-1).request.params.text.HasField("top_k") is False
    assert not t.stream and not t.include_usage and not t.request.return_trace
    streamed = chat(stream=True, stream_options={"include_usage": True}, return_trace=True)
    assert streamed.stream and streamed.include_usage and streamed.request.return_trace


# Every optional field the reference allows to be null, null: each is "not given", its default applied.
NULL_BODIES = [
    (translate.chat, ChatCompletionRequest, {"model": None, "messages": [{"role": "user", "content": "hi"}], "n": None,
                                             "stream": None, "stream_options": {"include_usage": None},
                                             "ignore_eos": None, "modalities": None, "audio": None, "stop": None,
                                             "max_tokens": None, "temperature": None, "seed": None, "top_k": None,
                                             "return_trace": None}),
    (translate.speech, SpeechRequest, {"input": "Hello", "voice": None, "speed": None, "stream_format": None,
                                       "response_format": None, "instructions": None, "return_trace": None}),
    (translate.images, ImageRequest, {"prompt": "a cat", "n": None, "stream": None, "size": None, "seed": None,
                                      "response_format": None, "partial_images": None, "return_trace": None}),
]


@pytest.mark.parametrize("translation,model,body", NULL_BODIES, ids=[t.__name__ for t, _, _ in NULL_BODIES])
def test_null_optional_fields_are_not_given(translation, model, body):
    pipeline = IMAGES if model is ImageRequest else OMNI
    plans = translation(model.model_validate_json(json.dumps(body), strict=True), pipeline)
    for t in plans if isinstance(plans, list) else [plans]:
        assert not t.stream and not t.include_usage and not t.request.return_trace
        assert not t.request.params.text.ignore_eos
    if translation is translate.images:
        assert len(plans) == 1
    elif translation is translate.speech:
        assert plans.audio_format == "mp3"


CHAT_REFUSALS = [
    (dict(n=2), "n"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice.function.name"),
    (dict(functions=[{"name": "f"}]), "functions"),
    (dict(messages=[{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]), "messages[1].tool_call_id"),
    (dict(messages=[{"role": "user", "content": "a"}, {"role": "function", "content": "b"}]), "messages[1].role"),
    (dict(messages=[{"role": "user", "content": "a"}, {"role": "assistant"}]), "messages[1].content"),
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(logprobs=True), "logprobs"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(stop=["a", ""]), "stop[1]"),
    (dict(modalities=[]), "modalities"),
    (dict(modalities=["text", "image"]), "modalities[1]"),
    (dict(modalities=["text", "audio"], audio={"format": "aac"}), "audio.format"),
    (dict(modalities=["text", "audio"], audio={"format": "ogg"}), "audio.format"),
    (dict(modalities=["text", "audio"], stream=True, audio={"format": "wav"}), "audio.format"),
    (dict(messages=[{"role": "system", "content": "x"}]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "a"}]), "messages[0].role"),
    (dict(messages=[{"role": "user"}]), "messages[0].content"),
    (dict(messages=[{"role": "system", "content": [{"type": "image_url", "image_url": {"url": PNG_URL}}]},
                    {"role": "user", "content": "a"}]), "messages[0].content[0]"),
    (dict(messages=[{"role": "user", "content": [{"type": "file"}]}]), "messages[0].content[0].type"),
    (dict(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content[0].image_url"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]),
     "messages[0].content[0].image_url.url"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:text/plain;"
                                                                                            "base64,AAAA"}}]}]),
     "messages[0].content[0].image_url.url"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png,raw"}}]}]),
     "messages[0].content[0].image_url.url"),
    (dict(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "%%%"}}]}]),
     "messages[0].content[0].input_audio.data"),
    (dict(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": WAV_B64,
                                                                                         "format": "aiff"}}]}]),
     "messages[0].content[0].input_audio.format"),
]


@pytest.mark.parametrize("kw,field", CHAT_REFUSALS, ids=[f for _, f in CHAT_REFUSALS])
def test_chat_refusals_name_the_openai_field(kw, field):
    with pytest.raises(InvalidRequest) as e:
        chat(**kw)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


def test_refused_fields_at_their_off_values_pass():
    chat(tools=[], tool_choice="none", response_format={"type": "text"}, logprobs=False, presence_penalty=0,
         frequency_penalty=0.0, logit_bias={})


def test_another_model_is_unknown_and_no_model_is_the_pipeline():
    with pytest.raises(UnknownModel):
        chat(model="gpt-4o")
    translate.chat(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]}), OMNI)


def test_chat_on_an_image_pipeline_is_refused_naming_the_model():
    with pytest.raises(InvalidRequest) as e:
        translate.chat(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]}), IMAGES)
    assert e.value.field == "model"


# ---------------------------------------------------------------------------- speech

def speech(pipeline=OMNI, **kw) -> translate.Translated:
    return translate.speech(SpeechRequest.model_validate({"input": "Hello world", "voice": "ethan", **kw}), pipeline)


def test_speech_asks_the_thinker_to_repeat_the_input_with_audio_only():
    t = speech()
    p = t.request.params
    assert p.system_prompt == translate.REPEAT_VERBATIM and p.prompt == "Hello world" and p.audio.speaker == "ethan"
    assert list(t.request.outputs) == [MODALITY_CODES["audio"]]
    assert p.text.max_tokens == len("Hello world") + translate.SPEECH_EXTRA_TOKENS
    assert p.audio.max_codec_frames == OMNI.limits.default_codec_frames  # a short input: the default
    most = OMNI.limits.max_tokens - translate.SPEECH_EXTRA_TOKENS  # the tiny pipeline's tighter budget
    longest = speech(input="x" * most).request.params
    assert longest.text.max_tokens == OMNI.limits.max_tokens and longest.audio.max_codec_frames == most
    assert t.audio_format == "mp3" and not t.stream
    assert speech(stream_format="sse").audio_format == "pcm" and speech(stream_format="sse").stream
    assert t.fields["params.audio.speaker"] == "voice"


def test_speech_that_cannot_fit_its_budget_is_refused_naming_the_limit():
    most = OMNI.limits.max_tokens - translate.SPEECH_EXTRA_TOKENS
    with pytest.raises(InvalidRequest) as e:
        speech(input="x" * (most + 1))
    assert e.value.field == "input" and f"at most {most}" in str(e.value) and "maxTokens" in str(e.value)
    frames = dataclasses.replace(OMNI, limits=dataclasses.replace(OMNI.limits, max_codec_frames=100))
    with pytest.raises(InvalidRequest) as e:
        speech(frames, input="x" * 101)
    assert e.value.field == "input" and "at most 100" in str(e.value) and "maxCodecFrames" in str(e.value)


def test_speech_on_a_pipeline_without_audio_is_refused_naming_the_model():
    with pytest.raises(InvalidRequest) as e:
        speech(IMAGES)
    assert e.value.field == "model" and "cannot speak" in str(e.value)


# ---------------------------------------------------------------------------- images

def images(pipeline=IMAGES, **kw) -> list[translate.Translated]:
    return translate.images(ImageRequest.model_validate({"prompt": "a red car", **kw}), pipeline,
                            random_seed=lambda: 1000)


def test_one_request_per_image_with_consecutive_seeds():
    ts = images(n=3, size="128x64", seed=7, num_inference_steps=4, guidance_scale=3.0, negative_prompt="blur",
                true_cfg_scale=4.0)
    assert [t.request.params.seed for t in ts] == [7, 8, 9]
    p = ts[0].request.params
    assert (p.image.width, p.image.height, p.image.num_inference_steps, p.image.guidance_scale) == (128, 64, 4, 3.0)
    assert p.image.negative_prompt == "blur" and list(ts[0].request.outputs) == [MODALITY_CODES["image"]]
    assert p.image.true_cfg_scale == 4.0 and ts[0].fields["params.image.true_cfg_scale"] == "true_cfg_scale"
    assert [t.request.params.seed for t in images(n=2)] == [1000, 1001]  # differ, without a seed given
    assert not images()[0].request.params.HasField("seed")  # one image: the pipeline's default
    assert (images(size="auto")[0].request.params.image.width, ts[0].fields["params.image.height"]) == (0, "size")


REFUSALS = [
    (speech, dict(speed=1.25), "speed"),
    (speech, dict(input="  "), "input"),
    (speech, dict(response_format="aac"), "response_format"),
    (speech, dict(response_format="ogg"), "response_format"),
    (speech, dict(response_format="wav", stream_format="sse"), "response_format"),
    (speech, dict(instructions="whisper"), "instructions"),
    # an omni pipeline clones no voice: its Thinker would hear the clip as the input
    (speech, dict(ref_audio="data:audio/wav;base64,UklGRg=="), "ref_audio"),
    (speech, dict(ref_text="Hi.", x_vector_only_mode=False), "ref_text"),
    (speech, dict(x_vector_only_mode=True), "x_vector_only_mode"),
    (images, dict(size="big"), "size"),
    (images, dict(size="64x"), "size"),
    (images, dict(response_format="url"), "response_format"),
    (images, dict(output_format="webp"), "output_format"),
    (images, dict(stream=True), "stream"),
    (images, dict(partial_images=2), "partial_images"),
]


@pytest.mark.parametrize("translation,kw,field", REFUSALS,
                         ids=[f"{t.__name__}-{f}-{i}" for i, (t, _, f) in enumerate(REFUSALS)])
def test_speech_and_image_refusals_name_the_field(translation, kw, field):
    with pytest.raises(InvalidRequest) as e:
        translation(**kw)
    assert e.value.field == field


def test_images_on_a_pipeline_without_images_are_refused_naming_the_model():
    with pytest.raises(InvalidRequest) as e:
        images(OMNI)
    assert e.value.field == "model"


def test_a_generation_on_an_editing_pipeline_is_refused_naming_the_model_and_the_edits_endpoint():
    with pytest.raises(InvalidRequest) as e:
        images(load_pipeline(EXAMPLES / "flux-kontext-tiny.yaml"))
    assert e.value.field == "model" and "/v1/images/edits" in str(e.value)


def test_refusal_parts_empty_tool_results_and_empty_system_messages_are_taken():
    t = chat(messages=[{"role": "system", "content": ""},
                       {"role": "user", "content": "Do it"},
                       {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}],
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                       {"role": "tool", "tool_call_id": "c1", "content": ""},
                       {"role": "user", "content": "Why?"}])
    p = t.request.params
    assert [(x.role, x.parts) for x in p.turns] == [("user", 1), ("assistant", 1), ("tool", 0), ("user", 1)]
    assert [x.text for x in p.parts] == ["Do it", "I cannot.", "Why?"]
    assert t.fields["params.turns[1].tool_calls[0].name"] == "messages[2].tool_calls[0].function.name"


def test_an_audio_answer_is_kept_until_it_expires_and_never_after():
    from orchestrator_service.http_api.audio_ids import AnswerTranscripts

    now = [1000.0]
    kept = AnswerTranscripts(keep_s=60, max_entries=2, clock=lambda: now[0])
    kept.keep("audio_a", "said a", created=1000)
    kept.keep("audio_b", "said b", created=1010)
    assert kept.transcript("audio_a", "f") == "said a"
    now[0] = 1060.5   # a's hour (here a minute) is over, b's is not
    with pytest.raises(InvalidRequest, match="unknown or expired") as e:
        kept.transcript("audio_a", "messages[1].audio.id")
    assert e.value.field == "messages[1].audio.id" and kept.transcript("audio_b", "f") == "said b"
    kept.keep("audio_c", "said c", created=1060)
    kept.keep("audio_d", "said d", created=1060)   # past max_entries: the oldest goes
    assert len(kept) == 2
    with pytest.raises(InvalidRequest):
        kept.transcript("audio_b", "f")
