"""The one prompt policy of every text-in engine (stage_service/runtime/chat.py): which token ids a
request's prompt becomes, and where a checkpoint's chat template is found."""

from __future__ import annotations

import dataclasses
import json

import jinja2
import pytest

from omnistage.api import Limits
from omnistage.checkpoints.shards import CheckpointError
from omnistage.client import build_request
from omnistage.contract.params import InvalidRequest, resolve
from stage_service.runtime.chat import load_chat_template, prompt_ids

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
BOS = 1  # the stand-in tokenizer's special token, put in front of text it encodes with special tokens


class Chars:
    """A stand-in tokenizer: one id per character; renders chat templates as transformers does (jinja)."""

    chat_template = None
    added_tokens_decoder: dict = {}  # no special tokens of its own: split or not, text is its characters

    def __call__(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> dict:
        return {"input_ids": ([BOS] if add_special_tokens else []) + [ord(c) for c in text]}

    def apply_chat_template(self, messages, chat_template, tokenize, add_generation_prompt):
        assert not tokenize
        return jinja2.Template(chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt)


def params(prompt: str = "Hi", **fields):
    # The fields are set after resolve: resolve itself refuses some combinations the engines must refuse too.
    return dataclasses.replace(resolve(build_request(prompt).params, Limits()), **fields)


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.mark.parametrize("fields,template,default_system,want", [
    ({}, TEMPLATE, "", chars("<user>Hi<assistant>")),
    (dict(system_prompt="Be brief."), TEMPLATE, "", chars("<system>Be brief.<user>Hi<assistant>")),
    ({}, TEMPLATE, "Speak.", chars("<system>Speak.<user>Hi<assistant>")),
    (dict(system_prompt="Be brief."), TEMPLATE, "Speak.", chars("<system>Be brief.<user>Hi<assistant>")),
    (dict(raw_prompt=True), TEMPLATE, "Speak.", [BOS, *chars("Hi")]),
    ({}, None, "Speak.", [BOS, *chars("Hi")]),  # no template: the prompt as written, no default system turn
    (dict(prompt_token_ids=(7, 8)), TEMPLATE, "Speak.", [7, 8]),
    (dict(prompt_token_ids=(7, 8), raw_prompt=True), None, "", [7, 8]),
])
def test_prompt_ids(fields, template, default_system, want):
    assert prompt_ids(params(**fields), Chars(), template, default_system) == want


@pytest.mark.parametrize("fields,template,why", [
    (dict(system_prompt="Be brief."), None, "this model has no chat template"),
    (dict(system_prompt="Be brief.", raw_prompt=True), TEMPLATE, "raw_prompt is set"),
])
def test_a_system_prompt_without_a_template_to_place_it_in_is_refused(fields, template, why):
    with pytest.raises(InvalidRequest, match=f"params.system_prompt.*{why}"):
        prompt_ids(params(**fields), Chars(), template)


def test_the_template_is_found_where_the_processor_finds_it(tmp_path):
    tokenizer = Chars()
    assert load_chat_template(tmp_path, tokenizer) is None
    tokenizer.chat_template = "from the tokenizer"
    assert load_chat_template(tmp_path, tokenizer) == "from the tokenizer"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "legacy"}))
    assert load_chat_template(tmp_path, tokenizer) == "legacy"
    (tmp_path / "chat_template.jinja").write_text("jinja")
    assert load_chat_template(tmp_path, tokenizer) == "jinja"


def test_a_legacy_template_file_without_a_template_is_refused(tmp_path):
    (tmp_path / "chat_template.json").write_text(json.dumps({"template": "x"}))
    with pytest.raises(CheckpointError, match="chat_template.json: no chat_template string"):
        load_chat_template(tmp_path, Chars())
