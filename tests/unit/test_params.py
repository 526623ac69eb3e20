"""Request parameters: defaults, bounds, and errors that name the field."""

from __future__ import annotations

import pytest

from omnistage.api import MODALITIES, Limits
from omnistage.client import build_request, image_part, text_part
from omnistage.contract.modalities import MODALITY_CODES
from omnistage.contract.params import InvalidRequest, resolve
from omnistage.v1 import common_pb2, orchestrator_pb2

LIMITS = Limits(max_tokens=512, default_max_tokens=32, default_image_side=64, default_inference_steps=10)


def params(**kw):
    return build_request(**{"prompt": "hi", **kw}).params


def test_defaults():
    p = resolve(params(), LIMITS)
    assert p.max_tokens == LIMITS.default_max_tokens and p.temperature is None and p.seed == 0
    assert p.width == p.height == LIMITS.default_image_side and p.num_inference_steps == LIMITS.default_inference_steps
    assert p.max_codec_frames == LIMITS.default_codec_frames and p.speaker == "ethan"


def test_limits_left_to_the_model_fall_back_where_no_checkpoint_said():
    """0 is "from the model": the orchestrator reads them from the checkpoints at start
    (omnistage.checkpoints.defaults); where nothing filled them, the fallbacks apply, within the maxima."""
    p = resolve(params(), Limits())
    assert (p.max_tokens, p.width, p.num_inference_steps) == (256, 512, 28)
    assert resolve(params(max_tokens=100_000), Limits()).max_tokens == 100_000  # the engine's context bounds it
    small = resolve(params(), Limits(max_tokens=100, max_image_side=256, max_inference_steps=20))
    assert (small.max_tokens, small.width, small.height, small.num_inference_steps) == (100, 256, 256, 20)
    with pytest.raises(InvalidRequest, match="params.text.max_tokens: must be between 1 and 100, got 101"):
        resolve(params(max_tokens=101), Limits(max_tokens=100))


def test_values_pass_through():
    p = resolve(params(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, width=128, height=64,
                       num_inference_steps=4, guidance_scale=1.0, max_codec_frames=9), LIMITS)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, pytest.approx(0.9), 5, 3)
    assert (p.width, p.height, p.num_inference_steps, p.guidance_scale, p.max_codec_frames) == (128, 64, 4, 1.0, 9)
    assert resolve(params(system_prompt="Be brief."), LIMITS).system_prompt == "Be brief."
    assert resolve(params(raw_prompt=True), LIMITS).raw_prompt is True


BAD = [
    (dict(prompt=""), "params.prompt: is required"),
    (dict(prompt="x" * 9000), "params.prompt: is 9000 characters"),
    (dict(max_tokens=10_000), "params.text.max_tokens: must be between 1 and 512, got 10000"),
    (dict(temperature=-1.0), "params.text.temperature: must be between 0 and 100"),
    (dict(temperature=float("nan")), "params.text.temperature"),
    (dict(top_p=0.0), "params.text.top_p: must be in (0, 1]"),
    (dict(top_k=0), "params.text.top_k: must be between 1"),
    (dict(width=100_000), "params.image.width: must be between 8 and 1024, got 100000"),
    (dict(height=100), "params.image.height: must be a multiple of 8, got 100"),
    (dict(num_inference_steps=100_000), "params.image.num_inference_steps: must be between 1 and 200"),
    (dict(guidance_scale=-3.0), "params.image.guidance_scale"),
    (dict(max_codec_frames=999_999), "params.audio.max_codec_frames: must be between 1 and 2048"),
    (dict(speaker="x" * 100), "params.audio.speaker: is longer than 64"),
    (dict(system_prompt="x" * 9000), "params.system_prompt: is longer than 8192"),
    (dict(system_prompt="Be brief.", raw_prompt=True), "params.system_prompt: cannot be used with params.raw_prompt"),
    # Content parts: structure only (decoding is omnistage.media's).
    (dict(prompt="", parts=[image_part(b"x")] * 17), "params.parts: has 17 media parts; the limit is 16"),
    (dict(parts=["a", common_pb2.ContentPart()]), "params.parts[1]: empty part (set text, image, audio or video)"),
    (dict(parts=[""]), "params.parts[0].text: is empty"),
    (dict(parts=[image_part(bytes(17 << 20))]), "params.parts[0].image: is 17825802 bytes; the limit is 16777216"),
    (dict(prompt="x" * 8000, parts=["y" * 100, "z" * 100]), "params.parts: text parts and prompt are 8200 "
                                                            "characters together; the limit is 8192"),
    (dict(prompt="", prompt_token_ids=[1, 2], parts=["a"]), "params.parts: cannot be used with "
                                                            "params.prompt_token_ids"),
    (dict(raw_prompt=True, parts=[image_part(b"png")]), "params.raw_prompt: cannot be used with media parts"),
]


@pytest.mark.parametrize("kw,message", BAD, ids=[b[1].split(":")[0] for b in BAD])
def test_bad_values_name_the_field(kw, message):
    with pytest.raises(InvalidRequest) as e:
        resolve(params(**kw), LIMITS)
    assert str(e.value).startswith(message)
    assert e.value.field == message.split(":")[0]


def test_parts_are_kept_as_given_and_the_prompt_is_the_last_text_part():
    parts = [text_part("Look:"), image_part(b"\x89PNG..."), "and say what you see"]
    p = resolve(params(prompt="Briefly.", parts=parts), LIMITS)
    assert [x.WhichOneof("part") for x in p.parts] == ["text", "image", "text"]
    assert p.parts[1].image.data == b"\x89PNG..." and p.parts[2].text == "and say what you see"
    assert [x.WhichOneof("part") for x in p.content] == ["text", "image", "text", "text"]
    assert p.content[-1].text == "Briefly."
    only_parts = resolve(params(prompt="", parts=[image_part(b"png")]), LIMITS)
    assert only_parts.prompt == "" and only_parts.content == only_parts.parts
    assert resolve(params(raw_prompt=True, parts=["text only"]), LIMITS).raw_prompt  # no media: no template needed
    assert resolve(params(), LIMITS).parts == ()


def test_negative_prompt_token_ids():
    p = build_request(prompt_token_ids=[1, -2]).params
    with pytest.raises(InvalidRequest, match="params.prompt_token_ids"):
        resolve(p, LIMITS)


def test_unknown_output_modality_in_client():
    with pytest.raises(ValueError, match="unknown output modality 'smell'"):
        build_request("hi", outputs=["smell"])


def test_every_spec_modality_has_one_api_enum_value():
    names = [n for n in orchestrator_pb2.Modality.keys() if n != "MODALITY_UNSPECIFIED"]
    assert sorted(names) == sorted(m.upper() for m in MODALITIES)
    assert build_request("hi", outputs=list(MODALITIES)).outputs == [MODALITY_CODES[m] for m in MODALITIES]


def test_the_text_of_a_turn_is_its_text_parts_then_the_prompt():
    from omnistage.v1 import common_pb2

    def params(prompt, *texts, image=False):
        parts = [common_pb2.ContentPart(text=t) for t in texts]
        if image:
            parts.insert(1, common_pb2.ContentPart(image=common_pb2.ImagePart(data=b"x")))
        return resolve(common_pb2.GenerationParams(prompt=prompt, parts=parts), Limits())

    assert params("Hello").text == "Hello"
    assert params("", "Look ", "here").text == "Look here"
    assert params("now?", "Look ", "and ", image=True).text == "Look and now?"


@pytest.mark.parametrize("temperature, resolved", [(1e-45, None), (1e-6, None), (0.0, None), (2e-5, 2e-5),
                                                   (0.7, 0.7)])
def test_a_vanishing_temperature_is_greedy(temperature, resolved):
    """Dividing logits by 1e-45 overflows: below MIN_TEMPERATURE a request decodes greedily (as vLLM does)
    instead of turning its batch's sampling into NaN."""
    p = resolve(params(temperature=temperature), LIMITS)
    assert p.temperature == (None if resolved is None else pytest.approx(resolved))


def test_sampling_with_a_vanishing_temperature_picks_the_argmax():
    import torch

    from stage_service.runtime.sampling import SamplingSettings, choose, new_generator

    logits = torch.tensor([0.5, 3.0, -1.0, 2.9], dtype=torch.bfloat16)
    for t in (1e-45, 1e-30, 1e-6):
        assert choose(logits, SamplingSettings(temperature=t), new_generator(0)) == 1
