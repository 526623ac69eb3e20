"""Realtime events: a client event read and checked (strict types, unknown fields refused), a server event
built (each with its own `event_id`), and any failure as an `error` event in the reference's shape
`{"type": "error", "event_id", "error": {"type", "code", "message", "param", "event_id"}}`, where
`error.event_id` is the client event at fault. The models are this server's: the fields it serves, and
those it refuses by name (`session.refusals`)."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Mapping, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ..errors import ApiError, field_path, from_exception
from .limits import MAX_EVENT_BYTES, MAX_TEXT_CHARS

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Id = Annotated[str, Field(max_length=64)]  # item, call and event ids, as the reference bounds them


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ------------------------------------------------------------------ session
class AudioFormat(Strict):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"] | None = None
    rate: int | None = None


class TurnDetection(Strict):
    type: Literal["server_vad", "semantic_vad"]
    threshold: float | None = None
    prefix_padding_ms: int | None = Field(None, ge=0, le=10_000)
    silence_duration_ms: int | None = Field(None, ge=0, le=10_000)
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: int | None = None
    eagerness: str | None = None


class AudioInput(Strict):
    format: AudioFormat | None = None
    turn_detection: TurnDetection | None = None
    transcription: Any = None
    noise_reduction: Any = None


class AudioOutput(Strict):
    format: AudioFormat | None = None
    voice: Annotated[str, Field(max_length=64)] | dict | None = None
    speed: float | None = None


class AudioConfig(Strict):
    input: AudioInput | None = None
    output: AudioOutput | None = None


class FunctionTool(Strict):
    type: Literal["function", "mcp"] = "function"
    name: Annotated[str, Field(max_length=64)] | None = None
    description: Text | None = None
    parameters: dict | None = None


Modalities = Annotated[list[Literal["text", "audio"]], Field(min_length=1, max_length=1)]
MaxTokens = Annotated[int, Field(ge=1)] | Literal["inf"]


class Session(Strict):
    """`session.update`'s session: only the fields given change."""

    type: Literal["realtime", "transcription"] | None = None
    model: str | None = None
    instructions: Text | None = None
    output_modalities: Modalities | None = None
    audio: AudioConfig | None = None
    max_output_tokens: MaxTokens | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    tracing: Any = None
    truncation: Any = None
    prompt: Any = None
    include: Any = None
    reasoning: Any = None


# ------------------------------------------------------------------ items
class Content(Strict):
    type: Literal["input_text", "input_audio", "input_image", "output_text", "output_audio", "text", "audio"]
    text: Text | None = None
    audio: str | None = None  # base64 pcm16 24 kHz
    transcript: Text | None = None
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class ItemBase(Strict):
    id: Id | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class MessageItem(ItemBase):
    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[Content], Field(min_length=1, max_length=16)]


class FunctionCallItem(ItemBase):
    type: Literal["function_call"]
    call_id: Id
    name: Annotated[str, Field(max_length=64)]
    arguments: Text = ""


class FunctionCallOutputItem(ItemBase):
    type: Literal["function_call_output"]
    call_id: Id
    output: Text


Item = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem], Field(discriminator="type")]


# ------------------------------------------------------------------ client events
class ClientEvent(Strict):
    event_id: Id | None = None


class SessionUpdate(ClientEvent):
    type: Literal["session.update"]
    session: Session


class AudioAppend(ClientEvent):
    type: Literal["input_audio_buffer.append"]
    audio: str


class AudioCommit(ClientEvent):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(ClientEvent):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(ClientEvent):
    type: Literal["conversation.item.create"]
    item: Item
    previous_item_id: Id | None = None


class ItemDelete(ClientEvent):
    type: Literal["conversation.item.delete"]
    item_id: Id


class ItemRetrieve(ClientEvent):
    type: Literal["conversation.item.retrieve"]
    item_id: Id


class ItemTruncate(ClientEvent):
    type: Literal["conversation.item.truncate"]
    item_id: Id
    content_index: int
    audio_end_ms: int


class ResponseParams(Strict):
    instructions: Text | None = None
    output_modalities: Modalities | None = None
    max_output_tokens: MaxTokens | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    audio: AudioConfig | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    conversation: str | None = None
    input: Any = None
    prompt: Any = None
    reasoning: Any = None


class ResponseCreate(ClientEvent):
    type: Literal["response.create"]
    response: ResponseParams | None = None


class ResponseCancel(ClientEvent):
    type: Literal["response.cancel"]
    response_id: Id | None = None


class OutputAudioClear(ClientEvent):
    type: Literal["output_audio_buffer.clear"]


AnyClientEvent = Annotated[Union[SessionUpdate, AudioAppend, AudioCommit, AudioClear, ItemCreate, ItemDelete,
                                 ItemRetrieve, ItemTruncate, ResponseCreate, ResponseCancel, OutputAudioClear],
                           Field(discriminator="type")]
_CLIENT_EVENT: TypeAdapter[Any] = TypeAdapter(AnyClientEvent)
CLIENT_EVENT_TYPES = tuple(m.model_fields["type"].annotation.__args__[0]  # type: ignore[union-attr]
                           for m in (SessionUpdate, AudioAppend, AudioCommit, AudioClear, ItemCreate, ItemDelete,
                                     ItemRetrieve, ItemTruncate, ResponseCreate, ResponseCancel,
                                     OutputAudioClear))


class RealtimeError(Exception):
    """A client event the session refuses: sent as an `error` event; the connection stays usable."""

    def __init__(self, code: str, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.code, self.message, self.param, self.kind = code, message, param, kind


def parse(message: Mapping) -> tuple[Any, str | None]:
    """A WebSocket message (its ASGI `websocket.receive`) as a client event and its event_id; RealtimeError
    naming what is wrong (the event_id, when one could be read, goes with it: `RealtimeError.event_id`)."""
    text = message.get("text")
    if text is None:
        raise RealtimeError("invalid_frame", "events are JSON text messages; a binary message carries none")
    if len(text) > MAX_EVENT_BYTES:  # in characters (the bytes are at least as many; the frame bound caps them)
        raise RealtimeError("event_too_large", f"an event is at most {MAX_EVENT_BYTES} bytes; this one has "
                                               f"{len(text)} characters")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RealtimeError("invalid_json", f"the message is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise RealtimeError("invalid_json", f"an event is a JSON object, not {type(raw).__name__}")
    event_id = raw.get("event_id") if isinstance(raw.get("event_id"), str) else None
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise _with_id(RealtimeError("missing_required_parameter" if kind is None else "invalid_type",
                                     "an event names its `type` as a string", "type"), event_id)
    if kind not in CLIENT_EVENT_TYPES:
        raise _with_id(RealtimeError("invalid_value", f'"{kind[:64]}" is not a client event type this server '
                                                      f'serves ({", ".join(CLIENT_EVENT_TYPES)})', "type"), event_id)
    try:
        return _CLIENT_EVENT.validate_python(raw), event_id
    except ValidationError as e:
        raise _with_id(from_validation(e), event_id) from None


def _with_id(error: RealtimeError, event_id: str | None) -> RealtimeError:
    error.event_id = event_id  # type: ignore[attr-defined]
    return error


_VALIDATION_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}


def from_validation(e: ValidationError) -> RealtimeError:
    """The first field at fault, named as the event's path (`session.audio.input.format.rate`)."""
    err = e.errors(include_url=False, include_input=False)[0]
    loc = err["loc"][1:]  # the union branch (the event type) first
    param = field_path(tuple(p for p in loc if not (isinstance(p, str) and p in ("message", "function_call",
                                                                                 "function_call_output"))))
    code = _VALIDATION_CODES.get(err["type"], "invalid_value" if "literal" in err["type"] or "_too_" in err["type"]
                                 or err["type"] in ("greater_than_equal", "less_than_equal") else "invalid_type")
    return RealtimeError(code, f"{param}: {err['msg']}" if param else err["msg"], param or None)


def of_api_error(e: ApiError) -> RealtimeError:
    """A refusal of the request path (or of a translation) as an `error` event's error."""
    return RealtimeError(e.code or e.type, e.message, e.param, e.type)


def of_exception(e: BaseException) -> RealtimeError:
    return e if isinstance(e, RealtimeError) else of_api_error(from_exception(e))


# ------------------------------------------------------------------ server events
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def server_event(kind: str, **fields: Any) -> dict:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(error: RealtimeError, event_id: str | None = None) -> dict:
    return server_event("error", error={"type": error.kind, "code": error.code, "message": error.message,
                                        "param": error.param,
                                        "event_id": event_id or getattr(error, "event_id", None)})
