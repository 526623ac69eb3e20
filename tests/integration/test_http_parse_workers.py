"""The HTTP API's body parsers (orchestrator_service/http_api/parse_workers.py): a large body is parsed and
translated in a process of its own, and what comes back (the plan with its media parts' bytes, or the refusal
in the OpenAI error shape) is what parsing it in the orchestrator's process gives; a parser killed from outside
is replaced; through a real orchestrator's uvicorn, a large body's parse runs outside the process and its
answer is the request path's."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import signal

import httpx
import pytest

from omnistage.api import load_pipeline
from orchestrator_service.http_api import body_limits, parse_workers, routes, translate
from orchestrator_service.http_api.errors import ApiError, from_exception
from orchestrator_service.http_api.schemas import ChatCompletionRequest, ImageRequest, bounded
from orchestrator_service.server import OrchestratorServer

from ..conftest import EXAMPLES
from ..polling import wait_until

OMNI = load_pipeline(EXAMPLES / "qwen3-omni-tiny.yaml")
# Limits that admit a chat body of a few MiB: large enough to be parsed apart (routes.PARSE_APART_BYTES).
MEDIA = dataclasses.replace(OMNI, limits=dataclasses.replace(OMNI.limits, max_prompt_chars=1000, max_parts=2,
                                                             max_part_bytes=2 << 20))
BOUND_S = 120.0  # a safety bound on waiting for what must happen (a parser's start); never a measurement


def b64(n: int, seed: int = 0) -> str:
    return base64.b64encode(bytes((i * 7 + seed) % 251 for i in range(n))).decode()


def audio_part(data: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def chat(content, **fields) -> bytes:
    body = json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}],
                       **fields}).encode()
    assert len(body) > routes.PARSE_APART_BYTES
    return body


BIG = (2 << 20) - 64
BODIES = {
    "media parts and text": chat([{"type": "text", "text": "what is this?"}, audio_part(b64(BIG))],
                                 max_tokens=7, stream=True, stop=["x"], modalities=["text", "audio"]),
    "an image and a video as data: URLs": chat([
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(BIG, 1)}},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(BIG, 2)}}]),
    "items of the wrong type": b'{"messages":[' + b'{"role":1},' * 100_000 + b'{"role":1}]}',
    "a bad part after a large one": chat([audio_part(b64(BIG)), {"type": 1}]),
    "base64 that is not": chat([audio_part("!" * BIG)]),
    "a model not served": chat([audio_part(b64(BIG))], model="another"),
    "a refused field": chat([audio_part(b64(BIG))], tools=[{"type": "function"}]),
    "not JSON": chat([audio_part(b64(BIG))])[:-3],
}


def in_process(body: bytes, model=ChatCompletionRequest, translation=translate.chat):
    """What parsing `body` in this process gives: the plan, or the OpenAI error of its refusal."""
    try:
        return routes._parse(io.BytesIO(body), bounded(MEDIA.limits)[model], translation, MEDIA)
    except Exception as e:  # noqa: BLE001 - every refusal, as the route maps it
        return from_exception(e)


async def in_worker(workers: parse_workers.ParseWorkers, body: bytes, model=ChatCompletionRequest,
                    translation=translate.chat):
    try:
        return await workers.parse(io.BytesIO(body), model, translation)
    except ApiError as e:
        return e


def ended(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie not yet reaped by its parent, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def same(a, b) -> bool:
    if isinstance(a, ApiError) or isinstance(b, ApiError):
        return type(a) is type(b) and dataclasses.asdict(a) == dataclasses.asdict(b)
    return a == b


@pytest.fixture(scope="module")
async def workers():
    pool = parse_workers.ParseWorkers(MEDIA, 1, parse_workers.address_space_for(body_limits.chat_body_limit(
        MEDIA.limits)))
    pool.start()
    try:
        await wait_until(lambda: bool(pool.pids()), BOUND_S, what="a body parser started")
        yield pool
    finally:
        pool.close()


@pytest.mark.parametrize("name", list(BODIES))
async def test_a_body_parsed_apart_gives_what_parsing_it_here_gives(workers, name):
    body = BODIES[name]
    parsed = workers.parsed
    here, apart = in_process(body), await in_worker(workers, body)
    assert same(apart, here), (apart, here)
    assert workers.parsed == parsed + 1 and os.getpid() not in workers.parsed_by


async def test_an_images_request_parsed_apart_gives_n_plans():
    pipeline = load_pipeline(EXAMPLES / "sd3-tiny.yaml")
    pool = parse_workers.ParseWorkers(pipeline, 1, parse_workers.WORKER_BASE_ADDRESS_SPACE)
    pool.start()
    try:
        body = json.dumps({"prompt": "a cat", "n": 3, "seed": 5, "user": "u" * 200, "x": "y" * (1 << 20)}).encode()
        plans = await pool.parse(io.BytesIO(body), ImageRequest, translate.images)
        here = routes._parse(io.BytesIO(body), bounded(pipeline.limits)[ImageRequest], translate.images, pipeline)
        assert plans == here and len(plans) == 3
    finally:
        pool.close()


async def test_a_parser_killed_from_outside_is_replaced(workers):
    body = BODIES["media parts and text"]
    killed = workers.pids()
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    await wait_until(lambda: all(ended(pid) for pid in killed), BOUND_S, what="the parsers killed")
    assert same(await in_worker(workers, body), in_process(body))


async def test_through_uvicorn_a_large_body_is_parsed_outside_the_process_and_answered_by_the_request_path():
    # The stages are not running: a body that passes the door reaches the request path, whose media check
    # refuses bytes that are no audio, naming the part by the field the client sent.
    orc = OrchestratorServer(MEDIA, {s.name: ["127.0.0.1:1"] for s in MEDIA.stages}, api_port=0)
    await orc.start()
    try:
        workers = orc.api.parse_workers
        await wait_until(lambda: len(workers.pids()) == workers.workers, BOUND_S, what="the body parsers started")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{orc.api_port}", timeout=BOUND_S) as client:
            answer = await client.post("/v1/chat/completions", content=BODIES["media parts and text"],
                                       headers={"content-type": "application/json"})
            unknown = await client.post("/v1/chat/completions", content=BODIES["a model not served"],
                                        headers={"content-type": "application/json"})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "messages[1].content[1]", answer.text
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model", unknown.text
        assert workers.parsed == 2 and os.getpid() not in workers.parsed_by
    finally:
        await orc.drain()
        orc.close()
