"""Access lines on a real tiny LM stage behind a real orchestrator serving both doors with API keys: one
`omnistage.access` line per request on each door (door, status, tokens as the answer's usage, the key's
name and never the key), one per stage call at the stage, levels that mean something, written as JSON by
the processes' formatter."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request

import grpc
import pytest

from omnistage import logs
from omnistage.client import build_request
from omnistage.v1 import orchestrator_pb2_grpc
from orchestrator_service.server import OrchestratorServer

from ..harness import small_lm, start_stage
from ..polling import wait_until

KEYS = ["alpha-secret-key", "beta-secret-key:5"]   # key-0, key-1
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
LM_LIMITS = {"defaultMaxTokens": 4, "maxTokens": 64}


class JsonLines(logging.Handler):
    """The access logger's lines as the processes write them (logs.formatter("json")), parsed back."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logs.formatter("json"))
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(self.format(record))

    def lines(self) -> list[dict]:
        return [json.loads(t) for t in self.text]

    def orchestrator(self) -> list[dict]:
        return [line for line in self.lines() if "door" in line]

    def stage(self) -> list[dict]:
        return [line for line in self.lines() if "stage" in line]


@pytest.fixture(scope="module")
async def rig(model_dir):
    access = logging.getLogger(logs.ACCESS_LOGGER)
    handler, level = JsonLines(), access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    pipeline = small_lm(LM_LIMITS)
    stage = await start_stage(pipeline, "llm", model_dir)
    orc = OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]}, api_port=0, api_keys=KEYS)
    try:
        await orc.start(wait_for_stages=60)
        yield orc, handler
    finally:
        await orc.drain()
        orc.close()
        await stage.drain()
        stage.close()
        access.removeHandler(handler)
        access.setLevel(level)


@pytest.fixture
def lines(rig):
    _, handler = rig
    handler.text.clear()
    return handler


async def grpc_generate(port: int, request, key: str | None, metadata=()) -> tuple[list, grpc.StatusCode]:
    md = ((("authorization", f"Bearer {key}"),) if key else ()) + tuple(metadata)
    events = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            async for ev in orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(request, metadata=md, timeout=60):
                events.append(ev)
        except grpc.aio.AioRpcError as e:
            return events, e.code()
    return events, grpc.StatusCode.OK


def post_chat(port: int, key: str | None, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 method="POST", headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(max_tokens: int = 4) -> dict:
    return {"model": "llm-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens,
            "ignore_eos": True}


async def written(handler: JsonLines, orchestrator: int, stage: int = 0) -> tuple[list[dict], list[dict]]:
    """The lines once `orchestrator` request lines and `stage` call lines are in (a door writes its line as the
    call ends, just after the client has its answer)."""
    await wait_until(lambda: len(handler.orchestrator()) >= orchestrator and len(handler.stage()) >= stage,
                     timeout=30)
    return handler.orchestrator(), handler.stage()


async def test_a_grpc_request_has_one_line_with_its_usage_key_name_and_label(rig, lines):
    orc, _ = rig
    events, code = await grpc_generate(orc.port, build_request("Hello", request_id="label-1", max_tokens=5,
                                                               ignore_eos=True),
                                       KEYS[1].partition(":")[0], [("traceparent", TRACEPARENT)])
    assert code == grpc.StatusCode.OK
    usage, rid = events[-1].final.usage, events[-1].request_id
    (line,), (call,) = await written(lines, 1, 1)
    assert {k: line[k] for k in ("logger", "level", "door", "status", "api_key", "request_id", "client_request_id",
                                 "peer", "tokens_in", "tokens_out", "images", "trace_id")} == {
        "logger": "omnistage.access", "level": "INFO", "door": "grpc", "status": "OK", "api_key": "key-1",
        "request_id": rid, "client_request_id": "label-1", "peer": "127.0.0.1", "tokens_in": usage.prompt_tokens,
        "tokens_out": 5, "images": 0, "trace_id": TRACE_ID}
    assert 0 <= line["ttfp_s"] <= line["total_s"] and line["audio_s"] == 0 and line["server"] and line["time"]
    assert {k: call[k] for k in ("stage", "request_id", "outcome", "status", "units", "unit", "level")} == {
        "stage": "llm", "request_id": rid, "outcome": "finished", "status": "OK", "units": 5, "unit": "tokens",
        "level": "INFO"}
    assert 0 <= call["queue_s"] and 0 < call["compute_s"] and 0 < call["total_s"]


async def test_an_http_request_has_one_line_on_the_http_door(rig, lines):
    orc, _ = rig
    status, body = await asyncio.to_thread(post_chat, orc.api_port, KEYS[0], chat(3),
                                           {"X-Client-Request-Id": "web-7", "traceparent": TRACEPARENT})
    assert status == 200
    (line,), (call,) = await written(lines, 1, 1)
    assert {k: line[k] for k in ("door", "status", "http_status", "api_key", "client_request_id", "tokens_in",
                                 "tokens_out", "trace_id", "level")} == {
        "door": "http", "status": "OK", "http_status": 200, "api_key": "key-0", "client_request_id": "web-7",
        "tokens_in": body["usage"]["prompt_tokens"], "tokens_out": 3, "trace_id": TRACE_ID, "level": "INFO"}
    assert body["id"].endswith(line["request_id"]) and call["request_id"] == line["request_id"]
    assert 0 <= line["ttfp_s"] <= line["total_s"]


async def test_a_client_error_is_an_info_line_with_its_status_on_both_doors(rig, lines):
    orc, _ = rig
    _, code = await grpc_generate(orc.port, build_request("Hello", max_tokens=LM_LIMITS["maxTokens"] + 1),
                                  KEYS[0])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    status, _ = await asyncio.to_thread(post_chat, orc.api_port, KEYS[0], chat(LM_LIMITS["maxTokens"] + 1))
    assert status == 400
    found, _ = await written(lines, 2)
    grpc_line, http_line = sorted(found, key=lambda x: x["door"])
    assert (grpc_line["door"], grpc_line["status"], grpc_line["level"]) == ("grpc", "INVALID_ARGUMENT", "INFO")
    assert (http_line["door"], http_line["status"], http_line["http_status"], http_line["level"]) == \
        ("http", "INVALID_ARGUMENT", 400, "INFO")
    assert grpc_line["tokens_out"] == http_line["tokens_out"] == 0 and grpc_line["ttfp_s"] is None
    assert lines.stage() == []   # refused before any stage was called


async def test_a_wrong_key_has_its_line_and_no_key_is_ever_written(rig, lines):
    orc, _ = rig
    _, code = await grpc_generate(orc.port, build_request("Hello"), "not-a-key-grpc")
    assert code == grpc.StatusCode.UNAUTHENTICATED
    status, _ = await asyncio.to_thread(post_chat, orc.api_port, "not-a-key-http", chat())
    assert status == 401
    await grpc_generate(orc.port, build_request("Hello"), KEYS[0])
    await asyncio.to_thread(post_chat, orc.api_port, KEYS[1].partition(":")[0], chat())
    found, _ = await written(lines, 4)
    refused = sorted((x for x in found if x["status"] == "UNAUTHENTICATED"), key=lambda x: x["door"])
    assert [(x["door"], x["api_key"], x["level"]) for x in refused] == [("grpc", None, "INFO"),
                                                                       ("http", None, "INFO")]
    assert sorted(x["api_key"] for x in found if x["status"] == "OK") == ["key-0", "key-1"]
    every_line = "\n".join(lines.text)
    for secret in ("alpha-secret-key", "beta-secret-key", "not-a-key-grpc", "not-a-key-http"):
        assert secret not in every_line


def stream_then_leave(port: int, key: str) -> int:
    """A streamed chat read to its first event, then the connection closed: a client gone mid-answer."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {**chat(LM_LIMITS["maxTokens"]), "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    r = conn.getresponse()
    r.fp.readline()   # the first event's line: the answer is under way
    conn.sock.close()
    conn.close()
    return r.status


async def test_a_client_gone_mid_answer_is_cancelled_on_both_doors(rig, lines):
    orc, _ = rig
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orc.port}") as ch:
        call = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(
            build_request("Tell me a story", max_tokens=LM_LIMITS["maxTokens"], ignore_eos=True),
            metadata=(("authorization", f"Bearer {KEYS[0]}"),), timeout=60)
        await call.read()
        call.cancel()
    assert await asyncio.to_thread(stream_then_leave, orc.api_port, KEYS[0]) == 200
    found, calls = await written(lines, 2, 2)
    assert sorted((x["door"], x["status"], x["level"]) for x in found) == [
        ("grpc", "CANCELLED", "INFO"), ("http", "CANCELLED", "INFO")]
    assert [x["tokens_out"] for x in found] == [0, 0]   # usage comes with the answer's end, which never came
    assert [(x["outcome"], x["level"]) for x in calls] == [("cancelled", "INFO")] * 2
