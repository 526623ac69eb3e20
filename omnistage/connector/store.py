"""The interface of a backend that holds tensors for consumers to fetch by reference."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from omnistage.v1 import tensor_pb2

from .held import HeldIndex
from .keys import TensorKey


class TensorStore(ABC):
    """Holds a producer's tensors until consumed, released or expired; fetches other producers' tensors."""

    backend: str  # the TensorRef.backend it serves

    def __init__(self, host_id: str, clock: Callable[[], float]):
        self.host_id = host_id
        self.held = HeldIndex(clock=clock)

    @abstractmethod
    async def put(self, key: TensorKey, tensor: torch.Tensor, readers: int = 1) -> tensor_pb2.TensorRef:
        """Hold a contiguous CPU tensor under `key` for `readers` gets; the caller must not modify it after."""

    @abstractmethod
    async def get(self, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        """Fetch the tensor a reference names (one of its reads)."""

    @abstractmethod
    def _free(self, handle) -> None:
        """Give back what one held tensor occupies."""

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
