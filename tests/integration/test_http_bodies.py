"""Hostile request bodies through the HTTP API's ASGI app (the body reading of
orchestrator_service/http_api/routes.py), each piece fed as a client would send it: JSON shapes that cost far
more memory than their bytes are refused before they are built, a refusal reports a few errors (never one per
item), a huge JSON number is refused cheaply, a body drip-fed slower than the minimum rate is cut by its total
deadline, and one client address cannot hold the whole body budget."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import tracemalloc

import pytest

from omnistage.api import load_pipeline
from orchestrator_service.http_api import routes

from ..conftest import EXAMPLES
from ..unit.test_http_body import CHAT, CHAT_BODY, Client
from ..unit.test_http_call import ScriptedPath, text

OMNI = load_pipeline(EXAMPLES / "qwen3-omni-tiny.yaml")
# Limits that admit a chat body of a few MiB (two media parts of 2 MiB in base64), so that shapes of
# many small values fit under the size limit.
MEDIA = dataclasses.replace(OMNI, limits=dataclasses.replace(OMNI.limits, max_prompt_chars=1000, max_parts=2,
                                                             max_part_bytes=2 << 20))
ROLE_ITEMS = 200_000  # `{"role":1},` items: 2.2 MB of JSON, one validation error each on an unbounded schema
# Python memory a refused body may take beyond its own bytes: a few times the body (the body, its string
# values), never one object per item.
PEAK_OVER_BODY = 3


def app(pipeline=MEDIA):
    return routes.build_app(ScriptedPath([text("hello")]), pipeline)


async def traced_answer(client_app, path: str, body: bytes) -> tuple[tuple[int, dict, dict | None], int]:
    """The answer to `body` and the peak of Python memory allocated while it was read, parsed and refused."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        answer = await Client(client_app, path).send(body)
        return answer, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def openai_error(body: dict | None) -> dict:
    assert body is not None and set(body) == {"error"}, body
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("shape", ["invalid items", "valid items", "ignored field"])
async def test_many_small_values_are_refused_before_they_are_built(shape):
    items = {
        "invalid items": b'{"messages":[' + b'{"role":1},' * ROLE_ITEMS + b'{"role":1}]}',
        "valid items": b'{"messages":[' + b'{"role":"system","content":"x"},' * (ROLE_ITEMS // 3) +
                       b'{"role":"user","content":"hi"}]}',
        "ignored field": b'{"messages":[{"role":"user","content":"hi"}],"extra":[' + b'[],' * ROLE_ITEMS + b'[]]}',
    }[shape]
    assert len(items) < routes.chat_body_limit(MEDIA.limits)  # not refused for its size
    (status, _, body), peak = await traced_answer(app(), CHAT, items)
    error = openai_error(body)
    assert status in (400, 413), body
    assert len(error["message"]) < 1000  # a few errors named, not one per item
    assert peak < PEAK_OVER_BODY * len(items), f"{peak} bytes of Python memory for a body of {len(items)}"


async def test_a_validation_error_names_a_few_of_the_errors():
    # Within every count bound (schema and pre-scan): still many errors, of which a few are named.
    parts = [{"type": 1, "text": 2}] * MEDIA.limits.max_parts
    body = json.dumps({"messages": [{"role": 1, "content": parts, "name": 3}] * 8, "model": 4, "stop": 5}).encode()
    status, _, answer = await Client(app(), CHAT).send(body)
    error = openai_error(answer)
    assert status == 400 and error["param"] and len(error["message"]) < 1000


@pytest.mark.parametrize("where", ["seed", "extra"])
async def test_a_json_number_of_a_million_digits_is_refused_cheaply(where):
    body = b'{"messages":[{"role":"user","content":"hi"}],"' + where.encode() + b'":' + b"9" * 1_000_000 + b"}"
    (status, _, answer), peak = await traced_answer(app(), CHAT, body)
    error = openai_error(answer)
    assert status == 400 and "number" in error["message"]
    assert peak < PEAK_OVER_BODY * len(body)


async def test_the_chat_limit_is_the_parts_at_their_largest_in_base64():
    limits = MEDIA.limits
    limit = routes.chat_body_limit(limits)
    assert limit >= limits.max_parts * (limits.max_part_bytes * 4 // 3)
    # and not a megabyte of room on top of it: what a pipeline with small parts takes stays small
    small = dataclasses.replace(limits, max_parts=1, max_part_bytes=1000)
    assert routes.chat_body_limit(small) < 256 << 10


async def test_a_body_at_the_size_limit_with_parts_at_their_largest_is_read():
    # the honest bound: a request the limits admit is not refused for its size or its shape
    limits = MEDIA.limits
    data = base64.b64encode(bytes(limits.max_part_bytes)).decode()
    parts = [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}] * (limits.max_parts - 1)
    parts.append({"type": "text", "text": ",:[" * (limits.max_prompt_chars // 3)})
    body = json.dumps({"messages": [{"role": "system", "content": "[,:]" * (limits.max_prompt_chars // 4)},
                                    {"role": "user", "content": parts}]}).encode()
    assert len(body) <= routes.chat_body_limit(limits)
    status, _, answer = await Client(app(), CHAT).send(body)
    assert status == 200, answer


async def test_a_drip_fed_body_is_cut_by_its_total_deadline(monkeypatch):
    # The idle bound between pieces is never reached: a piece comes every few milliseconds, but the body as a
    # whole comes far slower than the minimum rate.
    monkeypatch.setattr(routes, "BODY_BASE_S", 0.2)
    monkeypatch.setattr(routes, "BODY_MIN_RATE", 1000)
    client = Client(app(), CHAT)
    client.piece(b'{"messages": [{"role": "user", "content": "')
    for _ in range(2000):  # at most about 20 s: a safety bound, the deadline comes long before
        if client.task.done():
            break
        client.piece(b"x")
        await asyncio.sleep(0.01)
    client.piece(b'"}]}', more=False)
    status, headers, body = await client.answer()
    error = openai_error(body)
    assert status == 408 and error["code"] == "request_timeout" and "bytes/s" in error["message"], body
    assert headers.get("connection") == "close"


async def test_one_client_cannot_hold_the_whole_body_budget():
    a = app()
    limit = routes.chat_body_limit(MEDIA.limits)
    holding = []
    for _ in range(routes.BODIES_AT_ONCE):  # one address sends as many bodies as the budget holds
        c = Client(a, CHAT)
        c.piece(b" " * (limit - 1000))
        holding.append(c)
    done = await asyncio.wait_for(asyncio.gather(*(_read_or_answered(c) for c in holding)), 10)
    refused = [c for c, answered in zip(holding, done) if answered]
    assert len(refused) >= 1  # that address may not hold it all
    status, headers, body = await refused[0].answer()
    error = openai_error(body)
    assert status == 429 and headers["retry-after"] and "127.0.0.1" in error["message"], body
    # another client gets through while the first still holds its share
    other = Client(a, CHAT, client=("127.0.0.2", 1))
    status, _, body = await other.send(b" " * (limit - 1000) + CHAT_BODY)
    assert status == 200, body
    for c in holding:
        if not c.task.done():
            c.hang_up()
            assert (await c.answer())[0] == 499


async def _read_or_answered(c: Client) -> bool:
    """Wait until the piece fed to `c` was read (False) or `c` was answered (True)."""
    while not c.task.done() and not c.messages.empty():
        await asyncio.sleep(0.01)
    return c.task.done()


@pytest.mark.parametrize("field,body", [
    ("messages[0].content", {"messages": [{"role": "user", "content": "x" * 1001}]}),
    ("messages[0].content[0].text", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x" * 1001}]}]}),
    ("messages[0].content[0].input_audio.data", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "A" * ((2 << 20) * 4 // 3 + 4)}}]}]}),
])
async def test_a_string_past_the_pipelines_limit_is_refused_as_it_is_parsed(field, body):
    # before the request path: the scripted one behind this app checks nothing, and would answer 200
    status, _, answer = await Client(app(), CHAT).send(json.dumps(body).encode())
    error = openai_error(answer)
    assert status == 400 and error["param"] == field and "at most" in error["message"], answer


async def test_a_body_of_escapes_is_refused_before_it_is_parsed():
    # the slowest JSON to read (twelve bytes a character): text may hold two escapes a character at most, media
    # parts the share of their base64 that encoders escape
    pairs = routes.chat_bounds(MEDIA.limits).escapes // 2 + 1
    body = b'{"messages":[{"role":"user","content":"' + b"\\ud83d\\ude00" * pairs + b'"}]}'
    assert len(body) < routes.chat_body_limit(MEDIA.limits)
    status, _, answer = await Client(app(), CHAT).send(body)
    error = openai_error(answer)
    assert status == 400 and error["code"] == "too_many_escapes", answer
    # the most a request's text may hold passes
    text = "\U0001F600" * MEDIA.limits.max_prompt_chars
    body = json.dumps({"messages": [{"role": "system", "content": text}, {"role": "user", "content": text}]}).encode()
    assert (await Client(app(), CHAT).send(body))[0] == 200
