"""Tool calls read from the model's text as it streams (orchestrator_service/tool_calls.py): the same text
and calls whatever the deltas' boundaries, arguments as written, and blocks that are not calls kept as text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator_service.tool_calls import CallArguments, CallStarted, TextPiece, ToolCallStream, call_prefix

TWO_CALLS = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET", "fmt": {"h": 24}}}\n</tool_call>')


def read(chunks: list[str], **kw) -> tuple[str, list[tuple[str, str]], list]:
    """The text, the (name, arguments) of each call as the events built them, and the events."""
    s = ToolCallStream(**kw)
    events = [e for c in chunks for e in s.feed(c)] + s.close()
    text = "".join(e.text for e in events if isinstance(e, TextPiece))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, CallStarted):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArguments):
            calls[e.index][1] += e.fragment
    built = [(n, a) for n, a in (calls[i] for i in sorted(calls))]
    assert built == [(c.name, c.arguments) for c in s.calls]   # the events add up to the calls kept
    assert text == s.text
    return text, built, events


def test_text_and_two_calls_are_read_apart():
    text, calls, events = read([TWO_CALLS])
    assert text == "Let me check.\n"
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET", "fmt": {"h": 24}}')]
    assert [json.loads(a) for _, a in calls] == [{"city": "Paris"}, {"tz": "CET", "fmt": {"h": 24}}]
    starts = [e for e in events if isinstance(e, CallStarted)]
    assert [e.index for e in starts] == [0, 1] and all(e.id.startswith("call_") for e in starts)
    assert len({e.id for e in starts}) == 2


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(TWO_CALLS)), max_size=12))
def test_any_split_into_deltas_reads_the_same(cuts):
    bounds = [0, *sorted(cuts), len(TWO_CALLS)]
    chunks = [TWO_CALLS[a:b] for a, b in zip(bounds, bounds[1:])]
    text, calls, _ = read(chunks)
    assert (text, calls) == read([TWO_CALLS])[:2]


def test_one_character_at_a_time_streams_the_arguments_before_the_call_closes():
    s = ToolCallStream()
    seen = []
    for ch in TWO_CALLS[:TWO_CALLS.index("}}") + 1]:   # up to the arguments' own closing brace
        seen += s.feed(ch)
    args = "".join(e.fragment for e in seen if isinstance(e, CallArguments) and e.index == 0)
    assert args == '{"city": "Paris"'      # the last } may still close the call: held back until decided
    assert any(isinstance(e, CallStarted) and e.name == "get_weather" for e in seen)


def test_a_block_that_is_not_a_call_is_text():
    text, calls, _ = read(["Use <tool_call>this is not json</tool_call> and go"])
    assert calls == [] and text == "Use <tool_call>this is not json</tool_call> and go"


def test_a_partial_opening_tag_at_the_end_is_text():
    text, calls, _ = read(["a <tool_c"])
    assert (text, calls) == ("a <tool_c", [])


def test_an_answer_cut_short_inside_a_call_keeps_what_was_read():
    text, calls, _ = read(['<tool_call>\n{"name": "f", "arguments": {"x": [1, 2'])
    assert calls == [("f", '{"x": [1, 2')] and text == ""


def test_a_forced_call_reads_the_prefix_as_the_models_own_text():
    text, calls, _ = read(['{"city": "Rome"}}\n</tool_call>'], prefix=call_prefix("get_weather"))
    assert calls == [("get_weather", '{"city": "Rome"}')] and text == ""
    text, calls, _ = read(['get_time", "arguments": {}}\n</tool_call>'], prefix=call_prefix(None))
    assert calls == [("get_time", "{}")]


def test_max_calls_stops_reading_after_the_last_allowed_call():
    s = ToolCallStream(max_calls=1)
    events = s.feed(TWO_CALLS) + s.close()
    assert [c.name for c in s.calls] == ["get_weather"] and s.done
    assert not any(isinstance(e, CallStarted) and e.name == "get_time" for e in events)


@pytest.mark.parametrize("name", ['we"ird', "a\\b"])
def test_names_are_json_strings(name):
    block = '<tool_call>{"name": ' + json.dumps(name) + ', "arguments": {}}</tool_call>'
    _, calls, _ = read([block])
    assert calls == [(name, "{}")]


@pytest.mark.parametrize("literal", ['"a\\x"', '"a\nb"', '""'])
def test_a_name_json_does_not_allow_makes_the_block_text_not_a_failure(literal):
    block = '<tool_call>{"name": ' + literal + ', "arguments": {}}</tool_call> after'
    text, calls, _ = read([block])
    assert calls == [] and text == block
