"""The conversation of a Realtime session: its items in order, bounded, and read as the turns of one
GenerateRequest (a system turn of the instructions first).

Bounds (limits.SessionLimits): at most `items` items, `parts` media parts in a request (the pipeline's
maxParts; text is bounded by characters) and `audio_s` seconds of audio in all its parts. An item that would
go past them drops the oldest items (`dropped`, for `conversation.item.deleted`), as the reference truncates
a long conversation
from its start; a tool output whose call was dropped goes with it (a tool turn answers a call before it).
One item that alone is past a bound is refused. The text bound (`chars`, the pipeline's maxPromptChars) is
kept when a response is asked for (`fit`): the instructions and tools it offers take their share first.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field

from omnistage.v1 import common_pb2

from .events import Content, FunctionCallItem, FunctionCallOutputItem, MessageItem, RealtimeError, new_id
from .limits import BYTES_PER_SECOND, SAMPLE_RATE, SessionLimits

_DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,", re.IGNORECASE)


@dataclass
class Item:
    """One conversation item, with the content parts it puts in a request."""

    id: str
    type: str  # message, function_call, function_call_output
    role: str = ""  # a message's: user, assistant, system
    parts: list[common_pb2.ContentPart] = field(default_factory=list)
    shown: list[dict] = field(default_factory=list)  # a message's content as the reference shows it
    call_id: str = ""
    name: str = ""
    arguments: str = ""
    output: str = ""
    status: str = "completed"
    audio_ms: int = 0  # an answer's audio, as sent (what `truncate` may cut)

    @property
    def chars(self) -> int:
        """What the item adds to a request's text bound: its text parts, a call's name and arguments."""
        return sum(len(p.text) for p in self.parts) + (len(self.name) + len(self.arguments)
                                                        if self.type == "function_call" else 0)

    @property
    def audio_s(self) -> float:
        return sum(len(p.audio.data) for p in self.parts if p.WhichOneof("part") == "audio") / BYTES_PER_SECOND

    def as_dict(self) -> dict:
        base = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "message":
            return {**base, "role": self.role, "content": self.shown}
        if self.type == "function_call":
            return {**base, "call_id": self.call_id, "name": self.name, "arguments": self.arguments}
        return {**base, "call_id": self.call_id, "output": self.output}


def user_audio(pcm: bytes) -> Item:
    """The item a committed input audio buffer becomes."""
    return Item(new_id("item"), "message", "user", [_audio_part(pcm)],
                [{"type": "input_audio", "audio": None, "transcript": None}])


def assistant_message(item_id: str, text: str, audio: bool, status: str = "completed") -> Item:
    """A response's message: its text (the transcript of its audio) is what the model sees next turn."""
    shown = {"type": "output_audio", "transcript": text} if audio else {"type": "output_text", "text": text}
    return Item(item_id, "message", "assistant", [common_pb2.ContentPart(text=text)] if text else [], [shown],
                status=status)


def truncate(item: Item, content_index: int, audio_end_ms: int) -> None:
    """`conversation.item.truncate`: the answer's audio heard up to `audio_end_ms`; as the reference does, its
    transcript is deleted, so that the model is not told of words the user never heard."""
    if item.type != "message" or item.role != "assistant" or not item.audio_ms:
        raise RealtimeError("invalid_value", "only an assistant message with audio can be truncated", "item_id")
    if item.status == "in_progress":
        raise RealtimeError("invalid_value", "the item's response is in progress: truncate it after its "
                                             "response.done", "item_id")
    if content_index != 0:
        raise RealtimeError("invalid_value", f"the item has one content part (0), not {content_index}",
                            "content_index")
    if not 0 <= audio_end_ms <= item.audio_ms:
        raise RealtimeError("invalid_value", f"must be from 0 to the item's {item.audio_ms} ms of audio, got "
                                             f"{audio_end_ms}", "audio_end_ms")
    item.parts, item.shown, item.audio_ms = [], [{"type": "output_audio", "transcript": ""}], audio_end_ms


def media_parts(parts) -> int:
    """How many of `parts` are media (image, audio, video): what `maxParts` bounds."""
    return sum(1 for p in parts if p.WhichOneof("part") != "text")


def of_client(item: MessageItem | FunctionCallItem | FunctionCallOutputItem, at: str = "item") -> Item:
    """A `conversation.item.create` item; RealtimeError naming what is wrong."""
    item_id = item.id or new_id("item")
    if isinstance(item, FunctionCallItem):
        return Item(item_id, "function_call", call_id=item.call_id, name=item.name, arguments=item.arguments)
    if isinstance(item, FunctionCallOutputItem):
        # An empty output (a tool that returns nothing): a tool turn without content, as the request path takes it.
        output = [common_pb2.ContentPart(text=item.output)] if item.output else []
        return Item(item_id, "function_call_output", parts=output, call_id=item.call_id, output=item.output)
    parts, shown = [], []
    for i, c in enumerate(item.content):
        part, show = _content(c, item.role, f"{at}.content[{i}]")
        if part is not None:
            parts.append(part)
        shown.append(show)
    return Item(item_id, "message", item.role, parts, shown)


_ROLE_CONTENT = {"user": ("input_text", "input_audio", "input_image"), "system": ("input_text",),
                 "assistant": ("output_text", "output_audio", "text", "audio")}


def _content(c: Content, role: str, at: str) -> tuple[common_pb2.ContentPart | None, dict]:
    if c.type not in _ROLE_CONTENT[role]:
        raise RealtimeError("invalid_value", f'{at}.type: a {role} message holds {", ".join(_ROLE_CONTENT[role])}, '
                                             f'not "{c.type}"', f"{at}.type")
    if c.type == "input_text":
        if not _required(c.text, f"{at}.text"):  # the request path takes no empty text: refused here, not later
            raise RealtimeError("invalid_value", f"{at}.text: is empty", f"{at}.text")
        return common_pb2.ContentPart(text=c.text), {"type": c.type, "text": c.text}
    if c.type == "input_audio":
        pcm = decode_audio(_required(c.audio, f"{at}.audio"), f"{at}.audio")
        if not pcm:
            raise RealtimeError("invalid_value", f"{at}.audio: holds no samples", f"{at}.audio")
        return _audio_part(pcm), {"type": c.type, "audio": None, "transcript": c.transcript}
    if c.type == "input_image":
        url = _required(c.image_url, f"{at}.image_url")
        if not (m := _DATA_URL.match(url)):
            raise RealtimeError("invalid_value", f"{at}.image_url: must be a data URL (data:image/...;base64,...)",
                                f"{at}.image_url")
        data = _b64(url[m.end():], f"{at}.image_url")
        return common_pb2.ContentPart(image=common_pb2.ImagePart(data=data)), {"type": c.type, "image_url": None}
    # an assistant's: its text, or its audio's transcript (the audio itself is not heard again)
    text = c.text if c.type in ("output_text", "text") else c.transcript
    shown = {"type": "output_text", "text": text} if c.type in ("output_text", "text") else \
        {"type": "output_audio", "transcript": text}
    return (common_pb2.ContentPart(text=text) if text else None), shown


def _required(value: str | None, param: str) -> str:
    if value is None:
        raise RealtimeError("missing_required_parameter", f"{param}: is required for this content type", param)
    return value


def _b64(text: str, param: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError("invalid_value", f"{param}: is not base64", param) from None


def decode_audio(text: str, param: str) -> bytes:
    """base64 pcm16 (whole samples) -> bytes."""
    pcm = _b64(text, param)
    if len(pcm) % 2:
        raise RealtimeError("invalid_value", f"{param}: pcm16 audio is whole 2-byte samples; got {len(pcm)} bytes",
                            param)
    return pcm


def _audio_part(pcm: bytes) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(audio=common_pb2.AudioPart(data=pcm, sample_rate=SAMPLE_RATE, channels=1))


class Conversation:
    def __init__(self, limits: SessionLimits):
        self.limits = limits
        self.items: list[Item] = []

    def get(self, item_id: str) -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise RealtimeError("item_not_found", f'no item "{item_id}" in the conversation', "item_id")

    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def add(self, item: Item, previous_item_id: str | None = None) -> tuple[str | None, list[str]]:
        """Insert `item` after `previous_item_id` ("root": first; None: last). Returns the id before it and
        the ids of the items dropped to keep within the bounds."""
        if any(i.id == item.id for i in self.items):
            raise RealtimeError("invalid_value", f'an item "{item.id}" is already in the conversation', "item.id")
        if media_parts(item.parts) > self.limits.parts or item.audio_s > self.limits.audio_s or \
                item.chars > self.limits.chars:
            raise RealtimeError("invalid_value", f"the item is larger than one request may be ({self.limits.parts}"
                                                 f" media parts, {self.limits.audio_s:g} s of audio, "
                                                 f"{self.limits.chars} characters)", "item")
        if item.type == "function_call_output" and not any(
                i.type == "function_call" and i.call_id == item.call_id for i in self.items):
            raise RealtimeError("invalid_value", f'no function_call item with call_id "{item.call_id}" to answer',
                                "item.call_id")
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = next((k + 1 for k, i in enumerate(self.items) if i.id == previous_item_id), None)  # type: ignore
            if at is None:
                raise RealtimeError("item_not_found", f'no item "{previous_item_id}" to insert after',
                                    "previous_item_id")
        self.items.insert(at, item)
        previous = self.items[at - 1].id if at else None
        return previous, self._trim(keep=item.id)

    def delete(self, item_id: str) -> list[str]:
        """Remove an item (and tool outputs left answering nothing); the ids removed."""
        item = self.get(item_id)
        self.items.remove(item)
        return [item_id, *self._orphans()]

    def fit(self, reserved_chars: int) -> list[str]:
        """Drop the oldest items until the text fits one request beside `reserved_chars` (the instructions,
        the tools); the last item stays (alone too long, the request path says so). The ids dropped."""
        dropped: list[str] = []
        while len(self.items) > 1 and reserved_chars + sum(i.chars for i in self.items) > self.limits.chars:
            oldest = self.items.pop(0)
            dropped += [oldest.id, *self._orphans()]
        return dropped

    def clear(self) -> None:
        self.items.clear()

    def _trim(self, keep: str) -> list[str]:
        dropped: list[str] = []
        while self.items and self._over():
            oldest = next((i for i in self.items if i.id != keep), None)
            if oldest is None:
                break
            self.items.remove(oldest)
            dropped += [oldest.id, *self._orphans()]
        return dropped

    def _over(self) -> bool:
        # maxParts bounds media parts (text is bounded by characters), as on the request path.
        parts = sum(media_parts(i.parts) for i in self.items)
        return (len(self.items) > self.limits.items or parts > self.limits.parts
                or sum(i.audio_s for i in self.items) > self.limits.audio_s)

    def _orphans(self) -> list[str]:
        """Tool outputs whose call is gone: removed (each must answer a call before it)."""
        gone: list[str] = []
        called: set[str] = set()
        for item in list(self.items):
            if item.type == "function_call":
                called.add(item.call_id)
            elif item.type == "function_call_output" and item.call_id not in called:
                self.items.remove(item)
                gone.append(item.id)
        return gone

    # ------------------------------------------------------------------ as a request
    def turns(self, instructions: str) -> tuple[list[common_pb2.ContentPart], list[common_pb2.Turn]]:
        """The conversation as one request's parts and turns: the instructions as a first system turn,
        then each item; function calls join the assistant turn just before them (one turn per answer)."""
        parts: list[common_pb2.ContentPart] = []
        turns: list[common_pb2.Turn] = []
        if instructions:
            parts.append(common_pb2.ContentPart(text=instructions))
            turns.append(common_pb2.Turn(role="system", parts=1))
        calls_may_join = False
        for item in self.items:
            if item.type == "function_call":
                call = common_pb2.ToolCall(id=item.call_id, name=item.name, arguments=item.arguments)
                if calls_may_join:
                    turns[-1].tool_calls.append(call)
                else:
                    turns.append(common_pb2.Turn(role="assistant", tool_calls=[call]))
                    calls_may_join = True
                continue
            role = "tool" if item.type == "function_call_output" else item.role
            turns.append(common_pb2.Turn(role=role, parts=len(item.parts), tool_call_id=item.call_id
                                         if role == "tool" else ""))
            parts.extend(item.parts)
            calls_may_join = role == "assistant"
        return parts, turns

    def answerable(self) -> bool:
        """Whether a response has a turn to answer: the last item is the user's or a tool output."""
        return bool(self.items) and (self.items[-1].role == "user" or self.items[-1].type == "function_call_output")
