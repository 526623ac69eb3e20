"""The error a request field with a value no stage can serve raises, naming the field."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request field with a value no stage can serve; carries the field path."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
