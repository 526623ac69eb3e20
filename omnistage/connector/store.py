"""The interface of a backend that holds tensors for consumers to fetch by reference, and what it keeps
after they did.

With `retain_fetched` (a stage's data plane sets it), a tensor whose last reader fetched it is kept, not
freed: the consumer's call may still fail and be retried on another replica, which fetches the same
reference again (orchestrator_service/stage_call.py). Kept tensors go when the request is released (the
orchestrator does so once the request ended), after the TTL, or first when a put needs their room
(`evict_fetched`), so keeping them never holds a producer back: a retry then finds its input gone and
fails, where without keeping every retry would.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from omnistage.connector.held import Held, HeldIndex
from omnistage.connector.keys import TensorKey
from omnistage.v1 import tensor_pb2


class TensorStore(ABC):
    """Holds a producer's tensors until consumed, released or expired; fetches other producers' tensors."""

    backend: str  # the TensorRef.backend it serves

    def __init__(self, host_id: str, clock: Callable[[], float]):
        self.host_id = host_id
        self.held: HeldIndex[Any] = HeldIndex(clock=clock)
        self.retain_fetched = False  # keep a tensor after its last reader (for a retried consumer)

    @abstractmethod
    async def put(self, key: TensorKey, tensor: torch.Tensor, readers: int = 1) -> tensor_pb2.TensorRef:
        """Hold a contiguous CPU tensor under `key` for `readers` gets; the caller must not modify it after."""

    @abstractmethod
    async def get(self, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        """Fetch the tensor a reference names (one of its reads)."""

    @abstractmethod
    def _free(self, handle) -> None:
        """Give back what one held tensor occupies."""

    def consumed(self, held: Held) -> None:
        """The last reader fetched `held`: free it, or keep it for a retry when retaining."""
        if self.retain_fetched:
            held.fetched = True
        else:
            self.release([held.key], "consumed")

    def was_fetched(self, held: Held) -> bool:
        """Whether every reader has fetched `held` (a backend whose readers count elsewhere overrides it)."""
        return held.fetched

    def evict_fetched(self, nbytes: int) -> int:
        """Free kept tensors every reader already fetched, oldest first, until `nbytes` are freed (or none
        is left); returns the bytes freed."""
        freed = 0
        for held in self.held.oldest_first():
            if freed >= nbytes:
                break
            if self.was_fetched(held):
                freed += self.release([held.key], "room")
        return freed

    @property
    def unfetched_bytes(self) -> int:
        """Bytes held that some reader has still to fetch."""
        return sum(h.nbytes for h in self.held if not self.was_fetched(h))

    def release(self, keys: list[TensorKey], reason: str) -> int:
        freed = 0
        for key in keys:
            held = self.held.pop(key, reason)
            if held is not None:
                self._free(held.handle)
                freed += held.nbytes
        return freed

    @property
    def held_bytes(self) -> int:
        return self.held.nbytes

    async def close(self) -> None:
        self.release([h.key for h in self.held], "close")
