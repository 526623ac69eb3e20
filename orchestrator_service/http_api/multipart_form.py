"""A multipart/form-data body, as the OpenAI SDKs upload a file with its fields, read from its bytes (pure).

The body was read whole under the door's bounds (routes.py `Endpoints._body`); this splits it into its text
fields and its files. The count of fields is bounded here, each field's size by the body's. A body that is not
multipart, or whose multipart is cut short or malformed, is a 400 saying so; a text field that is not UTF-8 is
one naming the field.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header

from omnistage.contract.params import InvalidRequest

from .errors import bad_request

if TYPE_CHECKING:  # declared for type checkers only
    from python_multipart.multipart import MultipartCallbacks

FORM_TYPE = "multipart/form-data"
# A form without a file (fields only) as clients encode it: read too, so that its refusal names the missing file.
URLENCODED_TYPE = "application/x-www-form-urlencoded"
# Fields of one form at most: an upload's dozen fields (file, model, language, prompt, response_format,
# temperature, stream, and list fields such as include[] sent once per item) with room; more is not an upload
# this API reads, and each part costs parsing.
MAX_FIELDS = 64


@dataclass(frozen=True)
class Upload:
    """One file of the form."""

    filename: str
    content_type: str
    data: bytes


@dataclass
class Form:
    """Text fields and files by name, each name's values in the order sent (a list field `include[]` has one per
    item)."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, list[Upload]] = field(default_factory=dict)

    def text(self, name: str) -> str | None:
        """The field's one value (the last, when it came several times); None when absent."""
        values = self.fields.get(name)
        return values[-1] if values else None

    def texts(self, name: str) -> list[str]:
        """A list field's values, sent as `name[]` (as the SDKs send lists) or as `name` repeated."""
        return self.fields.get(f"{name}[]", []) + self.fields.get(name, [])


def is_form(content_type: str) -> bool:
    """Whether a body sent with this Content-Type is a form (multipart, or fields only, URL-encoded)."""
    return content_type.split(";")[0].strip().lower() in (FORM_TYPE, URLENCODED_TYPE)


def parse(body: bytes, content_type: str) -> Form:
    """The form in `body`, sent with the header `content_type`."""
    kind, options = parse_options_header(content_type)
    if kind.decode("latin-1").lower() == URLENCODED_TYPE:
        return _urlencoded(body)
    if kind.decode("latin-1").lower() != FORM_TYPE:
        raise bad_request(None, f"the body must be {FORM_TYPE} (the file and its fields, as the OpenAI SDKs "
                                f"upload it), not {kind.decode('latin-1') or 'without a Content-Type'}")
    boundary = options.get(b"boundary")
    if not boundary:
        raise bad_request(None, f"the Content-Type {FORM_TYPE} has no boundary")
    reader = _Reader()
    parser = MultipartParser(boundary, reader.callbacks())
    try:
        parser.write(body)
    except MultipartParseError as e:
        raise bad_request(None, f"the body is not valid {FORM_TYPE}: {e}") from None
    if not reader.ended:
        raise bad_request(None, f"the body is not valid {FORM_TYPE}: it ends before its closing boundary")
    return reader.form


def _urlencoded(body: bytes) -> Form:
    try:
        fields = urllib.parse.parse_qs(body.decode("utf-8"), keep_blank_values=True, strict_parsing=True,
                                       max_num_fields=MAX_FIELDS)
    except UnicodeDecodeError:
        raise bad_request(None, "the form is not UTF-8 text") from None
    except ValueError as e:
        raise bad_request(None, f"the body is not a valid {URLENCODED_TYPE} form: {e}") from None
    return Form(fields=fields)


class _Reader:
    """The parser's callbacks, gathering each part's headers and bytes."""

    def __init__(self):
        self.form, self.ended, self.count = Form(), False, 0
        self._headers: dict[str, str] = {}
        self._name, self._value = b"", b""
        self._data: list[memoryview] = []  # views of the body: the part's bytes are copied once, when joined

    def callbacks(self) -> MultipartCallbacks:
        return {"on_part_begin": self._begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_part_data": self._part_data, "on_part_end": self._part_end, "on_end": self._end}

    def _begin(self) -> None:
        self.count += 1
        if self.count > MAX_FIELDS:
            raise bad_request(None, f"the form has more than {MAX_FIELDS} fields")
        self._headers, self._data = {}, []

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._name += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._name.decode("latin-1").lower()] = self._value.decode("latin-1")
        self._name, self._value = b"", b""

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        self._data.append(memoryview(data)[start:end])

    def _part_end(self) -> None:
        _, options = parse_options_header(self._headers.get("content-disposition", ""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if not name:
            raise bad_request(None, f"a part of the {FORM_TYPE} body has no name")
        data, self._data = b"".join(self._data), []
        if b"filename" in options:
            self.form.files.setdefault(name, []).append(Upload(
                options[b"filename"].decode("utf-8", "replace"), self._headers.get("content-type", ""), data))
            return
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(name, "is not UTF-8 text") from None
        self.form.fields.setdefault(name, []).append(text)

    def _end(self) -> None:
        self.ended = True
