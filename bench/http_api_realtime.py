"""The Realtime API (`/v1/realtime`) against a streamed chat completion for the same spoken input: what the
WebSocket session costs the first audio of an answer, and how many sessions keep every answer faster than
real time.

One `omnistage serve` of examples/qwen3-omni-tiny.yaml (one torch thread per process), warmed. The spoken input:
1 s of speech-like pcm16 at 24 kHz (a voice's harmonics through vowel formants). Each answer: greedy, a fixed
text budget, audio out, the pipeline's default codec budget.
  Realtime: a session over a thin `websockets` client (not the SDK: its parsing would weigh on the server's
            cores); `session.update` (turn detection off), the audio appended, then `input_audio_buffer.commit`
            and `response.create` sent together: first audio = from the commit to the first
            `response.output_audio.delta`.
  Chat:     `POST /v1/chat/completions` streamed, the same audio as a WAV `input_audio` part, audio out as
            pcm16: time to the first `delta.audio.data`.
Rounds alternate the two, so that a burst of other work on the machine hits both alike.

`realtime.first_audio_after_commit_p50_ms_s1` / `_s8` (1 and 8 concurrent sessions), `chat_stream.ttfp_p50_ms`
(concurrency 1, the same rounds as _s1), `realtime.sessions_at_rtf_below_1`: the most concurrent sessions, of
1, 2, 4, 8, ..., at which every answer's audio arrived faster than real time (the time from the commit to the
answer's last audio under the audio's length).

    .venv/bin/python bench/http_api_realtime.py [--quick]
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx
import numpy as np
import soundfile
import websockets
from common import figure, percentile, run_measure
from omni_load import serve_omni

from tests.media_builders import speech_like

ROOT = Path(__file__).resolve().parent.parent
RATE = 24000
MAX_TOKENS = 8  # text tokens of each answer: a short spoken reply
SPOKEN_S = 1.0


class Answer:
    """One answer's timing: first audio and last audio after the start, and its audio's length."""

    def __init__(self, first: float, last: float, audio_s: float):
        self.first, self.last, self.audio_s = first, last, audio_s

    @property
    def rtf(self) -> float:
        return self.last / self.audio_s if self.audio_s else float("inf")


async def realtime_answer(url: str, pcm: bytes) -> Answer:
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "max_output_tokens": MAX_TOKENS, "audio": {"input": {"turn_detection": None}}}}))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        first = last = None
        audio = 0
        while True:
            event = json.loads(await ws.recv())
            kind = event["type"]
            if kind == "response.output_audio.delta":
                last = time.perf_counter() - t0
                first = first if first is not None else last
                audio += len(base64.b64decode(event["delta"]))
            elif kind == "error":
                raise RuntimeError(f"realtime error: {event['error']}")
            elif kind == "response.done":
                if event["response"]["status"] not in ("completed", "incomplete"):
                    raise RuntimeError(f"realtime response {event['response']['status']}: "
                                       f"{event['response']['status_details']}")
                break
    if first is None:
        raise RuntimeError("a realtime answer without audio")
    return Answer(first, last, audio / 2 / RATE)


async def chat_answer(client: httpx.AsyncClient, model: str, wav_b64: str) -> Answer:
    body = {"model": model, "stream": True, "max_tokens": MAX_TOKENS, "modalities": ["text", "audio"],
            "audio": {"format": "pcm16"},
            "messages": [{"role": "user", "content": [{"type": "input_audio",
                                                       "input_audio": {"data": wav_b64, "format": "wav"}}]}]}
    t0 = time.perf_counter()
    first = last = None
    audio = 0
    async with client.stream("POST", "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            data = ((choices[0].get("delta") or {}).get("audio") or {}).get("data")
            if data:
                last = time.perf_counter() - t0
                first = first if first is not None else last
                audio += len(base64.b64decode(data))
    if first is None:
        raise RuntimeError("a chat answer without audio")
    return Answer(first, last, audio / 2 / RATE)


async def sessions_at_once(url: str, pcm: bytes, n: int) -> list[Answer]:
    return list(await asyncio.gather(*(realtime_answer(url, pcm) for _ in range(n))))


async def run(api_url: str, model: str, rounds: int, top: int) -> list[dict]:
    pcm = speech_like(SPOKEN_S, RATE)
    buf = io.BytesIO()
    soundfile.write(buf, np.frombuffer(pcm, "<i2"), RATE, format="WAV", subtype="PCM_16")
    wav_b64 = base64.b64encode(buf.getvalue()).decode()
    url = api_url.replace("http://", "ws://", 1) + f"/realtime?model={model}"
    async with httpx.AsyncClient(base_url=api_url, timeout=600) as client:
        await realtime_answer(url, pcm)  # warm both paths
        await chat_answer(client, model, wav_b64)
        s1: list[float] = []
        chat: list[float] = []
        for r in range(rounds):  # alternating, one at a time
            order = ("realtime", "chat") if r % 2 == 0 else ("chat", "realtime")
            for name in order:
                if name == "realtime":
                    s1.append((await realtime_answer(url, pcm)).first)
                else:
                    chat.append((await chat_answer(client, model, wav_b64)).first)
    s8: list[float] = []
    for _ in range(max(1, rounds // 3)):
        s8 += [a.first for a in await sessions_at_once(url, pcm, 8)]
    best, n = 0, 1
    while n <= top:
        answers = await sessions_at_once(url, pcm, n)
        if any(a.rtf >= 1 for a in answers):
            break
        best, n = n, n * 2
    return [figure("realtime.first_audio_after_commit_p50_ms_s1", 1e3 * percentile(s1, 50), "ms"),
            figure("chat_stream.ttfp_p50_ms", 1e3 * percentile(chat, 50), "ms"),
            figure("realtime.added_first_audio_p50_ms_s1", 1e3 * (percentile(s1, 50) - percentile(chat, 50)), "ms"),
            figure("realtime.first_audio_after_commit_p50_ms_s8", 1e3 * percentile(s8, 50), "ms"),
            figure("realtime.sessions_at_rtf_below_1", best, "sessions")]


def measure(quick: bool) -> list[dict]:
    rounds, top = (6, 16) if quick else (20, 64)
    with serve_omni(ROOT / "models", api_port=0) as local:
        return asyncio.run(run(local.api_url, local.pipeline.name, rounds, top))


if __name__ == "__main__":
    run_measure("http_api_realtime", "Realtime API vs streamed chat, the same spoken input", measure, {})
