"""Fuzz the HTTP API's JSON bodies: random JSON shapes (nested lists and objects, strings, numbers, the
schema's own field names with values of any type, long runs of one item) POSTed to each JSON endpoint of a
real orchestrator over a tiny LM, under small limits. Every answer is 200 or a 4xx in the OpenAI error shape
naming a few errors, never a 5xx; memory stays flat. A body refused before it was read whole (past the size or
the JSON value bound) is answered too: the connection drains the rest of it, so the client reads the answer."""

from __future__ import annotations

import asyncio
import json

import httpx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orchestrator_service.server import OrchestratorServer

from ..fuzz_memory import second_pass_growth
from ..harness import small_lm, start_stage

# Small limits: a chat body of about 80 KiB, about 2600 JSON values.
LIMITS = {"defaultMaxTokens": 2, "maxTokens": 4, "maxPromptChars": 256, "maxParts": 2, "maxPartBytes": 4096}
CHAT = "/v1/chat/completions"
ENDPOINTS = (CHAT, "/v1/completions", "/v1/audio/speech", "/v1/images/generations")
FIELDS = ("model", "messages", "role", "content", "type", "text", "image_url", "url", "input_audio", "data",
          "format", "modalities", "audio", "voice", "stream", "stop", "max_tokens", "seed", "n", "input", "prompt",
          "size", "response_format", "negative_prompt", "instructions", "stream_format", "tools", "tool_choice",
          "tool_calls", "tool_call_id", "function", "name", "arguments", "parameters", "id", "echo")

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70) | st.floats() |
           st.sampled_from(["user", "system", "text", "input_audio", "data:image/png;base64,AAAA", "wav", ""]) |
           st.text(max_size=40))
keys = st.sampled_from(FIELDS) | st.text(max_size=8)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(keys, inner, max_size=6),
                      max_leaves=40)
# The many-items shapes: one small value repeated, under a field of the schema or not.
runs = st.builds(lambda field, item, n: {field: [item] * n}, keys,
                 scalars | st.lists(scalars, max_size=2) | st.dictionaries(keys, scalars, max_size=2),
                 st.integers(0, 20_000))
# A user turn (often a valid one) with a few of the chat's optional fields, of any value or a valid one.
OPTIONAL = ("max_tokens", "temperature", "top_p", "seed", "stop", "modalities", "stream", "n", "user", "ignore_eos")
near_valid = st.builds(lambda user, extra: {"messages": [{"role": "user", "content": user}], **extra},
                       st.text(min_size=1, max_size=40) | values,
                       st.dictionaries(st.sampled_from(OPTIONAL), st.integers(1, 4) | values, max_size=3))
bodies = st.one_of(values, st.dictionaries(keys, values, max_size=8), runs, near_valid)


async def test_fuzzed_bodies_are_answered_200_or_4xx_in_the_openai_shape(model_dir):
    pipeline = small_lm(LIMITS)
    stage = await start_stage(pipeline, "llm", model_dir)
    orc = OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]}, api_port=0)
    await orc.start(wait_for_stages=30)
    loop = asyncio.get_running_loop()
    statuses: dict[int, int] = {}
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{orc.api_port}", timeout=60)

    async def post(path: str, body: bytes) -> None:
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:500], body[:200])
        if r.status_code != 200:
            error = r.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}
            assert error["message"] and len(error["message"]) < 2000  # a few errors named, never one per item

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(ENDPOINTS), bodies)
    # refused long before their end: past the JSON values (at the first piece), past the size (from Content-Length)
    @example(CHAT, {"messages": [[]] * 2_000_000})
    @example("/v1/audio/speech", {"input": "a" * (8 << 20)})
    def run(path, body):
        raw = json.dumps(body).encode()  # NaN and Infinity too: not JSON, refused as such
        asyncio.run_coroutine_threadsafe(post(path, raw), loop).result(120)

    try:
        growth = await second_pass_growth(run)
        assert set(statuses) - {200}, statuses
        assert growth < 64 << 20, f"memory grew {growth >> 20} MiB over the second fuzz pass"
        r = await client.get("/health")
        assert r.status_code == 200
    finally:
        await client.aclose()
        await orc.drain()
        await stage.drain()
