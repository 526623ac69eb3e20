"""The model's tool calls read out of its text as it streams (pure): Qwen's tool format, as the Qwen chat
templates ask for it:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallStream` takes the answer's text deltas and gives back what the client sees: text outside the
calls (`TextPiece`), and each call as it appears: its name once the opening `{"name": "...", "arguments": `
is read (`CallStarted`), then its arguments in fragments as they come (`CallArguments`). A call's arguments
are the model's JSON text as written (OpenAI's `arguments` is a string, and may not be valid JSON); the
closing `}` of the call's object and the `</tool_call>` are never part of them. A block that does not open
as a call is text. Text that may be the start of a `<tool_call>`, and the tail of a call that may be its
closing, are held back until the next delta decides them.

A forced call (an answer prefix that opens one: `prefix`) is read as if the model had written the prefix.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The call's object up to its arguments' value: {"name": "NAME", "arguments": (whitespace as JSON allows)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
# A call's head is its name (at most 64 characters) in a few characters of JSON: a block without one by then
# is not a call.
HEAD_CHARS = 160
# What may end a call after its arguments: the object's `}`, whitespace, the closing tag.
_TAIL = re.compile(r"\s*\}?\s*$")


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    fragment: str


Event = TextPiece | CallStarted | CallArguments


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def call_prefix(name: str | None) -> str:
    """The answer prefix that makes the model call `name` (None: some function; it writes the name)."""
    return f'{OPEN}\n{{"name": "' + (f'{name}", "arguments": ' if name is not None else "")


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""


class ToolCallStream:
    def __init__(self, prefix: str = "", max_calls: int | None = None):
        """`max_calls`: calls read at most (None: any); text and calls after the last one are dropped
        (`done` then says the answer needs no more)."""
        self.calls: list[Call] = []
        self.max_calls = max_calls
        self._texts: list[str] = []
        self._buf = ""           # text not yet decided
        self._in_call = False    # inside <tool_call>...: `_buf` is the block read so far
        self._head_read = False  # the block's head (name) is read: `_buf` is arguments + what may close them
        self._pending: list[Event] = []
        if prefix:
            self._pending = self.feed(prefix)

    @property
    def done(self) -> bool:
        return self.max_calls is not None and len(self.calls) >= self.max_calls and not self._in_call

    @property
    def text(self) -> str:
        """Everything the client got as text so far (a non-streamed answer's content)."""
        return "".join(self._texts)

    def feed(self, delta: str) -> list[Event]:
        out, self._pending = self._pending, []
        if self.done:
            return out
        self._buf += delta
        while not self.done:
            before = (self._buf, self._in_call, self._head_read)
            out += self._step(final=False)
            if (self._buf, self._in_call, self._head_read) == before:
                break
        return self._record(out)

    def close(self) -> list[Event]:
        """The end of the answer: whatever is held back is decided (an unclosed call keeps the arguments
        read; a half-read head or a partial opening tag is text)."""
        out, self._pending = self._pending, []
        while not self.done and (self._buf or self._in_call):
            out += self._step(final=True)
        self._buf = ""
        return self._record(out)

    def _record(self, events: list[Event]) -> list[Event]:
        self._texts += [e.text for e in events if isinstance(e, TextPiece)]
        return [e for e in events if not (isinstance(e, TextPiece) and not e.text)]

    def _step(self, final: bool) -> list[Event]:
        if not self._in_call:
            return self._outside(final)
        if not self._head_read:
            return self._head(final)
        return self._arguments(final)

    def _outside(self, final: bool) -> list[Event]:
        at = self._buf.find(OPEN)
        if at >= 0:
            text, self._buf = self._buf[:at], self._buf[at + len(OPEN):]
            self._in_call = True
            return [TextPiece(text)]
        keep = 0 if final else _partial_suffix(self._buf, OPEN)
        text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return [TextPiece(text)]

    def _head(self, final: bool) -> list[Event]:
        m = _HEAD.match(self._buf)
        name = _json_string(m.group(1)) if m is not None else None
        if name is not None and (m.end() < len(self._buf) or final):  # whitespace after it read whole
            self._head_read = True
            self.calls.append(Call(new_call_id(), name))
            self._buf = self._buf[m.end():]
            return [CallStarted(len(self.calls) - 1, self.calls[-1].id, self.calls[-1].name)]
        closed = self._buf.find(CLOSE)
        if final or closed >= 0 or not _may_become_head(self._buf) or (m is not None and name is None):
            # Not a call: the block is text, as the model wrote it.
            self._in_call = False
            text = OPEN + self._buf
            self._buf = ""
            return [TextPiece(text)]
        return []

    def _arguments(self, final: bool) -> list[Event]:
        call = self.calls[-1]
        index = len(self.calls) - 1
        closed = self._buf.find(CLOSE)
        if closed >= 0:
            body, self._buf = self._buf[:closed], self._buf[closed + len(CLOSE):]
            fragment = _without_tail(body)
            self._in_call = self._head_read = False
            call.arguments += fragment
            return [CallArguments(index, fragment)] if fragment else []
        if final:
            fragment = _without_tail(self._buf)
            self._buf = ""
            self._in_call = self._head_read = False
            call.arguments += fragment
            return [CallArguments(index, fragment)] if fragment else []
        # Hold back what may still be the call's closing: its `}`, whitespace, a partial </tool_call>.
        keep = _partial_suffix(self._buf, CLOSE)
        body = self._buf[:len(self._buf) - keep]
        tail = _TAIL.search(body)
        cut = tail.start() if tail else len(body)
        fragment, self._buf = self._buf[:cut], self._buf[cut:]
        call.arguments += fragment
        return [CallArguments(index, fragment)] if fragment else []


def _json_string(literal: str) -> str | None:
    """A JSON string literal's value; None for one JSON does not allow (a raw newline, a bad escape): then the
    block is no call."""
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) and value else None


def _without_tail(body: str) -> str:
    """A call's arguments text: its block less the object's closing `}` and the whitespace around it."""
    body = body.rstrip()
    if body.endswith("}"):
        body = body[:-1]
    return body.rstrip()


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _may_become_head(text: str) -> bool:
    """Whether more text could still make `text` the head of a call: a head is short, so a block that has
    not shown one within HEAD_CHARS is text."""
    return len(text) < HEAD_CHARS
