"""Reading one component's tensors out of a published (sharded) safetensors checkpoint.

A checkpoint as model authors publish it is `model.safetensors`, or shards plus
`model.safetensors.index.json` mapping every tensor name to its shard. A stage that serves one part
of a combined model (the Talker of Qwen3-Omni) opens only the shards holding that part's names, reads
only those tensors (positioned reads, no memory map, so nothing else is paged in), and counts every
byte it reads. Tensors are handed out lazily (`LazyTensor`, materialised by `t[...]`, the protocol
transformers' loader uses), so the loader places each one into the model as it is read and the
process never holds a second copy of the weights.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omnistage.checkpoints.configs import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "F8_E8M0": torch.float8_e8m0fnu,
}
# Anything else a safetensors header may name (F4, F6_*, C64, ...) is refused by name, before a byte is read.


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int   # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class ReadStats:
    """What a load actually read: files opened, tensor names read, bytes read (headers included)."""
    files: set[str] = field(default_factory=set)
    keys: set[str] = field(default_factory=set)
    bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, file: Path, key: str | None, n: int) -> None:
        with self.lock:
            self.files.add(file.name)
            if key is not None:
                self.keys.add(key)
            self.bytes += n


class ShardedCheckpoint:
    """The weights of one checkpoint directory, by tensor name; headers are read only for shards used."""

    def __init__(self, root: str | os.PathLike, stem: str = "model"):
        self.root = Path(root)
        self.index_file = self.root / f"{stem}.safetensors.index.json"
        single = self.root / f"{stem}.safetensors"
        self.stats = ReadStats()
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        if self.index_file.exists():
            try:
                index = json.loads(self.index_file.read_text())
                weight_map = index["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{self.index_file}: not a safetensors index ({e})") from None
            self.weight_map = {k: self._shard(k, v) for k, v in weight_map.items()}
        elif single.exists():
            self.weight_map = {k: single for k in self._header(single)}
        else:
            raise CheckpointError(f"{self.root}: no {single.name} or {self.index_file.name} (not a checkpoint)")

    def _shard(self, key: str, name: object) -> Path:
        """The shard an index entry names: a file in the checkpoint's own folder (an absolute path, a folder
        or `..` would read weights from anywhere)."""
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise CheckpointError(f"{self.index_file}: {key} is placed in {name!r}, not a file name in the "
                                  f"checkpoint's folder")
        return self.root / name

    # ------------------------------------------------------------------ names and sizes
    def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self.weight_map if k.startswith(prefix)]

    def files(self, prefix: str = "") -> list[Path]:
        """The shards holding names under `prefix`, in shard order."""
        return sorted({self.weight_map[k] for k in self.keys(prefix)})

    def info(self, key: str) -> TensorInfo:
        file = self.weight_map.get(key)
        if file is None:
            raise CheckpointError(f"{self.root}: no tensor {key}")
        found = self._header(file).get(key)
        if found is None:
            raise CheckpointError(f"{file}: the index places {key} in this shard but the shard has no such tensor")
        return found

    def nbytes(self, prefix: str = "") -> int:
        return sum(self.info(k).nbytes for k in self.keys(prefix))

    def bytes_by_file(self, prefix: str = "") -> tuple[tuple[str, int], ...]:
        """(shard name, bytes of the tensors under `prefix` in it), in shard order; verifies as it goes."""
        out: dict[str, int] = {}
        for key in self.keys(prefix):
            info = self.info(key)
            out[info.file.name] = out.get(info.file.name, 0) + info.nbytes
        return tuple(sorted(out.items()))

    def verify(self, prefix: str = "") -> None:
        """Every shard holding `prefix` exists, is whole and holds what the index says (headers only)."""
        for k in self.keys(prefix):
            self.info(k)

    # ------------------------------------------------------------------ reading
    def state_dict(self, prefix: str, strip: bool = True) -> dict[str, "LazyTensor"]:
        """The tensors under `prefix`, named without it when `strip`; nothing is read until used."""
        return {(k[len(prefix):] if strip else k): LazyTensor(self, k, self.info(k)) for k in self.keys(prefix)}

    def read(self, key: str) -> torch.Tensor:
        return self._read(key, self.info(key), 0, None)

    def rows(self, key: str, ids: list[int]) -> torch.Tensor:
        """Rows `ids` of a 2-D tensor, reading those rows only."""
        info = self.info(key)
        if len(info.shape) != 2:
            raise CheckpointError(f"{info.file}: {key} is not a matrix (shape {list(info.shape)})")
        bad = [i for i in ids if not 0 <= i < info.shape[0]]
        if bad:  # a row past the end would be read out of the next tensor's bytes
            raise CheckpointError(f"{info.file}: {key} has {info.shape[0]} rows, no row {bad[0]}")
        return torch.stack([self._read(key, info, i, 1)[0] for i in ids])

    def _read(self, key: str, info: TensorInfo, first_row: int, n_rows: int | None) -> torch.Tensor:
        dtype = DTYPES.get(info.dtype)
        if dtype is None:
            raise CheckpointError(f"{info.file}: {key} has dtype {info.dtype}, which omnistage cannot read")
        shape = info.shape
        start, length = info.start, info.nbytes
        if n_rows is not None:
            row = length // max(shape[0], 1)
            start, length, shape = start + first_row * row, n_rows * row, (n_rows, *shape[1:])
        buf = bytearray(length)
        with open(info.file, "rb", buffering=0) as f:
            f.seek(start)
            got = f.readinto(buf)
        if got != length:
            raise CheckpointError(f"{info.file}: truncated reading {key} ({got} of {length} bytes)")
        self.stats.add(info.file, key, length)
        if length == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def _header(self, file: Path) -> dict[str, TensorInfo]:
        if file in self._headers:
            return self._headers[file]
        if not file.exists():
            raise CheckpointError(f"{self.index_file}: names shard {file.name}, which is missing")
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise CheckpointError(f"{file}: not a safetensors file (header of {n} bytes)")
            try:
                header = json.loads(f.read(n))
            except ValueError:
                raise CheckpointError(f"{file}: not a safetensors file (unreadable header)") from None
        self.stats.add(file, None, 8 + n)
        base = 8 + n
        out: dict[str, TensorInfo] = {}
        end_max = 0
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            try:
                b, e = (int(x) for x in meta["data_offsets"])
                info = TensorInfo(file, str(meta["dtype"]), tuple(int(d) for d in meta["shape"]), base + b, base + e)
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{file}: {key}: not a safetensors tensor entry ({meta!r:.80})") from None
            _check_size(info, key)
            out[key] = info
            end_max = max(end_max, base + e)
        if end_max > size:
            raise CheckpointError(f"{file}: truncated ({size} bytes, its header needs {end_max})")
        self._headers[file] = out
        return out


def _check_size(info: TensorInfo, key: str) -> None:
    """The header's shape and dtype agree with its byte range (for a dtype omnistage knows)."""
    dtype = DTYPES.get(info.dtype)
    if dtype is None:
        return
    n = dtype.itemsize
    for d in info.shape:
        n *= d
    if n != info.nbytes or info.nbytes < 0:
        raise CheckpointError(f"{info.file}: {key} is {info.dtype} {list(info.shape)} ({n} bytes) but its header "
                              f"gives it {info.nbytes} bytes")


class LazyTensor:
    """A tensor not yet read: `t[...]` reads it (the protocol of safetensors' slices)."""

    def __init__(self, ckpt: ShardedCheckpoint, key: str, info: TensorInfo):
        self.ckpt, self.key, self.info = ckpt, key, info

    def __getitem__(self, index) -> torch.Tensor:
        t = self.ckpt._read(self.key, self.info, 0, None)
        return t if index is Ellipsis else t[index]

    def get_dtype(self) -> str:
        return self.info.dtype

    def get_shape(self) -> list[int]:
        return list(self.info.shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.info.shape)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.info.dtype]
