"""The Realtime WebSocket: the session's events read one at a time, each handled in order and answered
(or refused with an `error` event: the connection stays usable); a response runs in a task of its own while
events keep coming (audio, `response.cancel`, barge-in). When the connection ends, the response in progress
is cancelled through every stage and the session's audio and items go with it."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable, Mapping

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omnistage.api import Pipeline
from omnistage.contract.params import InvalidRequest
from omnistage.v1 import orchestrator_pb2

from ...voices import Voices
from ..call import Call
from ..errors import error_response, from_exception
from ..translate import check_model
from . import events as ev
from . import items
from .audio_buffer import AudioBuffer, ms_of
from .events import RealtimeError, error_event, new_id, server_event
from .items import Conversation
from .limits import BYTES_PER_SECOND, SessionLimits
from .runner import FIELDS, Response, request_for
from .session import SessionConfig, Vad
from .vad import FRAME_BYTES, START_MS, Segmenter, SpeechStarted, webrtc_classifier

log = logging.getLogger("omnistage.orchestrator.http_api")
MIN_COMMIT_MS = 100  # the reference's least audio in a committed buffer
MakeCall = Callable[[WebSocket, orchestrator_pb2.GenerateRequest, Mapping[str, str]], Call]


class RealtimeEndpoint:
    """The `/v1/realtime` route's endpoint: the model checked before the upgrade (404 as on every endpoint),
    then one RealtimeSession for the connection."""

    def __init__(self, pipeline: Pipeline, make_call: MakeCall, voices: Voices | None = None):
        """`voices`: the audio output's (the request path's check, made here when a session names one)."""
        self.pipeline, self.make_call, self.voices = pipeline, make_call, voices
        self.limits = SessionLimits.of(pipeline.limits)

    async def serve(self, websocket: WebSocket) -> None:
        try:
            check_model(websocket.query_params.get("model"), self.pipeline)
        except Exception as e:  # noqa: BLE001 - the refusal is the handshake's answer
            await websocket.send_denial_response(error_response(from_exception(e)))
            return
        await websocket.accept()
        await RealtimeSession(websocket, self.pipeline, self.limits, self.make_call, self.voices).serve()


class RealtimeSession:
    def __init__(self, websocket: WebSocket, pipeline: Pipeline, limits: SessionLimits, make_call: MakeCall,
                 voices: Voices | None = None):
        self.ws, self.make_call, self.voices = websocket, make_call, voices
        self.config = SessionConfig.initial(new_id("sess"), pipeline)
        self.conversation = Conversation(limits)
        self.buffer = AudioBuffer(limits.buffered_audio_s)
        self.segmenter = self._segmenter(self.config.vad)
        self.speech_item: str | None = None  # the item id server VAD gave the speech in progress
        self.response: Response | None = None
        self.task: asyncio.Task | None = None
        self._sending = asyncio.Lock()  # the loop and the response task send; one event at a time, whole

    async def serve(self) -> None:
        try:
            await self.send(server_event("session.created", session=self.config.as_dict()))
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                await self.handle(message)
        except WebSocketDisconnect:
            return
        finally:
            if self.task is not None:  # the connection is over: what is left of the response is cancelled
                self.task.cancel()
                await asyncio.wait([self.task])
            self.buffer.clear()
            self.conversation.clear()

    async def send(self, event: dict) -> None:
        text = json.dumps(event, separators=(",", ":"))
        async with self._sending:
            if self.ws.application_state == WebSocketState.CONNECTED:
                await self.ws.send_text(text)

    async def handle(self, message: Mapping) -> None:
        event_id = None
        try:
            event, event_id = ev.parse(message)
            await self._dispatch(event)
        except RealtimeError as e:
            await self.send(error_event(e, event_id))
        except WebSocketDisconnect:
            raise
        except Exception as e:  # noqa: BLE001 - a fault here is this event's answer; the session goes on
            await self.send(error_event(ev.of_exception(e), event_id))

    async def _dispatch(self, e) -> None:
        if isinstance(e, ev.SessionUpdate):
            config = self.config.updated(e.session)
            self._check_voice(config, "session.audio.output.voice")
            if config.vad != self.config.vad:
                self.segmenter = self._segmenter(config.vad)
            self.config = config
            await self.send(server_event("session.updated", session=config.as_dict()))
        elif isinstance(e, ev.AudioAppend):
            await self._append(items.decode_audio(e.audio, "audio"))
        elif isinstance(e, ev.AudioCommit):
            await self._commit()
        elif isinstance(e, ev.AudioClear):
            self.buffer.clear()
            self._speech_over()
            await self.send(server_event("input_audio_buffer.cleared"))
        elif isinstance(e, ev.ItemCreate):
            await self._add(items.of_client(e.item), e.previous_item_id)
        elif isinstance(e, ev.ItemDelete):
            for item_id in self.conversation.delete(e.item_id):
                await self.send(server_event("conversation.item.deleted", item_id=item_id))
        elif isinstance(e, ev.ItemRetrieve):
            item = self.conversation.get(e.item_id)
            await self.send(server_event("conversation.item.retrieved", item=item.as_dict()))
        elif isinstance(e, ev.ItemTruncate):
            items.truncate(self.conversation.get(e.item_id), e.content_index, e.audio_end_ms)
            await self.send(server_event("conversation.item.truncated", item_id=e.item_id,
                                         content_index=e.content_index, audio_end_ms=e.audio_end_ms))
        elif isinstance(e, ev.ResponseCreate):
            await self._respond(e.response)
        elif isinstance(e, ev.ResponseCancel):
            if self.response is None or not self.response.active:
                raise RealtimeError("response_cancel_not_active", "there is no response in progress to cancel")
            if e.response_id not in (None, self.response.id):
                raise RealtimeError("invalid_value", f'"{e.response_id}" is not the response in progress '
                                                     f'("{self.response.id}")', "response_id")
            await self.response.cancel("client_cancelled")
        elif isinstance(e, ev.OutputAudioClear):
            raise RealtimeError("unsupported_event", "output_audio_buffer.clear is for WebRTC and SIP connections; "
                                                     "over a WebSocket the client holds the output audio", "type")

    def _check_voice(self, config: SessionConfig, param: str) -> None:
        """The voice a session or a response names, checked as the request path will, before anything runs."""
        if self.voices is None or "audio" not in config.output_modalities:
            return
        try:
            self.voices.choose(config.voice)
        except InvalidRequest as e:
            raise RealtimeError("invalid_value", f"{param}: {str(e).split(': ', 1)[-1]}", param) from None

    # ------------------------------------------------------------------ input audio
    def _segmenter(self, vad: Vad | None) -> Segmenter | None:
        return Segmenter(vad.silence_duration_ms, webrtc_classifier(vad.threshold)) if vad else None

    async def _append(self, pcm: bytes) -> None:
        vad, segmenter = self.config.vad, self.segmenter
        if vad is None or segmenter is None:
            self.buffer.append(pcm)
            return
        # Frame by frame, each turn's start and end acted on where it falls: one append may hold several turns.
        for at in range(0, len(pcm), FRAME_BYTES):
            piece = pcm[at:at + FRAME_BYTES]
            if segmenter.in_speech and len(self.buffer) + len(piece) > self.buffer.max_bytes:
                # A turn longer than the buffer holds ends here, as a pause would end it: committed and answered
                # (else every later append would be refused and the turn would never end).
                await self._speech_stopped(vad, self.buffer.end_ms)
            self.buffer.append(piece)
            for turn in segmenter.feed(piece):
                if isinstance(turn, SpeechStarted):
                    self.speech_item = new_id("item")
                    await self.send(server_event("input_audio_buffer.speech_started", item_id=self.speech_item,
                                                 audio_start_ms=turn.audio_start_ms))
                    self.buffer.keep_from(turn.audio_start_ms - vad.prefix_padding_ms)
                    if vad.interrupt_response and self.response is not None and self.response.active:
                        self.response.cancel("turn_detected")  # barge-in: the answer stops through every stage
                else:
                    await self._speech_stopped(vad, turn.audio_end_ms)
            if not segmenter.in_speech:  # before speech: only the padding the next turn starts with is kept
                self.buffer.keep_last(vad.prefix_padding_ms + START_MS)

    async def _speech_stopped(self, vad: Vad, audio_end_ms: int) -> None:
        """The end of a turn: committed, and answered when the session says so."""
        await self.send(server_event("input_audio_buffer.speech_stopped", item_id=self.speech_item,
                                     audio_end_ms=audio_end_ms))
        await self._commit(self.speech_item)
        if self.response is not None and self.response.cancel_reason and self.task is not None:
            await asyncio.wait([self.task])  # the interrupted answer reports its end first
        if vad.create_response and not (self.response is not None and self.response.active):
            await self._respond(None)

    async def _commit(self, item_id: str | None = None) -> None:
        if ms_of(len(self.buffer)) < MIN_COMMIT_MS:
            raise RealtimeError("input_audio_buffer_commit_empty",
                                f"the input audio buffer holds {len(self.buffer) / BYTES_PER_SECOND * 1000:.0f} ms; "
                                f"a commit needs at least {MIN_COMMIT_MS} ms of audio")
        item = items.user_audio(self.buffer.take())
        if item_id:
            item.id = item_id
        self._speech_over()
        previous, dropped = self.conversation.add(item)
        await self.send(server_event("input_audio_buffer.committed", item_id=item.id, previous_item_id=previous))
        await self._announce(item, previous, dropped)

    def _speech_over(self) -> None:
        self.speech_item = None
        if self.segmenter is not None:
            self.segmenter.reset()

    # ------------------------------------------------------------------ items and responses
    async def _add(self, item: items.Item, previous_item_id: str | None) -> None:
        previous, dropped = self.conversation.add(item, previous_item_id)
        await self._announce(item, previous, dropped)

    async def _announce(self, item: items.Item, previous: str | None, dropped: list[str]) -> None:
        for item_id in dropped:
            await self.send(server_event("conversation.item.deleted", item_id=item_id))
        await self.send(server_event("conversation.item.added", previous_item_id=previous, item=item.as_dict()))
        await self.send(server_event("conversation.item.done", previous_item_id=previous, item=item.as_dict()))

    async def _respond(self, params: ev.ResponseParams | None) -> None:
        if self.response is not None and self.response.active:
            raise RealtimeError("conversation_already_has_active_response",
                                f'the response "{self.response.id}" is in progress: one at a time (cancel it with '
                                f'response.cancel, or wait for its response.done)')
        config = self.config.for_response(params)
        self._check_voice(config, "response.audio.output.voice")
        reserved = config.reserved_chars()  # a tool choice naming what is not offered: refused before anything runs
        if not self.conversation.answerable():
            raise RealtimeError("invalid_value", "the conversation has no turn to answer: its last item must be a user "
                                                 "message or a function_call_output")
        for item_id in self.conversation.fit(reserved):
            await self.send(server_event("conversation.item.deleted", item_id=item_id))
        call = self.make_call(self.ws, request_for(config, self.conversation), FIELDS)
        self.response = Response(config, self.conversation, call, self.send, params.metadata if params else None)
        self.task = asyncio.create_task(self._run(self.response), name=f"realtime-{self.response.id}")

    async def _run(self, response: Response) -> None:
        try:
            await response.run()
        except WebSocketDisconnect:
            pass  # the connection's end cancels what is left
        except Exception:
            log.exception("Realtime: response %s failed", response.id)
