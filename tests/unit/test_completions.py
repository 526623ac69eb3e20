"""The completions translation (pure): a body -> one request per choice, in the reference's order, with the
prompt as written; refusals name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnistage.api import load_pipeline
from omnistage.contract.modalities import MODALITY_CODES
from omnistage.contract.params import InvalidRequest
from orchestrator_service.http_api import completions
from orchestrator_service.http_api.body_limits import json_values
from orchestrator_service.http_api.errors import from_exception

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LM = load_pipeline(str(EXAMPLES / "llm-tiny.yaml"))
IMAGES = load_pipeline(str(EXAMPLES / "text-to-image-tiny.yaml"))


def body(**kw) -> completions.CompletionRequest:
    return completions.bounded(LM.limits).model_validate_json(json.dumps({"prompt": "hi", **kw}), strict=True)


def translate(**kw) -> list[completions.ChoicePlan]:
    return completions.translate(body(**kw), LM, random_seed=lambda: 1000)


def test_a_text_prompt_is_one_raw_request_for_text():
    [plan] = translate(max_tokens=5, temperature=0.5, top_p=0.9, stop="x", seed=3)
    p = plan.request.params
    assert p.prompt == "hi" and p.raw_prompt and not p.system_prompt and not p.prompt_token_ids
    assert list(plan.request.outputs) == [MODALITY_CODES["text"]]
    assert (p.text.max_tokens, p.seed, plan.stops, plan.index, plan.echo) == (5, 3, ("x",), 0, "")
    assert p.text.temperature == pytest.approx(0.5) and p.text.top_p == pytest.approx(0.9)
    assert not translate()[0].request.params.text.HasField("temperature")  # unset: greedy, as chat


def test_token_ids_are_sent_as_given():
    [plan] = translate(prompt=[5, 0, 7])
    assert list(plan.request.params.prompt_token_ids) == [5, 0, 7] and plan.request.params.prompt == ""
    assert plan.fields["params.prompt_token_ids"] == "prompt"


@pytest.mark.parametrize("kw, expected", [
    (dict(prompt=["a", "b"], n=2, seed=7), [("a", 7, 0), ("a", 8, 1), ("b", 7, 2), ("b", 8, 3)]),
    (dict(n=3), [("hi", 1000, 0), ("hi", 1001, 1), ("hi", 1002, 2)]),  # a random base seed: choices differ
    (dict(prompt=["a", "b"]), [("a", None, 0), ("b", None, 1)]),  # one choice each: the pipeline's seed
])
def test_choices_are_prompt_by_prompt_n_each_seeded_seed_plus_j(kw, expected):
    plans = translate(**kw)
    got = [(p.request.params.prompt, p.request.params.seed if p.request.params.HasField("seed") else None, p.index)
           for p in plans]
    assert got == expected
    if isinstance(kw.get("prompt"), list):
        assert [p.fields["params.prompt"] for p in plans][-1] == f"prompt[{len(kw['prompt']) - 1}]"


def test_echo_carries_the_prompt_text():
    assert [p.echo for p in translate(prompt=["a", "b"], echo=True)] == ["a", "b"]


@pytest.mark.parametrize("kw, param", [
    (dict(logprobs=0), "logprobs"), (dict(suffix="x"), "suffix"), (dict(best_of=3), "best_of"),
    (dict(logit_bias={"1": 1}), "logit_bias"), (dict(presence_penalty=1), "presence_penalty"),
    (dict(frequency_penalty=-1), "frequency_penalty"), (dict(prompt=""), "prompt"), (dict(prompt=[]), "prompt"),
    (dict(prompt=[[1], []]), "prompt[1]"), (dict(prompt=[1], echo=True), "echo"),
    (dict(n=completions.MAX_CHOICES + 1), "n"), (dict(n=2, stream=True), "stream"),
    (dict(stop=["a"] * 5), "stop"), (dict(stop=["a", ""]), "stop[1]"), (dict(model="other"), "model"),
])
def test_refusals_name_the_field(kw, param):
    with pytest.raises(Exception) as e:
        translate(**kw)
    assert from_exception(e.value).param == param


@pytest.mark.parametrize("kw", [dict(best_of=1), dict(logit_bias={}), dict(presence_penalty=0), dict(logprobs=None),
                                dict(suffix=None), dict(user="me")])
def test_fields_set_to_ask_for_nothing_pass(kw):
    assert len(translate(**kw)) == 1


def test_a_pipeline_without_text_out_is_refused_naming_model():
    with pytest.raises(InvalidRequest) as e:
        completions.translate(body(), IMAGES)
    assert e.value.field == "model" and "image" in str(e.value)


@pytest.mark.parametrize("prompt, param", [(5, "prompt"), ([1.5], "prompt[0]"), ([["a"]], "prompt[0][0]"),
                                           ([1, -1], "prompt[1]"), ([1, 2**31], "prompt[1]")])
def test_a_prompt_of_the_wrong_type_names_it(prompt, param):
    with pytest.raises(Exception) as e:
        body(prompt=prompt)
    assert from_exception(e.value).param == param


def test_the_longest_prompts_fit_the_body_bounds():
    limits = LM.limits
    bounds = completions.body_bounds(limits)
    most = {"prompt": [[2**31 - 1] * limits.max_prompt_chars] * completions.MAX_CHOICES}
    raw = json.dumps(most).encode()
    assert len(raw) <= bounds.size and json_values(raw) <= bounds.values
    escaped = json.dumps({"prompt": ["\U0001F600" * limits.max_prompt_chars] * completions.MAX_CHOICES}).encode()
    assert len(escaped) <= bounds.size and escaped.count(b"\\") <= bounds.escapes
