"""Reading request bodies (orchestrator_service/http_api/routes.py) through the ASGI app itself, no server:
each endpoint's size bound, the byte budget shared by bodies read at once (always given back), the idle
bound between pieces, a client gone mid-body, and large bodies parsed off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading

import pytest

from omnistage.api import load_pipeline
from orchestrator_service.http_api import routes, translate

from ..conftest import EXAMPLES
from ..polling import wait_until
from .test_http_call import ScriptedPath, text

OMNI = load_pipeline(EXAMPLES / "qwen3-omni-tiny.yaml")
# Small limits: a chat body of about 80 KiB at most, a speech body of about 76 KiB.
SMALL = dataclasses.replace(OMNI, limits=dataclasses.replace(OMNI.limits, max_prompt_chars=1000, max_parts=1,
                                                             max_part_bytes=1000))
CHAT = "/v1/chat/completions"
SPEECH = "/v1/audio/speech"
CHAT_BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


class Client:
    """One HTTP request to the app: the test feeds the body's pieces (or a disconnect) as it likes."""

    def __init__(self, app, path: str, headers: dict[str, str] = {}, client: tuple[str, int] = ("127.0.0.1", 1)):
        self.messages: asyncio.Queue = asyncio.Queue()
        self.sent: list[dict] = []
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json")] +
                 [(k.lower().encode(), v.encode()) for k, v in headers.items()],
                 "client": client, "server": ("127.0.0.1", 80)}

        async def send(message):
            self.sent.append(message)

        self.task = asyncio.create_task(app(scope, self.messages.get, send))

    def piece(self, data: bytes, more: bool = True) -> None:
        self.messages.put_nowait({"type": "http.request", "body": data, "more_body": more})

    def hang_up(self) -> None:
        self.messages.put_nowait({"type": "http.disconnect"})

    async def answer(self) -> tuple[int, dict, dict | None]:
        """(status, headers, JSON body or None)."""
        await asyncio.wait_for(self.task, 10)
        start = self.sent[0]
        headers = {k.decode(): v.decode() for k, v in start["headers"]}
        body = b"".join(m.get("body", b"") for m in self.sent[1:])
        return start["status"], headers, json.loads(body) if body else None

    async def send(self, body: bytes) -> tuple[int, dict, dict | None]:
        self.piece(body, more=False)
        return await self.answer()


def app(pipeline=SMALL, servicer=None):
    return routes.build_app(servicer or ScriptedPath([text("hello")]), pipeline)


async def test_speech_and_images_take_text_sized_bodies_chat_media_sized():
    a = app()
    limit = routes.text_body_limit(SMALL.limits)
    assert limit < routes.chat_body_limit(SMALL.limits)
    big = b" " * (limit + 1)
    for path in (SPEECH, "/v1/images/generations"):
        status, _, body = await Client(a, path).send(big)
        assert status == 413 and body["error"]["code"] == "request_too_large" and str(limit) in body["error"]["message"]
    status, _, body = await Client(a, CHAT).send(big + CHAT_BODY)  # read whole, then parsed
    assert status == 200 and body["choices"][0]["message"]["content"] == "hello"


async def test_bodies_read_at_once_share_a_budget_that_is_always_given_back(monkeypatch):
    monkeypatch.setattr(routes, "BODIES_AT_ONCE", 1)
    a = app()
    most = routes.chat_body_limit(SMALL.limits)
    holding = Client(a, CHAT)
    holding.piece(b" " * (most - 1000))  # most of the budget, and more to come
    await wait_until(holding.messages.empty, what="the piece read")  # taken from the budget as it is read
    status, headers, body = await Client(a, CHAT).send(b" " * 2000 + CHAT_BODY)
    assert status == 429 and headers["retry-after"] == "1" and body["error"]["type"] == "rate_limit_error"
    holding.hang_up()
    assert (await holding.answer())[0] == 499  # never sent: nobody is listening
    status, _, _ = await Client(a, CHAT).send(b" " * (most - 1000) + CHAT_BODY)  # the budget came back
    assert status == 200
    for refused in (b" " * (most + 1), b"{not json"):  # refused bodies give it back too
        assert (await Client(a, CHAT).send(refused))[0] in (400, 413)
    status, _, _ = await Client(a, CHAT).send(b" " * (most - 1000) + CHAT_BODY)
    assert status == 200


async def test_a_body_that_stops_coming_is_408(monkeypatch):
    monkeypatch.setattr(routes, "BODY_IDLE_S", 0.05)
    client = Client(app(), CHAT)
    client.piece(b'{"messages": ')
    status, _, body = await client.answer()
    assert status == 408 and body["error"]["code"] == "request_timeout"


async def test_a_client_gone_mid_body_is_not_an_error(caplog):
    client = Client(app(), CHAT)
    client.piece(b'{"messages": ')
    client.hang_up()
    with caplog.at_level(logging.INFO):
        assert (await client.answer())[0] == 499
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_large_body_is_parsed_and_translated_off_the_event_loop(monkeypatch):
    threads = []
    real = translate.chat

    def chat(body, pipeline):
        threads.append(threading.get_ident())
        return real(body, pipeline)

    monkeypatch.setattr(translate, "chat", chat)
    a = app(dataclasses.replace(SMALL, limits=dataclasses.replace(SMALL.limits,
                                                                  max_part_bytes=routes.PARSE_APART_BYTES)))
    assert (await Client(a, CHAT).send(CHAT_BODY))[0] == 200
    assert (await Client(a, CHAT).send(b" " * (routes.PARSE_APART_BYTES + 1) + CHAT_BODY))[0] == 200
    assert threads[0] == threading.get_ident() and threads[1] != threading.get_ident()


class Recorded(ScriptedPath):
    """A scripted request path that keeps the requests it was given."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.requests = []

    def generate(self, request, deadline=None, request_id=None, client=None, incoming=None):
        self.requests.append(request)
        return super().generate(request, deadline, request_id)


@pytest.mark.parametrize("value,traced", [("1", True), ("true", True), ("0", False), (None, False)])
async def test_the_trace_header_asks_for_the_trace(value, traced):
    path = Recorded([text("hello")])
    headers = {} if value is None else {routes.TRACE_HEADER: value}
    assert (await Client(app(servicer=path), CHAT, headers).send(CHAT_BODY))[0] == 200
    assert path.requests[0].return_trace is traced


async def test_a_bad_trace_header_is_400_naming_it():
    status, _, body = await Client(app(), CHAT, {routes.TRACE_HEADER: "yes"}).send(CHAT_BODY)
    assert status == 400 and body["error"]["param"] == routes.TRACE_HEADER


async def test_the_client_request_id_header_is_the_label_and_the_answer_names_the_server_id():
    path = Recorded([text("hello")])
    status, headers, _ = await Client(app(servicer=path), CHAT, {routes.CLIENT_ID_HEADER: "job-7"}).send(CHAT_BODY)
    assert status == 200
    assert path.requests[0].request_id == "job-7"            # the label, as the client gave it
    assert headers["x-request-id"] == path.request_id != "job-7"  # the server's own id names the answer
    assert len(path.request_id) == 32


async def test_a_label_too_long_for_n_images_is_refused_naming_the_header():
    body = json.dumps({"prompt": "a car", "n": 3}).encode()
    status, _, answer = await Client(app(load_pipeline(EXAMPLES / "text-to-image-tiny.yaml")),
                                     "/v1/images/generations", {routes.CLIENT_ID_HEADER: "x" * 127}).send(body)
    assert status == 400 and answer["error"]["param"] == routes.CLIENT_ID_HEADER
    assert "at most" not in answer["error"]["message"] and "longer than 126 characters" in answer["error"]["message"]
