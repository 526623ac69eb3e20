"""Per-edge chunk ordering: chunks may arrive in any order; consumers see them in chunk-id order,
and end of stream exactly once."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class ChunkOrderError(ValueError):
    pass


class EdgeReorderBuffer(Generic[T]):
    """Holds chunks that arrived early until every chunk before them is in."""

    def __init__(self, edge: str, max_pending: int = 1024):
        self.edge = edge
        self.max_pending = max_pending
        self.next_id = 0
        self.end_id: int | None = None  # chunk id carrying end of stream
        self._pending: dict[int, T] = {}

    def push(self, chunk_id: int, item: T, end_of_stream: bool) -> list[T]:
        """Add one chunk; return the chunks now deliverable in order (possibly none)."""
        if chunk_id < self.next_id or chunk_id in self._pending:
            raise ChunkOrderError(f"edge {self.edge}: duplicate chunk {chunk_id}")
        if self.end_id is not None and chunk_id > self.end_id:
            raise ChunkOrderError(f"edge {self.edge}: chunk {chunk_id} after end of stream at {self.end_id}")
        if end_of_stream:
            if self.end_id is not None:
                raise ChunkOrderError(f"edge {self.edge}: second end of stream (chunk {chunk_id})")
            if any(k > chunk_id for k in self._pending):
                raise ChunkOrderError(f"edge {self.edge}: end of stream at {chunk_id} before later chunks")
            self.end_id = chunk_id
        if len(self._pending) >= self.max_pending:
            raise ChunkOrderError(f"edge {self.edge}: more than {self.max_pending} chunks out of order")
        self._pending[chunk_id] = item
        ready = []
        while self.next_id in self._pending:
            ready.append(self._pending.pop(self.next_id))
            self.next_id += 1
        return ready

    @property
    def finished(self) -> bool:
        return self.end_id is not None and self.next_id > self.end_id

    @property
    def pending(self) -> int:
        return len(self._pending)
