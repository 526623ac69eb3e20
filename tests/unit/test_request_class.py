"""A request's class (orchestrator_service/request_class.py): its input and output modalities, in one fixed
order, from a fixed vocabulary whatever the client sends."""

from __future__ import annotations

import pytest

from omnistage.api import MODALITIES, Limits
from omnistage.client import audio_part, build_request, image_part, text_part, video_file_part
from omnistage.contract.params import resolve
from orchestrator_service.request_class import MODALITY_ORDER, request_class

IMAGE, AUDIO, VIDEO = image_part(b"png"), audio_part(b"wav"), video_file_part(b"mp4")


def resolved(prompt: str = "", **kw):
    return resolve(build_request(prompt, **kw).params, Limits())


@pytest.mark.parametrize("request_kw, outputs, expected", [
    (dict(prompt="hi"), ["text"], "text->text"),
    (dict(prompt="hi"), ["text", "audio"], "text->text+audio"),
    (dict(prompt="hi"), ["audio", "text"], "text->text+audio"),  # the order asked for does not matter
    (dict(prompt="a cat"), ["image"], "text->image"),
    (dict(prompt_token_ids=[5, 6]), ["text"], "text->text"),  # a prompt as token ids is text
    (dict(prompt="what is this?", parts=[IMAGE]), ["text"], "text+image->text"),
    (dict(parts=[IMAGE, text_part("what is this?")]), ["text"], "text+image->text"),  # text as a part
    (dict(parts=[AUDIO]), ["text", "audio"], "audio->text+audio"),  # no text at all
    (dict(prompt="hi", parts=[VIDEO, AUDIO, IMAGE, AUDIO]), ["audio", "text"], "text+image+audio+video->text+audio"),
    (dict(prompt="hi"), [], "text->"),
])
def test_the_class_names_inputs_then_outputs_in_one_order(request_kw, outputs, expected):
    assert request_class(resolved(**request_kw), outputs) == expected


def test_every_output_modality_of_the_spec_has_its_place_in_the_order():
    assert set(MODALITIES) <= set(MODALITY_ORDER)


def test_the_classes_are_bounded_whatever_the_request_holds():
    """Many prompts and part sequences, one class each from 15 input sets: none is made of what was sent."""
    parts = [IMAGE, AUDIO, VIDEO, text_part("x")]
    seen = set()
    for mask in range(1, 1 << len(parts)):
        chosen = [p for i, p in enumerate(parts) if mask >> i & 1]
        for prompt in ("", "hello", "->text"):
            if chosen or prompt:
                seen.add(request_class(resolved(prompt, parts=chosen * 2), ["text"]))
    inputs = {c.split("->")[0] for c in seen}
    assert len(seen) == len(inputs) <= 15 and all(set(i.split("+")) <= set(MODALITY_ORDER) for i in inputs)
