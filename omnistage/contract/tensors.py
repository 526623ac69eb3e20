"""torch.Tensor <-> omnistage.v1.Tensor (inline bytes). Pure converters, bit-exact for every dtype."""

from __future__ import annotations

import math

import torch

from omnistage.v1 import tensor_pb2

_TO_PROTO = {
    torch.float32: tensor_pb2.FLOAT32, torch.float16: tensor_pb2.FLOAT16, torch.bfloat16: tensor_pb2.BFLOAT16,
    torch.float64: tensor_pb2.FLOAT64, torch.int64: tensor_pb2.INT64, torch.int32: tensor_pb2.INT32,
    torch.int16: tensor_pb2.INT16, torch.int8: tensor_pb2.INT8, torch.uint8: tensor_pb2.UINT8,
    torch.bool: tensor_pb2.BOOL,
}
_FROM_PROTO: dict[int, torch.dtype] = {v: k for k, v in _TO_PROTO.items()}
DTYPE_NAMES = {v: tensor_pb2.DType.Name(v).lower() for v in _TO_PROTO.values()}


class TensorFormatError(ValueError):
    """A Tensor message whose dtype, shape and bytes do not agree."""


def torch_dtype(code: int) -> torch.dtype:
    try:
        return _FROM_PROTO[code]
    except KeyError:
        raise TensorFormatError(f"unsupported tensor dtype code {code}") from None


def proto_dtype(dtype: torch.dtype) -> tensor_pb2.DType:
    try:
        return _TO_PROTO[dtype]
    except KeyError:
        raise TensorFormatError(f"unsupported tensor dtype {dtype}") from None


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The C-contiguous bytes of a CPU tensor (bfloat16 and bool included)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def to_proto(name: str, t: torch.Tensor) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(name=name, dtype=proto_dtype(t.dtype), shape=list(t.shape), data=tensor_bytes(t))


def from_bytes(data: bytes | bytearray | memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    numel = math.prod(shape)
    if len(data) != numel * dtype.itemsize:
        raise TensorFormatError(f"tensor of shape {list(shape)} and dtype {dtype} needs {numel * dtype.itemsize} "
                                f"bytes, got {len(data)}")
    if numel == 0:
        if max(shape, default=0) >= 1 << 62 or math.prod(d for d in shape if d) >= 1 << 62:
            raise TensorFormatError(f"tensor of shape {list(shape)}: its strides overflow 64 bits")
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool and bytes(data).translate(None, b"\0\1"):  # torch keeps them: truthy, yet != True
        raise TensorFormatError("a bool tensor's bytes must each be 0 or 1")
    flat = torch.frombuffer(bytearray(data), dtype=dtype)
    return flat.reshape(shape)


def descriptor_bytes(msg: tensor_pb2.Tensor) -> int:
    """The bytes a Tensor message's dtype and shape need, once they are known to agree with its payload:
    the inline bytes, or the size its reference declares (checked before anything is fetched for it,
    since that size is what the consumer allocates)."""
    payload = msg.WhichOneof("payload")
    if payload is None:
        raise TensorFormatError(f'tensor "{msg.name}" carries neither data nor a reference')
    dtype = torch_dtype(msg.dtype)
    if any(d < 0 for d in msg.shape):
        raise TensorFormatError(f'tensor "{msg.name}" has a negative dimension in shape {list(msg.shape)}')
    nbytes = math.prod(msg.shape) * dtype.itemsize
    held = len(msg.data) if payload == "data" else msg.ref.nbytes
    if held != nbytes:
        raise TensorFormatError(f'tensor "{msg.name}" of shape {list(msg.shape)} and dtype {dtype} needs {nbytes} '
                                f"bytes, its {'data holds' if payload == 'data' else 'reference declares'} {held}")
    return nbytes


def from_proto(msg: tensor_pb2.Tensor) -> torch.Tensor:
    """An inline Tensor message as a torch tensor (a copy: the message's bytes are not shared)."""
    if msg.WhichOneof("payload") != "data":
        raise TensorFormatError(f'tensor "{msg.name}" is not inline; fetch it through a connector')
    if any(d < 0 for d in msg.shape):
        raise TensorFormatError(f'tensor "{msg.name}" has a negative dimension in shape {list(msg.shape)}')
    return from_bytes(msg.data, torch_dtype(msg.dtype), list(msg.shape))
