"""Conversations and tools on the OpenAI chat API, driven by the official `openai` SDK against a real
orchestrator over the tiny Qwen3-Omni stages: the second turn of a chat, an earlier spoken answer referred
to by its audio id, tools offered and a named tool call read out of the model's text (streamed as
`delta.tool_calls`), tool results fed back, and a conversation over the model's context refused by name.

The tiny model's weights are random: what it writes after a forced call's opening is not JSON, so these
tests check the path and the shapes (the parser's reading of finished calls is tests/unit/test_tool_calls.py)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from ..harness import example, start_stage
from .test_http_api import AUDIO, serve, thinker_only

OMNI = example("qwen3-omni-tiny")


def short_context(doc: dict) -> None:
    """The Thinker alone, with a context of 96 positions: a few turns fill it."""
    thinker_only(doc)
    doc["spec"]["deployment"]["stages"]["thinker"]["engineArgs"] = {"max_model_len": 96}
    doc["spec"]["topology"]["limits"].update(maxTokens=64, defaultMaxTokens=4)


SHORT = example("qwen3-omni-tiny", short_context)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
async def servers(model_dir):
    stages = {n: await start_stage(OMNI, n, model_dir) for n in ("thinker", "talker", "code2wav")}
    short = await start_stage(SHORT, "thinker", model_dir)
    served = {"omni": await serve(OMNI, stages), "short": await serve(SHORT, {"thinker": short})}
    yield served
    for s in served.values():
        await s.orc.drain()
    for s in (*stages.values(), short):
        await s.drain()


def create(served, **kw):
    return asyncio.to_thread(lambda: served.sync().chat.completions.create(model=served.model, **kw))


async def test_a_second_turn_sees_the_first_and_an_earlier_audio_answer_by_its_id(servers):
    omni = servers["omni"]
    first = await create(omni, messages=[{"role": "user", "content": "Hello there"}],
                         audio={"voice": "ethan", "format": "wav"}, **AUDIO)
    said = first.choices[0].message
    assert said.audio.id and said.audio.transcript == said.content
    history = [{"role": "user", "content": "Hello there"}]
    ask = {"role": "user", "content": "And again?"}
    by_id = await create(omni, messages=[*history, {"role": "assistant", "audio": {"id": said.audio.id}}, ask],
                         max_tokens=4)
    by_text = await create(omni, messages=[*history, {"role": "assistant", "content": said.content}, ask],
                           max_tokens=4)
    alone = await create(omni, messages=[ask], max_tokens=4)
    # The audio id stands for what the answer said: the same prompt as its text written out.
    assert by_id.usage.prompt_tokens == by_text.usage.prompt_tokens > alone.usage.prompt_tokens
    assert by_id.choices[0].message.content == by_text.choices[0].message.content
    await omni.until_idle()


async def test_an_unknown_audio_id_is_refused_naming_it(servers):
    omni = servers["omni"]
    with pytest.raises(openai.BadRequestError) as e:
        await create(omni, messages=[{"role": "user", "content": "Hi"},
                                     {"role": "assistant", "audio": {"id": "audio_not_ours"}},
                                     {"role": "user", "content": "Again"}])
    assert e.value.body["param"] == "messages[1].audio.id" and "unknown or expired" in e.value.body["message"]
    await omni.until_idle()


async def test_a_named_tool_choice_comes_back_as_a_tool_call_streamed_or_not(servers):
    omni = servers["omni"]
    kw = dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], tool_choice=FORCED,
              max_tokens=8, seed=3)
    whole = await create(omni, **kw)
    message = whole.choices[0].message
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert whole.choices[0].finish_reason in ("tool_calls", "length")

    def streamed():
        calls: dict[int, dict] = {}
        for chunk in omni.sync().chat.completions.create(model=omni.model, stream=True, **kw):
            for choice in chunk.choices:
                for d in choice.delta.tool_calls or []:
                    got = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                    got["arguments"] += d.function.arguments or ""
                    if d.id:   # the name comes once, with the id, before any argument fragment
                        assert d.function.name and got["arguments"] == ""
        return calls

    calls = await asyncio.to_thread(streamed)
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert calls[0]["arguments"] == call.function.arguments   # greedy: the same fragments as the whole
    await omni.until_idle()


async def test_tool_results_fed_back_are_part_of_the_prompt(servers):
    omni = servers["omni"]
    asked = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    fed = await create(omni, messages=[*asked, {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}],
                       tools=[WEATHER], max_tokens=4)
    longer = await create(omni, messages=[*asked, {"role": "tool", "tool_call_id": "call_1",
                                                   "content": "sunny, 21C, light wind from the west"}],
                          tools=[WEATHER], max_tokens=4)
    assert longer.usage.prompt_tokens > fed.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:   # a result for a call never made
        await create(omni, messages=[{"role": "user", "content": "Hi"},
                                     {"role": "tool", "tool_call_id": "call_9", "content": "x"}])
    assert e.value.body["param"] == "messages[1].tool_call_id"
    await omni.until_idle()


async def test_a_tool_whose_parameters_are_not_json_schema_is_400_naming_it(servers):
    omni = servers["omni"]
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                         "properties": {"x": {"type": 7}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        await create(omni, messages=[{"role": "user", "content": "Hi"}], tools=[bad])
    assert e.value.body["param"] == "tools[0].function.parameters"
    assert "not a JSON Schema" in e.value.body["message"]


async def test_a_conversation_over_the_context_is_400_naming_messages(servers):
    short = servers["short"]
    turns = []
    for i in range(12):
        turns += [{"role": "user", "content": f"Question number {i} about the sea and the sky"},
                  {"role": "assistant", "content": f"Answer number {i} about the sea and the sky"}]
    with pytest.raises(openai.BadRequestError) as e:
        await create(short, messages=[*turns, {"role": "user", "content": "And now?"}])
    assert e.value.body["param"] == "messages" and "the model's length is 96" in e.value.body["message"]
    ok = await create(short, messages=[*turns[-2:], {"role": "user", "content": "And now?"}])
    assert ok.usage.prompt_tokens < 96
    await short.until_idle()
