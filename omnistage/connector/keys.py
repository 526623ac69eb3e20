"""The key of one tensor in the data plane: (request_id, stage, chunk_id, tensor name).

On the wire (TensorRef.key) it is "<request_id>/<stage>/<chunk_id>/<name>" with each text part
percent-encoded, so a request id that contains "/" still parses back to the same key.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote


@dataclass(frozen=True)
class TensorKey:
    request_id: str
    stage: str
    chunk_id: int
    name: str

    def __post_init__(self):
        for part in ("request_id", "stage", "name"):
            value = getattr(self, part)
            if not isinstance(value, str) or not value:
                raise ValueError(f"tensor key: {part} must be a non-empty string, got {value!r}")
        if not isinstance(self.chunk_id, int) or isinstance(self.chunk_id, bool) or self.chunk_id < 0:
            raise ValueError(f"tensor key: chunk_id must be an integer >= 0, got {self.chunk_id!r}")

    @property
    def wire(self) -> str:
        q = lambda s: quote(s, safe="")  # noqa: E731 - one encoding for the three text parts
        return f"{q(self.request_id)}/{q(self.stage)}/{self.chunk_id}/{q(self.name)}"

    @classmethod
    def parse(cls, wire: str) -> "TensorKey":
        parts = wire.split("/")
        if len(parts) != 4 or not parts[2].isdigit():
            raise ValueError(f'tensor key "{wire}" is not "<request_id>/<stage>/<chunk_id>/<name>"')
        return cls(unquote(parts[0]), unquote(parts[1]), int(parts[2]), unquote(parts[3]))
