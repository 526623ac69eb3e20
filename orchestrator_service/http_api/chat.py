"""Chat completions: a call's events as one `chat.completion` object, or as `chat.completion.chunk`
server-sent events.

The answer's text is `content`; with audio asked for, it is also the audio's `transcript` (streamed:
each text delta carries it as `delta.audio.transcript` too) and the audio comes as `message.audio.data`
in the asked format, or streamed as `delta.audio.data` pieces of pcm16 in playback order, as the
Code2Wav stage produces them. Stop strings end the text before them and the rest of the request is
cancelled (the audio stops where it was); the finish reason is then "stop". With tools, the model's calls
are read out of its text (`tool_calls.ToolCallStream`) into `message.tool_calls` (streamed: `delta.tool_calls`
with their index, the name first, then argument fragments), the rest stays the content, and the finish
reason is "tool_calls". An answer's audio id is kept with its transcript (`audio_ids`) for a later turn.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from omnistage.contract.modalities import MODALITY_CODES
from omnistage.v1 import orchestrator_pb2

from ..tool_calls import CallArguments, CallStarted, TextPiece, ToolCallStream
from . import audio_formats
from .audio_ids import AnswerTranscripts
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
    expires_at: int = 0  # when the audio id stops standing for the answer

    @classmethod
    def of(cls, call: Call, plan: Translated, model: str, transcripts: AnswerTranscripts) -> "Completion":
        created = int(time.time())
        return cls(f"chatcmpl-{call.request_id}", created, model, MODALITY_CODES["text"] in plan.request.outputs,
                   transcripts.new_id() if plan.audio_format else None, transcripts.expires_at(created))


def finish_reason(final: orchestrator_pb2.Final | None, stopped: bool, called: bool = False) -> str:
    reason = "stop" if stopped or final is None else \
        final.finish_reason if final.finish_reason in FINISH_REASONS else "stop"
    return "tool_calls" if called and reason != "length" else reason


def usage(final: orchestrator_pb2.Final | None, tokens_seen: int) -> dict:
    """Token counts; an answer ended early by a stop string has no final counts: the tokens seen."""
    prompt = final.usage.prompt_tokens if final else 0
    completion = final.usage.completion_tokens if final else tokens_seen
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def usage_event(obj: str, answer_id: str, created: int, model: str, final: orchestrator_pb2.Final | None,
                tokens_seen: int) -> bytes:
    """A stream's closing usage chunk (`choices: []`), as `stream_options.include_usage` asks for it."""
    return sse_event({"id": answer_id, "object": obj, "created": created, "model": model,
                      "system_fingerprint": None, "choices": [], "usage": usage(final, tokens_seen)})


class Answer:
    """The answer's text as the client gets it: stop strings watched, then tool calls read out of it."""

    def __init__(self, plan: Translated):
        self.watch = StopWatch(plan.stops)
        self.calls = ToolCallStream(plan.tools.prefix, plan.tools.max_calls) if plan.tools else None
        self._text: list[str] = []

    @property
    def ended(self) -> bool:
        """A stop string was found, or the last call allowed was read: the rest of the request is not needed."""
        return self.watch.stopped or (self.calls is not None and self.calls.done)

    def feed(self, text: str) -> list:
        return self._read(self.watch.feed(text))

    def close(self) -> list:
        events = self._read(self.watch.flush())
        return events + (self.calls.close() if self.calls else [])

    @property
    def content(self) -> str:
        return self.calls.text if self.calls else "".join(self._text)

    def _read(self, piece: str) -> list:
        if self.calls is not None:
            return self.calls.feed(piece)
        self._text.append(piece)
        return [TextPiece(piece)] if piece else []

    def tool_calls(self) -> list[dict] | None:
        if not self.calls or not self.calls.calls:
            return None
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls.calls]


async def complete(call: Call, plan: Translated, model: str, transcripts: AnswerTranscripts) -> dict:
    """The whole answer as one `chat.completion`."""
    c = Completion.of(call, plan, model, transcripts)
    answer = Answer(plan)
    pcm, rate, final, tokens = bytearray(), 0, None, 0
    async for ev in call:
        kind = ev.WhichOneof("event")
        if kind == "text":
            tokens += len(ev.text.token_ids)
            answer.feed(ev.text.text)
            if answer.ended:
                break
        elif kind == "audio":
            pcm += ev.audio.pcm
            rate = ev.audio.sample_rate
        elif kind == "final":
            final = ev.final
    answer.close()
    content = answer.content
    calls = answer.tool_calls()
    # With calls and no other text than whitespace (between the calls), the content is null, as OpenAI's.
    message: dict = {"role": "assistant", "content": content if c.text and (content.strip() or not calls) else None,
                     "refusal": None}
    if calls:
        message["tool_calls"] = calls
    if c.audio_id:  # encoding takes seconds for minutes of audio: off the event loop every request shares
        data = await asyncio.to_thread(audio_formats.encode, pcm, rate, plan.audio_format, "audio.format")
        message["audio"] = {"id": c.audio_id, "data": b64encode_str(data), "expires_at": c.expires_at,
                            "transcript": content}
        transcripts.keep(c.audio_id, content, c.created)
    body = {"id": c.id, "object": "chat.completion", "created": c.created, "model": c.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason(final, answer.ended, bool(calls))}],
            "usage": usage(final, tokens)}
    return with_trace(body, final)


async def stream(call: Call, plan: Translated, model: str, transcripts: AnswerTranscripts) -> AsyncIterator[bytes]:
    """The answer as it appears: a role chunk, text, tool call and audio deltas, a chunk with the finish reason
    (and the trace when asked for), a usage chunk when asked for, `[DONE]`. A failure after the first event is
    one error event, and the stream ends."""
    c = Completion.of(call, plan, model, transcripts)
    include_usage = plan.include_usage

    def chunk(delta: dict, reason: str | None = None, final: orchestrator_pb2.Final | None = None) -> bytes:
        obj = {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model,
               "system_fingerprint": None,
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if include_usage:
            obj["usage"] = None
        return sse_event(with_trace(obj, final))

    def delta(event) -> bytes:
        if isinstance(event, CallStarted):
            return chunk({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                          "function": {"name": event.name, "arguments": ""}}]})
        if isinstance(event, CallArguments):
            return chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]})
        d: dict = {"content": event.text}
        if c.audio_id:
            d["audio"] = {"id": c.audio_id, "transcript": event.text}
        return chunk(d)

    answer = Answer(plan)
    final, tokens = None, 0
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for ev in call:
            kind = ev.WhichOneof("event")
            if kind == "text":
                tokens += len(ev.text.token_ids)
                for event in answer.feed(ev.text.text):
                    yield delta(event)
                if answer.ended:
                    break
            elif kind == "audio":
                yield chunk({"audio": {"id": c.audio_id, "data": b64encode_str(ev.audio.pcm)}})
            elif kind == "final":
                final = ev.final
        for event in answer.close():
            yield delta(event)
        if c.audio_id:
            transcripts.keep(c.audio_id, answer.content, c.created)
            yield chunk({"audio": {"id": c.audio_id, "expires_at": c.expires_at}})
        yield chunk({}, finish_reason(final, answer.ended, bool(answer.tool_calls())), final)
        if include_usage:
            yield usage_event("chat.completion.chunk", c.id, c.created, c.model, final, tokens)
        yield SSE_DONE
    except ApiError as e:
        yield sse_event(e.body())
    except ClientGone:
        return
