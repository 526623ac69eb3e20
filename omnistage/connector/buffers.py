"""Receive buffers: the new tensors received bytes land in.

A receive into new memory pays first-touch page faults, and on the 2-core VMs measured those, not the copy,
dominated large receives. So a large buffer is an anonymous mapping advised to use transparent huge
pages, handed out through numpy so that when the last tensor viewing it dies the mapping returns to
a small pool (bounded in bytes); the next receive of the same rounded size reuses it, already
faulted in. Small buffers are plain torch allocations.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np
import torch

POOLED_FROM = 4 << 20     # buffers at least this big come from mappings (and go back to the pool)
GRANULE = 2 << 20         # mapping sizes are rounded up to a huge page
POOL_MAX_BYTES = 256 << 20  # idle mappings kept for reuse, at most


class _Pool:
    """Idle mappings by size, least recently returned first; over the bound, the oldest go."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.idle_bytes = 0
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()  # buffers die on whatever thread drops the last view

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if len(self._idle[i]) == size:
                    self.idle_bytes -= size
                    return self._idle.pop(i)
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            region.madvise(mmap.MADV_HUGEPAGE)
        return region

    def give_back(self, region: mmap.mmap) -> None:
        if len(region) > self.max_bytes:
            return  # dropped: unmapped once nothing refers to it
        with self._lock:
            self._idle.append(region)
            self.idle_bytes += len(region)
            while self.idle_bytes > self.max_bytes:
                self.idle_bytes -= len(self._idle.pop(0))


_POOL = _Pool(POOL_MAX_BYTES)


class _Lease:
    """Exposes a pooled mapping to numpy; numpy keeps it as the array's base, so it lives exactly as
    long as some tensor views the memory, and its end gives the mapping back."""

    def __init__(self, region: mmap.mmap):
        self.region = region
        self._view = np.frombuffer(region, dtype=np.uint8)
        self.__array_interface__ = self._view.__array_interface__

    def __del__(self):
        try:
            _POOL.give_back(self.region)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to give back to
            pass


def empty_bytes(nbytes: int) -> torch.Tensor:
    """A new uint8 tensor of `nbytes` to receive into (contents undefined)."""
    if nbytes < POOLED_FROM:
        return torch.empty(nbytes, dtype=torch.uint8)
    size = -(-nbytes // GRANULE) * GRANULE
    return torch.from_numpy(np.asarray(_Lease(_POOL.take(size)))[:nbytes])
