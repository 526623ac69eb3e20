"""One Realtime response: the conversation as one GenerateRequest down the request path (a Call, as every
HTTP request's), its events as the reference's server events, in order:

`response.created`; per output item `response.output_item.added`, `conversation.item.added`, the content part
(`response.content_part.added`, text or audio deltas with their transcript, their `.done`s,
`response.content_part.done`) or the function call's argument deltas and `.done`; `response.output_item.done`,
`conversation.item.done`; then `response.done` with the status and usage.

A cancel (`response.cancel`, barge-in, the client gone) closes the Call: the request's run is cancelled through
every stage before the response ends with status `cancelled` and the items made so far (incomplete). A refusal
of the request path (overload, bad input) is an `error` event and a `failed` response.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

from omnistage import media
from omnistage.contract.request import build_request
from omnistage.v1 import orchestrator_pb2

from ...tool_calls import CallArguments, CallStarted, TextPiece, ToolCallStream
from ..call import Call, ClientGone
from ..errors import ApiError
from . import items as items_
from .events import RealtimeError, error_event, new_id, of_api_error, server_event
from .items import Conversation
from .limits import BYTES_PER_SECOND, SAMPLE_RATE
from .session import PCM, SessionConfig

log = logging.getLogger("omnistage.orchestrator.realtime")

Send = Callable[[dict], Awaitable[None]]
# Fields of the request path a refusal may name, as the session's.
FIELDS = {"params.parts": "conversation", "params.turns": "conversation", "params.tools": "session.tools",
          "params.audio.speaker": "session.audio.output.voice", "params.text.max_tokens": "max_output_tokens"}


def request_for(config: SessionConfig, conversation: Conversation) -> orchestrator_pb2.GenerateRequest:
    """The request one response makes: the whole conversation, the session's tools, its outputs."""
    parts, turns = conversation.turns(config.instructions)
    use = config.tool_use()
    # The text is the transcript of the audio: asked for whenever the pipeline has it.
    outputs = [m for m in ("text", "audio")
               if m in config.modalities and (m == "text" or m in config.output_modalities)]
    return build_request(parts=parts, turns=turns, tools=use.tools, answer_prefix=use.prefix, outputs=outputs,
                         speaker=config.voice, max_tokens=config.max_output_tokens or 0)


def to_24k(chunk: orchestrator_pb2.AudioChunk) -> bytes:
    """A pipeline audio chunk as pcm16 mono at 24 kHz (each chunk resampled on its own)."""
    pcm = chunk.pcm
    channels = chunk.channels or 1
    if channels == 1 and chunk.sample_rate in (0, SAMPLE_RATE):
        return pcm
    x = np.frombuffer(pcm, dtype="<i2").astype(np.float32)
    if channels > 1:
        x = x[: len(x) // channels * channels].reshape(-1, channels).mean(axis=1)
    if chunk.sample_rate and chunk.sample_rate != SAMPLE_RATE:
        x = media.resample(x, chunk.sample_rate, SAMPLE_RATE)
    return np.clip(np.rint(x), -32768, 32767).astype("<i2").tobytes()


@dataclass
class _Output:
    """One output item in progress."""

    item: items_.Item
    index: int
    text: list[str] = field(default_factory=list)


class Response:
    """A response in progress: `run()` sends its events; `cancel(reason)` ends it early."""

    def __init__(self, config: SessionConfig, conversation: Conversation, call: Call, send: Send,
                 metadata: dict | None = None):
        self.id = new_id("resp")
        self.config, self.conversation, self.call, self._send = config, conversation, call, send
        self.metadata = metadata
        self.audio = "audio" in config.output_modalities
        self.outputs: list[_Output] = []
        self.message: _Output | None = None
        self.calls: dict[int, _Output] = {}  # the parser's call index -> its item
        self.cancel_reason: str | None = None
        self.done = False
        self._closing: asyncio.Future | None = None

    def cancel(self, reason: str) -> asyncio.Future:
        """End the response (reason: client_cancelled, turn_detected): its Call closes (the run is cancelled
        through every stage); `run` then sends `response.done` with status cancelled."""
        self.cancel_reason = self.cancel_reason or reason
        self._closing = asyncio.ensure_future(self.call.close())  # held: a task only the loop refers to may go
        return self._closing

    def body(self, status: str, details: dict | None = None, usage: dict | None = None) -> dict:
        return {"id": self.id, "object": "realtime.response", "status": status, "status_details": details,
                "output": [o.item.as_dict() for o in self.outputs], "conversation_id": self.config.id,
                "output_modalities": list(self.config.output_modalities),
                "max_output_tokens": self.config.max_output_tokens or "inf",
                "audio": {"output": {"format": PCM, "voice": self.config.voice or "default"}},
                "usage": usage, "metadata": self.metadata}

    @property
    def active(self) -> bool:
        """Whether it still counts as the session's response (until its `response.done` is being sent)."""
        return not self.done

    async def run(self) -> None:
        await self._send(server_event("response.created", response=self.body("in_progress")))
        final: orchestrator_pb2.Final | None = None
        use = self.config.tool_use()
        stream = ToolCallStream(use.prefix, use.max_calls) if use.tools else None
        failure: RealtimeError | None = None
        try:
            async with self.call:
                async for ev in self.call:
                    if self.cancel_reason is not None:  # cancelled before the Call started: closed here
                        break
                    kind = ev.WhichOneof("event")
                    if kind == "text":
                        for piece in stream.feed(ev.text.text) if stream else [TextPiece(ev.text.text)]:
                            await self._text_event(piece)
                        if stream is not None and stream.done:  # the last call allowed is read: no more needed
                            break
                    elif kind == "audio":
                        await self._audio(to_24k(ev.audio))
                    elif kind == "final":
                        final = ev.final
                for piece in stream.close() if stream else []:
                    await self._text_event(piece)
        except ClientGone:
            pass  # cancelled: below
        except ApiError as e:
            failure = of_api_error(e)
        except Exception as e:
            log.exception("realtime response %s failed", self.id)
            failure = RealtimeError("server_error", f"the response failed ({type(e).__name__})", kind="server_error")
        finally:
            self.done = True  # from here a new response may start: this one only reports how it ended
        if self.cancel_reason is not None:
            await self._finish("incomplete")
            await self._send(server_event("response.done", response=self.body(
                "cancelled", {"type": "cancelled", "reason": self.cancel_reason}, self._usage(None))))
        elif failure is not None:
            await self._finish("incomplete")
            await self._send(error_event(failure))
            await self._send(server_event("response.done", response=self.body(
                "failed", {"type": "failed", "error": {"type": failure.kind, "code": failure.code,
                                                       "message": failure.message}}, self._usage(None))))
        else:
            await self._finish("completed")
            length = final is not None and final.finish_reason == "length"
            details = {"type": "incomplete", "reason": "max_output_tokens"} if length else None
            await self._send(server_event("response.done", response=self.body(
                "incomplete" if length else "completed", details, self._usage(final))))

    # ------------------------------------------------------------------ items
    async def _open(self, item: items_.Item) -> _Output:
        out = _Output(item, len(self.outputs))
        self.outputs.append(out)
        item.status = "in_progress"
        previous = self.conversation.last_id()
        _, dropped = self.conversation.add(item)
        for item_id in dropped:
            await self._send(server_event("conversation.item.deleted", item_id=item_id))
        await self._send(server_event("response.output_item.added", response_id=self.id, output_index=out.index,
                                      item=item.as_dict()))
        await self._send(server_event("conversation.item.added", previous_item_id=previous, item=item.as_dict()))
        return out

    async def _message(self) -> _Output:
        if self.message is None:
            item = items_.assistant_message(new_id("item"), "", self.audio)
            item.shown = []
            self.message = await self._open(item)
            part: dict[str, Any] = {"type": "audio", "transcript": ""} if self.audio else {"type": "text", "text": ""}
            await self._send(self._on(self.message, "response.content_part.added", part=part))
        return self.message

    def _on(self, out: _Output, kind: str, **fields: Any) -> dict:
        return server_event(kind, response_id=self.id, item_id=out.item.id, output_index=out.index,
                            content_index=0, **fields)

    async def _text_event(self, piece: TextPiece | CallStarted | CallArguments) -> None:
        if isinstance(piece, TextPiece):
            if not piece.text:
                return
            out = await self._message()
            out.text.append(piece.text)
            kind = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
            await self._send(self._on(out, kind, delta=piece.text))
        elif isinstance(piece, CallStarted):
            item = items_.Item(new_id("item"), "function_call", call_id=piece.id, name=piece.name)
            self.calls[piece.index] = await self._open(item)
        else:
            out = self.calls[piece.index]
            out.item.arguments += piece.fragment
            await self._send(server_event("response.function_call_arguments.delta", response_id=self.id,
                                          item_id=out.item.id, output_index=out.index, call_id=out.item.call_id,
                                          delta=piece.fragment))

    async def _audio(self, pcm: bytes) -> None:
        if not pcm or not self.audio:
            return
        out = await self._message()
        out.item.audio_ms += len(pcm) * 1000 // BYTES_PER_SECOND
        await self._send(self._on(out, "response.output_audio.delta", delta=base64.b64encode(pcm).decode("ascii")))

    async def _finish(self, status: str) -> None:
        """Close every output item (their `.done` events), and keep them in the conversation."""
        for out in self.outputs:
            item = out.item
            if item.type == "message":
                text = "".join(out.text)
                done = items_.assistant_message(item.id, text, self.audio, status)
                item.parts, item.shown, item.status = done.parts, done.shown, status
                if self.audio:
                    await self._send(self._on(out, "response.output_audio.done"))
                    await self._send(self._on(out, "response.output_audio_transcript.done", transcript=text))
                    part: dict[str, Any] = {"type": "audio", "transcript": text}
                else:
                    await self._send(self._on(out, "response.output_text.done", text=text))
                    part = {"type": "text", "text": text}
                await self._send(self._on(out, "response.content_part.done", part=part))
            else:
                item.status = status
                await self._send(server_event("response.function_call_arguments.done", response_id=self.id,
                                              item_id=item.id, output_index=out.index, call_id=item.call_id,
                                              name=item.name, arguments=item.arguments))
            await self._send(server_event("response.output_item.done", response_id=self.id, output_index=out.index,
                                          item=item.as_dict()))
            await self._send(server_event("conversation.item.done", item=item.as_dict()))

    def _usage(self, final: orchestrator_pb2.Final | None) -> dict:
        prompt = final.usage.prompt_tokens if final else 0
        completion = final.usage.completion_tokens if final else 0
        return {"total_tokens": prompt + completion, "input_tokens": prompt, "output_tokens": completion,
                "input_token_details": {"cached_tokens": 0}, "output_token_details": {"text_tokens": completion}}
