"""Chat completions: a call's events as one `chat.completion` object, or as `chat.completion.chunk`
server-sent events.

The answer's text is `content`; with audio asked for, it is also the audio's `transcript` (streamed:
each text delta carries it as `delta.audio.transcript` too) and the audio comes as `message.audio.data`
in the asked format, or streamed as `delta.audio.data` pieces of pcm16 in playback order, as the
Code2Wav stage produces them. Stop strings end the text before them and the rest of the request is
cancelled (the audio stops where it was); the finish reason is then "stop".
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from omnistage.contract.modalities import MODALITY_CODES
from omnistage.v1 import orchestrator_pb2

from . import audio_formats
from .call import Call, ClientGone
from .errors import ApiError
from .responses import SSE_DONE, b64encode_str, sse_event, with_trace
from .stop import StopWatch
from .translate import Translated

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class Completion:
    """What every object of one completion shares."""

    id: str
    created: int
    model: str
    text: bool  # text is one of the outputs asked for
    audio_id: str | None  # set when audio is

    @classmethod
    def of(cls, call: Call, plan: Translated, model: str) -> "Completion":
        return cls(f"chatcmpl-{call.request_id}", int(time.time()), model,
                   MODALITY_CODES["text"] in plan.request.outputs,
                   f"audio_{call.request_id}" if plan.audio_format else None)


def finish_reason(final: orchestrator_pb2.Final | None, stopped: bool) -> str:
    if stopped or final is None:
        return "stop"
    return final.finish_reason if final.finish_reason in FINISH_REASONS else "stop"


def usage(final: orchestrator_pb2.Final | None, tokens_seen: int) -> dict:
    """Token counts; an answer ended early by a stop string has no final counts: the tokens seen."""
    prompt = final.usage.prompt_tokens if final else 0
    completion = final.usage.completion_tokens if final else tokens_seen
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def complete(call: Call, plan: Translated, model: str) -> dict:
    """The whole answer as one `chat.completion`."""
    c = Completion.of(call, plan, model)
    watch = StopWatch(plan.stops)
    text: list[str] = []
    pcm, rate, final, tokens = bytearray(), 0, None, 0
    async for ev in call:
        kind = ev.WhichOneof("event")
        if kind == "text":
            tokens += len(ev.text.token_ids)
            text.append(watch.feed(ev.text.text))
            if watch.stopped:
                break
        elif kind == "audio":
            pcm += ev.audio.pcm
            rate = ev.audio.sample_rate
        elif kind == "final":
            final = ev.final
    content = "".join(text) + watch.flush()
    message: dict = {"role": "assistant", "content": content if c.text else None, "refusal": None}
    if c.audio_id:  # encoding takes seconds for minutes of audio: off the event loop every request shares
        data = await asyncio.to_thread(audio_formats.encode, pcm, rate, plan.audio_format, "audio.format")
        message["audio"] = {"id": c.audio_id, "data": b64encode_str(data), "expires_at": c.created,
                            "transcript": content}
    answer = {"id": c.id, "object": "chat.completion", "created": c.created, "model": c.model,
              "system_fingerprint": None,
              "choices": [{"index": 0, "message": message, "logprobs": None,
                           "finish_reason": finish_reason(final, watch.stopped)}],
              "usage": usage(final, tokens)}
    return with_trace(answer, final)


async def stream(call: Call, plan: Translated, model: str) -> AsyncIterator[bytes]:
    """The answer as it appears: a role chunk, text and audio deltas, a chunk with the finish reason (and
    the trace when asked for), a usage chunk when asked for, `[DONE]`. A failure after the first event is
    one error event, and the stream ends."""
    c = Completion.of(call, plan, model)
    include_usage = plan.include_usage

    def chunk(delta: dict, reason: str | None = None, final: orchestrator_pb2.Final | None = None) -> bytes:
        obj = {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model,
               "system_fingerprint": None,
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if include_usage:
            obj["usage"] = None
        return sse_event(with_trace(obj, final))

    def text(piece: str) -> bytes:
        delta: dict = {"content": piece}
        if c.audio_id:
            delta["audio"] = {"id": c.audio_id, "transcript": piece}
        return chunk(delta)

    watch = StopWatch(plan.stops)
    final, tokens = None, 0
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for ev in call:
            kind = ev.WhichOneof("event")
            if kind == "text":
                tokens += len(ev.text.token_ids)
                piece = watch.feed(ev.text.text)
                if piece:
                    yield text(piece)
                if watch.stopped:
                    break
            elif kind == "audio":
                yield chunk({"audio": {"id": c.audio_id, "data": b64encode_str(ev.audio.pcm)}})
            elif kind == "final":
                final = ev.final
        if rest := watch.flush():
            yield text(rest)
        yield chunk({}, finish_reason(final, watch.stopped), final)
        if include_usage:
            yield sse_event({"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model,
                             "system_fingerprint": None, "choices": [], "usage": usage(final, tokens)})
        yield SSE_DONE
    except ApiError as e:
        yield sse_event(e.body())
    except ClientGone:
        return
