"""What a producer's store holds: tensors by key, their bytes, and when they were put.

One index per store; both backends (shared memory, UCX) keep their bookkeeping here, so held
bytes, release by chunk or request, and expiry by age mean the same thing everywhere. A store that
keeps fetched tensors for a retried consumer (store.py) marks them `fetched` instead of freeing them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, TypeVar

from omnistage.connector.keys import TensorKey

H = TypeVar("H")


@dataclass
class Held(Generic[H]):
    key: TensorKey
    nbytes: int
    handle: H           # the backend's own record (segment path, pinned tensor)
    put_at: float       # clock time of the put, for the TTL
    readers: int = 1    # gets still to come before it counts as consumed
    fetched: bool = False  # every reader got it; kept only so a retried consumer can fetch it again


@dataclass
class HeldIndex(Generic[H]):
    """Held tensors by key, with per-request lookup and a running byte total.

    `on_release(nbytes, reason)` runs after every removal so a waiting producer can wake up.
    """

    clock: Callable[[], float] = time.monotonic
    on_release: Callable[[int, str], None] | None = None
    _items: dict[TensorKey, Held[H]] = field(default_factory=dict)
    _by_request: dict[str, set[TensorKey]] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, key: TensorKey, nbytes: int, handle: H, readers: int) -> Held[H]:
        if key in self._items:
            raise KeyError(f"tensor {key.wire} is already held; a chunk's tensors are put once")
        held = Held(key, nbytes, handle, self.clock(), readers)
        self._items[key] = held
        self._by_request.setdefault(key.request_id, set()).add(key)
        self.nbytes += nbytes
        return held

    def get(self, key: TensorKey) -> Held[H] | None:
        return self._items.get(key)

    def pop(self, key: TensorKey, reason: str) -> Held[H] | None:
        held = self._items.pop(key, None)
        if held is None:
            return None
        keys = self._by_request.get(key.request_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_request[key.request_id]
        self.nbytes -= held.nbytes
        if self.on_release is not None:
            self.on_release(held.nbytes, reason)
        return held

    def select(self, request_id: str, chunk_id: int | None = None) -> list[TensorKey]:
        keys = self._by_request.get(request_id, ())
        return [k for k in keys if chunk_id is None or k.chunk_id == chunk_id]

    def oldest_first(self) -> list[Held[H]]:
        return sorted(self._items.values(), key=lambda h: h.put_at)

    def older_than(self, max_age_s: float, now: float | None = None) -> list[TensorKey]:
        cutoff = (self.clock() if now is None else now) - max_age_s
        return [k for k, h in self._items.items() if h.put_at <= cutoff]

    def __iter__(self) -> Iterator[Held[H]]:
        return iter(list(self._items.values()))

    def __len__(self) -> int:
        return len(self._items)
