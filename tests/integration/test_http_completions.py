"""`POST /v1/completions` driven by the official `openai` SDK (`client.completions.create`, streamed and not)
against in-process orchestrators over tiny pipelines: the plain LM (llm-tiny on the transformers engine) and
the omni Thinker with text out. A completion is the prompt as written (no chat template): the same answer as
the gRPC door's raw prompt, and a token-id prompt answers as its text does. Bad input is 400 naming the field;
a pipeline without text out is 400 `model`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from omnistage.contract.request import build_request
from orchestrator_service.http_api.completions import MAX_CHOICES
from orchestrator_service.server import OrchestratorServer

from ..harness import example, start_stage
from .test_http_api import IMAGES, TEXT_ONLY, Served, hang_up, serve
from .test_orchestrator_api_port import llm_on_transformers

LM = example("llm-tiny", llm_on_transformers)
PROMPT = "Once upon a time"
MAX_TOKENS_LIMIT = 256  # llm-tiny's maxTokens
GREEDY = dict(max_tokens=8, extra_body={"ignore_eos": True})  # a fixed length: the tiny model's answer is noise


@pytest.fixture(scope="module")
async def servers(model_dir):
    llm = {"llm": await start_stage(LM, "llm", model_dir)}
    thinker = {"thinker": await start_stage(TEXT_ONLY, "thinker", model_dir)}
    served = {"lm": await serve(LM, llm), "thinker": await serve(TEXT_ONLY, thinker)}
    # Images: refused before any stage would run, so no stage is behind it (its endpoints are never called).
    images = OrchestratorServer(IMAGES, {s.name: ["127.0.0.1:9"] for s in IMAGES.stages}, api_port=0)
    await images.start()
    served["images"] = Served(images, {})
    yield served
    for s in served.values():
        await s.orc.drain()
    for s in (*llm.values(), *thinker.values()):
        await s.drain()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir / "qwen2-tiny")


async def grpc_text(served: Served, prompt: str = PROMPT, **kw) -> str:
    """The text the gRPC door's request path answers a raw prompt with."""
    request = build_request(prompt, raw_prompt=True, outputs=["text"], **kw)
    return "".join([ev.text.text async for ev in served.orc.servicer.generate(request)
                    if ev.WhichOneof("event") == "text"])


async def test_a_string_prompt_is_completed_as_written_as_the_grpc_door_completes_it(servers):
    lm = servers["lm"]
    c = await lm.aio().completions.create(model=lm.model, prompt=PROMPT, **GREEDY)
    assert c.object == "text_completion" and c.id.startswith("cmpl-") and c.model == lm.model
    assert len(c.choices) == 1
    choice = c.choices[0]
    assert choice.index == 0 and choice.logprobs is None and choice.finish_reason == "length"
    assert choice.text == await grpc_text(lm, max_tokens=8, ignore_eos=True)
    assert c.usage.completion_tokens == 8 and c.usage.prompt_tokens > 0
    assert c.usage.total_tokens == c.usage.prompt_tokens + 8
    await lm.until_idle()


async def test_a_token_id_prompt_answers_as_its_text_does(servers, tokenizer):
    lm = servers["lm"]
    ids = tokenizer(PROMPT)["input_ids"]
    by_text = await lm.aio().completions.create(model=lm.model, prompt=PROMPT, **GREEDY)
    by_ids = await lm.aio().completions.create(model=lm.model, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens


async def test_the_stream_is_text_completion_chunks_that_join_to_the_whole_answer(servers):
    lm = servers["lm"]
    whole = await lm.aio().completions.create(model=lm.model, prompt=PROMPT, **GREEDY)
    stream = await lm.aio().completions.create(model=lm.model, prompt=PROMPT, stream=True,
                                               stream_options={"include_usage": True}, **GREEDY)
    chunks = [c async for c in stream]
    assert {c.object for c in chunks} == {"text_completion"} and len({c.id for c in chunks}) == 1
    *texts, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert all(c.usage is None for c in texts)
    assert "".join(c.choices[0].text for c in texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in texts][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in texts[:-1])


async def test_the_stream_on_the_wire_ends_with_done_and_has_no_usage_unless_asked(servers):
    lm = servers["lm"]
    body = {"model": lm.model, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{lm.url}/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"]
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all("usage" not in c and c["object"] == "text_completion" for c in chunks)
    assert set(chunks[0]["choices"][0]) == {"text", "index", "logprobs", "finish_reason"}


async def test_a_client_that_hangs_up_mid_stream_leaves_nothing_behind(servers):
    lm = servers["lm"]
    stream = await lm.aio().completions.create(model=lm.model, prompt=PROMPT, stream=True, max_tokens=200,
                                               extra_body={"ignore_eos": True})
    first = await stream.__anext__()
    assert first.object == "text_completion"
    await hang_up(stream)
    await lm.until_idle()


async def test_echo_puts_the_prompt_before_the_answer(servers):
    lm = servers["lm"]
    plain = await lm.aio().completions.create(model=lm.model, prompt=PROMPT, **GREEDY)
    echoed = await lm.aio().completions.create(model=lm.model, prompt=PROMPT, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    stream = await lm.aio().completions.create(model=lm.model, prompt=PROMPT, echo=True, stream=True, **GREEDY)
    assert "".join([c.choices[0].text async for c in stream]) == PROMPT + plain.choices[0].text


async def test_a_stop_string_ends_the_answer_before_it(servers):
    lm = servers["lm"]
    kw = dict(max_tokens=24, extra_body={"ignore_eos": True})
    full = (await lm.aio().completions.create(model=lm.model, prompt=PROMPT, **kw)).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]  # a piece of its middle: the answer ends before it
    assert stop.strip(), f"the tiny model's answer has no stop to pick: {full!r}"
    cut = full[:full.find(stop)]
    c = await lm.aio().completions.create(model=lm.model, prompt=PROMPT, stop=[stop], **kw)
    assert c.choices[0].text == cut and c.choices[0].finish_reason == "stop"
    stream = await lm.aio().completions.create(model=lm.model, prompt=PROMPT, stop=stop, stream=True, **kw)
    chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].text for ch in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"
    await lm.until_idle()


async def test_n_choices_are_n_requests_seeded_seed_plus_i(servers):
    lm = servers["lm"]
    kw = dict(temperature=1.0, **GREEDY)
    each = [(await lm.aio().completions.create(model=lm.model, prompt=PROMPT, seed=40 + i, **kw)).choices[0].text
            for i in range(3)]
    c = await lm.aio().completions.create(model=lm.model, prompt=PROMPT, n=3, seed=40, **kw)
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    assert [ch.text for ch in c.choices] == each
    assert c.usage.completion_tokens == 3 * 8
    await lm.until_idle()


async def test_a_list_of_prompts_is_one_choice_each_in_order(servers, tokenizer):
    lm = servers["lm"]
    prompts = [PROMPT, "The sea", PROMPT]  # the same prompt twice: two prompts all the same
    each = [(await lm.aio().completions.create(model=lm.model, prompt=p, **GREEDY)).choices[0].text for p in prompts]
    c = await lm.aio().completions.create(model=lm.model, prompt=prompts, **GREEDY)
    assert [(ch.index, ch.text) for ch in c.choices] == list(enumerate(each))
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    c = await lm.aio().completions.create(model=lm.model, prompt=ids, n=2, **GREEDY)
    assert [(ch.index, ch.text) for ch in c.choices] == list(enumerate([t for t in each for _ in range(2)]))
    assert c.usage.prompt_tokens == sum(map(len, ids))  # each prompt counted once, as the reference does


async def test_the_omni_thinker_completes_text(servers):
    thinker = servers["thinker"]
    c = await thinker.aio().completions.create(model=thinker.model, prompt=PROMPT, **GREEDY)
    assert c.choices[0].text and c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 8
    assert c.choices[0].text == await grpc_text(thinker, max_tokens=8, ignore_eos=True)
    await thinker.until_idle()


@pytest.mark.parametrize("kw, param", [
    (dict(logprobs=1), "logprobs"),
    (dict(logprobs=0), "logprobs"),
    (dict(suffix="the end"), "suffix"),
    (dict(best_of=2), "best_of"),
    (dict(logit_bias={"50": 10}), "logit_bias"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(frequency_penalty=0.5), "frequency_penalty"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=["a", ""]), "prompt[1]"),
    (dict(prompt=[[1, 2], []]), "prompt[1]"),
    (dict(prompt=[1, -1]), "prompt[1]"),
    (dict(prompt=[1, 10 ** 9]), "prompt"),  # past the tiny model's vocabulary: the stage says so
    (dict(prompt=[1, 2], echo=True), "echo"),
    (dict(max_tokens=MAX_TOKENS_LIMIT + 1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(n=MAX_CHOICES + 1), "n"),
    (dict(prompt=["a"] * 3, n=MAX_CHOICES // 2), "n"),
    (dict(n=2, stream=True), "stream"),
    (dict(prompt=["a", "b"], stream=True), "stream"),
])
async def test_bad_input_is_400_naming_the_field(servers, kw, param):
    lm = servers["lm"]
    with pytest.raises(openai.BadRequestError) as e:
        await lm.aio().completions.create(**{"model": lm.model, "prompt": PROMPT, "max_tokens": 2, **kw})
    assert e.value.param == param and e.value.type == "invalid_request_error", e.value.message


async def test_a_prompt_of_the_wrong_type_is_400_prompt(servers):
    lm = servers["lm"]
    async with httpx.AsyncClient(timeout=60) as http:
        for prompt in (5, [1.5], [["a"]], {"text": "hi"}, None):
            r = await http.post(f"{lm.url}/completions", json={"model": lm.model, "prompt": prompt})
            assert r.status_code == 400, (prompt, r.text)
            assert r.json()["error"]["param"].startswith("prompt"), (prompt, r.text)
        r = await http.post(f"{lm.url}/completions", json={"model": lm.model})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


async def test_a_pipeline_without_text_out_is_400_model_and_another_model_404(servers):
    images = servers["images"]
    with pytest.raises(openai.BadRequestError) as e:
        await images.aio().completions.create(model=images.model, prompt=PROMPT)
    assert e.value.param == "model" and "image" in e.value.message
    lm = servers["lm"]
    with pytest.raises(openai.NotFoundError):
        await lm.aio().completions.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT)


async def test_nothing_is_left_after_all_of_it(servers):
    await servers["lm"].until_idle()
    await servers["thinker"].until_idle()
