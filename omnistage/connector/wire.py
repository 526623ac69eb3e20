"""The fixed-size header that describes a tensor's bytes: dtype, shape, size.

It heads every shared-memory segment (with a count of readers still to come) and every UCX reply
(with a status), so a consumer holding only a TensorRef rebuilds the tensor bit for bit.
"""

from __future__ import annotations

import asyncio
import math
import struct
from dataclasses import dataclass

import torch

from omnistage.connector.errors import ConnectorError
from omnistage.contract.tensors import TensorFormatError, proto_dtype, torch_dtype

HEADER_BYTES = 128
MAX_DIMS = 12
_MAGIC = b"OSTN"
_FIXED = struct.Struct("<4sHHQII")  # magic, status, dtype code, nbytes, ndim, readers
_DIMS_AT = _FIXED.size  # then MAX_DIMS int64

# reply status of a UCX get
OK, NOT_FOUND, BAD_REQUEST = 0, 1, 2


@dataclass
class TensorHeader:
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    readers: int = 0   # shm: consumers still to read it; the last one removes the segment
    status: int = OK

    @classmethod
    def of(cls, t: torch.Tensor, readers: int = 0) -> "TensorHeader":
        if t.dim() > MAX_DIMS:
            raise ConnectorError(f"tensor has {t.dim()} dimensions; the connector carries at most {MAX_DIMS}")
        proto_dtype(t.dtype)  # refuses dtypes the wire cannot name
        return cls(t.dtype, tuple(t.shape), t.numel() * t.element_size(), readers)

    def pack(self) -> bytes:
        code = proto_dtype(self.dtype) if self.status == OK else 0
        dims = list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        out = _FIXED.pack(_MAGIC, self.status, code, self.nbytes, len(self.shape), self.readers)
        return (out + struct.pack(f"<{MAX_DIMS}q", *dims)).ljust(HEADER_BYTES, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | memoryview, where: str) -> "TensorHeader":
        """The header in `raw`, checked to agree with itself (the bytes are a peer's: the shape sizes the
        consumer's buffer); ConnectorError, naming `where`, for anything else."""
        if len(raw) < HEADER_BYTES:
            raise ConnectorError(f"{where}: {len(raw)} bytes, shorter than a tensor header ({HEADER_BYTES})")
        magic, status, code, nbytes, ndim, readers = _FIXED.unpack_from(raw)
        if magic != _MAGIC or ndim > MAX_DIMS:
            raise ConnectorError(f"{where}: not an omnistage tensor header")
        if status != OK:
            return cls(torch.uint8, (), 0, readers, status)
        shape = struct.unpack_from(f"<{ndim}q", raw, _DIMS_AT)
        try:
            dtype = torch_dtype(code)
        except TensorFormatError as e:
            raise ConnectorError(f"{where}: {e}") from None
        if any(d < 0 for d in shape):
            raise ConnectorError(f"{where}: negative dimension in shape {list(shape)}")
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 1 << 63:   # torch's numel would overflow
            raise ConnectorError(f"{where}: shape {list(shape)} is too large for a tensor")
        if nbytes != math.prod(shape) * dtype.itemsize:
            raise ConnectorError(f"{where}: {nbytes} bytes do not hold a {dtype} tensor of shape {list(shape)}")
        return cls(dtype, tuple(shape), nbytes, readers, status)

    def with_readers(self, readers: int) -> bytes:
        return TensorHeader(self.dtype, self.shape, self.nbytes, readers, self.status).pack()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's bytes (no copy), every dtype included."""
    return t.reshape(-1).view(torch.uint8)


def from_bytes(raw: torch.Tensor, header: TensorHeader) -> torch.Tensor:
    """The tensor a flat uint8 buffer holds, as the header describes it (no copy)."""
    if raw.numel() != header.nbytes:  # a peer's header disagreeing with the size it was asked for
        raise ConnectorError(f"{raw.numel()} bytes received, the header describes {header.nbytes}")
    return raw.view(header.dtype).reshape(header.shape)


OFF_LOOP_BYTES = 1 << 20  # copies at least this big run on a worker thread, not the event loop


async def off_loop(nbytes: int, fn, *args):
    """Run a blocking copy of `nbytes` inline when small, on a worker thread when large."""
    if nbytes < OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
