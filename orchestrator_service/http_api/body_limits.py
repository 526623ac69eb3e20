r"""What a request body may cost before it is parsed (pure): its size, the JSON values it may hold, and the
bytes of bodies read at once are the request byte budget's (`byte_budget`). routes.py reads bodies under these.

A body is refused on its size as it comes, and on its count of JSON values as it comes too: parsing builds a
value for each item, field and nested list (tens to hundreds of bytes each, for a JSON value of two or three
bytes: `[],` or `1,`), and a refusal of many items would name each. The count is an upper bound read from
the bytes: every JSON value but the outermost follows a `[`, `,` or `:`; these characters inside strings
count too, so a request's text is allowed one value per character. Base64 has none of them. Escapes (`\`)
are counted apart: a string of escapes (`\ud83d\ude00`, twelve bytes for one character) is the slowest for
the parser to read, so a request's text may hold two per character at most, and a media part's base64 the
share that common encoders escape (.NET's System.Text.Json writes `+` as `\u002B`, PHP's json_encode `/` as
`\/`), each counted at its longest against the size too.
"""

from __future__ import annotations

import dataclasses

from omnistage.api import Limits

from .errors import ApiError

JSON_BYTES_PER_CHAR = 6  # a character at its longest in JSON: escaped, \uXXXX
# JSON around a media part's base64: {"type": "input_audio", "input_audio": {"data": "...", "format": "wav"}},
# or an image or video as a data: URL with its media type and parameters.
PART_JSON_BYTES = 512
# JSON around a body's text and media: the other fields (model, audio, stop, modalities, a refused field set
# off), their short strings and whitespace.
BODY_SLACK = 64 << 10
CHAT_TEXT_FIELDS = 2  # chat text that may each be a whole prompt: the user's text parts, the system messages
TEXT_FIELDS = 2  # text fields of a text-only body that may each hold a whole prompt (prompt, negative_prompt)
# JSON values of one content part at most: the part, its type, its media object and that object's fields
# (nulls of the others included), and the data: URL's own `:` and `,`.
VALUES_PER_PART = 16
# JSON values of a request beyond its parts and text: its fields, system messages, stop strings, modalities,
# refused fields set off, and punctuation inside the short strings (model, voice, user, ...).
VALUES_SLACK = 2048
ESCAPES_PER_CHAR = 2  # a character beyond the BMP, escaped as a surrogate pair: \ud83d\ude00
# Escaped characters of a media part's base64 at most, 1 in this many: `+` and `/` are each 1 in 64 of base64's
# characters; an encoder escaping both escapes 1 in 32, and 1 in 24 leaves room for a part's uneven share.
BASE64_PER_ESCAPE = 24
ESCAPE_EXTRA_BYTES = 5  # an escaped base64 character at its longest: `\u002B` for `+`, five bytes more
_VALUE_MARKS = (b"[", b",", b":")


@dataclasses.dataclass(frozen=True)
class BodyBounds:
    """What one endpoint's body may be: its size in bytes, its JSON values and its escapes (as counted)."""

    size: int
    values: int
    escapes: int


def base64_bytes(n: int) -> int:
    """The length of `n` bytes in base64 (with padding)."""
    return (n + 2) // 3 * 4


def media_escapes(limits: Limits) -> int:
    """The escaped characters the base64 of every part at its largest may carry (BASE64_PER_ESCAPE)."""
    return limits.max_parts * (base64_bytes(limits.max_part_bytes) // BASE64_PER_ESCAPE)


def chat_body_limit(limits: Limits) -> int:
    """The largest chat body the pipeline's limits admit: every part at its largest in base64 (with its
    escapes), both text fields at their longest in JSON, and the rest."""
    parts = limits.max_parts * (base64_bytes(limits.max_part_bytes) + PART_JSON_BYTES) + \
        media_escapes(limits) * ESCAPE_EXTRA_BYTES
    return parts + CHAT_TEXT_FIELDS * limits.max_prompt_chars * JSON_BYTES_PER_CHAR + BODY_SLACK


def text_body_limit(limits: Limits) -> int:
    """The largest speech or images body: they carry text only, each text field a whole prompt at most."""
    return TEXT_FIELDS * limits.max_prompt_chars * JSON_BYTES_PER_CHAR + BODY_SLACK


def chat_values_limit(limits: Limits) -> int:
    """The most JSON values (as `json_values` counts them) of a chat body the limits admit."""
    return limits.max_parts * VALUES_PER_PART + CHAT_TEXT_FIELDS * limits.max_prompt_chars + VALUES_SLACK


def text_values_limit(limits: Limits) -> int:
    """The most JSON values of a speech or images body the limits admit."""
    return TEXT_FIELDS * limits.max_prompt_chars + VALUES_SLACK


def chat_bounds(limits: Limits) -> BodyBounds:
    return BodyBounds(chat_body_limit(limits), chat_values_limit(limits), media_escapes(limits) +
                      ESCAPES_PER_CHAR * CHAT_TEXT_FIELDS * limits.max_prompt_chars + VALUES_SLACK)


def text_bounds(limits: Limits) -> BodyBounds:
    return BodyBounds(text_body_limit(limits), text_values_limit(limits),
                      ESCAPES_PER_CHAR * TEXT_FIELDS * limits.max_prompt_chars + VALUES_SLACK)


class BodyScan:
    """The count of one body's JSON values and escapes as its pieces come; past a bound, 400 at once."""

    def __init__(self, bounds: BodyBounds):
        self.bounds, self.values, self.escapes = bounds, 0, 0

    def add(self, piece: bytes) -> None:
        self.values += json_values(piece)
        if self.values > self.bounds.values:
            raise ApiError(400, f"the body has more than {self.bounds.values} JSON values (items, fields, nested "
                                "lists); a request within this pipeline's limits has fewer", code="too_many_values")
        self.escapes += piece.count(b"\\")
        if self.escapes > self.bounds.escapes:
            raise ApiError(400, f"the body has more than {self.bounds.escapes} escaped characters (\\ in strings); "
                                "a request within this pipeline's limits has fewer", code="too_many_escapes")


def json_values(piece: bytes | bytearray) -> int:
    """An upper bound on the JSON values that begin in `piece` (a piece of a body: no state is needed
    between pieces, each mark is one byte)."""
    return sum(piece.count(mark) for mark in _VALUE_MARKS)
