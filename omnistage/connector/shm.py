"""Shared-memory backend: one file in /dev/shm per tensor, for consumers on the same host.

The producer writes a header and the bytes into a new segment (one copy); a consumer maps the segment
privately and returns a tensor over the mapping (no second copy), then counts itself off in the header
under a file lock; the last reader unlinks the segment. An unlinked segment stays valid while mapped:
its pages go back to the system when the last view of the last reader's tensor dies. The mapping is
copy-on-write, so a consumer writing into its tensor changes nothing another reader sees. Small
segments are copied out with one `preadv` instead (below MAPPED_FROM a copy is cheaper than mapping).
When the last view of a mapped tensor dies, the mapping is handed to one unmapping thread per process:
unmapping a consumed segment frees its tmpfs pages (about 1 us a page here), work the consumer's
thread need not wait for. The producer sees the unlink as consumption (the name is gone) and stops
counting the bytes. Release, cancel and TTL unlink from the producer.

Segment names carry the producer's pid namespace and pid, so a store starting up removes the
segments of producers in its own pid namespace that died without cleaning up (SIGKILL, OOM).
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import logging
import mmap
import os
import queue
import re
import secrets
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, cast

import numpy as np
import psutil
import torch

from omnistage.v1 import tensor_pb2

if TYPE_CHECKING:
    from typing_extensions import Buffer

from omnistage.connector.buffers import empty_bytes
from omnistage.connector.errors import BadReference, ConnectorError, TensorNotFound
from omnistage.connector.keys import TensorKey
from omnistage.connector.store import TensorStore
from omnistage.connector.wire import HEADER_BYTES, OK, TensorHeader, as_bytes, from_bytes, off_loop

SEGMENT_PREFIX = "omnistage-"
# The names this module gives segments (prefix, pid namespace, pid, token, sequence): a reference naming
# anything else (a path, a NUL, a name longer than a file name may be) is refused before it is opened.
_SEGMENT_NAME = re.compile(rf"{SEGMENT_PREFIX}[A-Za-z0-9_-]{{1,200}}")
# A kept segment (store.py `retain_fetched`) counts its readers down from KEPT_READERS + readers, so its
# last reader never reaches 1 and never removes it: the producer does, on release, TTL or for room.
KEPT_READERS = 1 << 30
_IO_MAX = 1 << 30  # bytes per read/write call (Linux caps one call near 2 GiB)
# Segments at least this big are mapped, smaller ones copied out: mapping costs a fixed mmap/munmap and page
# faults, a copy grows with the size; chosen by measurement (bench/transport.py `shm.map_over_copy.<size>`).
MAPPED_FROM = 256 << 10

log = logging.getLogger("omnistage.connector")


class ShmStore(TensorStore):
    backend = "shm"

    def __init__(self, host_id: str, clock: Callable[[], float], shm_dir: str = "/dev/shm"):
        super().__init__(host_id, clock)
        self.dir = Path(shm_dir)
        if not self.dir.is_dir():
            raise ConnectorError(f"shared memory directory {self.dir} does not exist")
        self._prefix = f"{SEGMENT_PREFIX}{_PID_NS}-{os.getpid()}-{secrets.token_hex(4)}-"
        self._seq = itertools.count()
        reap_orphans(self.dir)

    async def put(self, key: TensorKey, tensor: torch.Tensor, readers: int = 1) -> tensor_pb2.TensorRef:
        header = TensorHeader.of(tensor, readers + (KEPT_READERS if self.retain_fetched else 0))
        name = f"{self._prefix}{next(self._seq)}"
        path = self.dir / name
        try:
            await off_loop(header.nbytes, _write_segment, path, header, tensor)
        except OSError as e:
            path.unlink(missing_ok=True)
            raise ConnectorError(f"shared memory: cannot write {header.nbytes} bytes for {key.wire} "
                                 f"in {self.dir} ({e.strerror})") from None
        self.held.add(key, header.nbytes, path, readers)
        return tensor_pb2.TensorRef(backend=self.backend, address=name, key=key.wire, nbytes=header.nbytes,
                                    host_id=self.host_id)

    async def get(self, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        if ref.host_id != self.host_id:
            raise BadReference(f'shared-memory tensor {ref.key} lives on host "{ref.host_id}", this consumer '
                               f'is on "{self.host_id}": shared memory works on the same host only')
        if not _SEGMENT_NAME.fullmatch(ref.address):
            raise BadReference(f'"{ref.address[:80]}" is not an omnistage shared-memory segment name')
        # A mapped read is a few system calls whatever its size: only a copy is worth a worker thread.
        copied = ref.nbytes if ref.nbytes < MAPPED_FROM else 0
        return await off_loop(copied, _read_segment, self.dir / ref.address, ref)

    def _free(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def was_fetched(self, held) -> bool:
        if not self.retain_fetched:
            return not held.handle.exists()
        try:
            fd = os.open(held.handle, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            # Readers count themselves off under LOCK_EX, held for their whole copy. Called on the producer's
            # event loop, so never wait for one: a segment being read right now is not fetched yet.
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            header = TensorHeader.unpack(os.pread(fd, HEADER_BYTES, 0), f"segment {held.handle.name}")
            return header.readers <= KEPT_READERS
        finally:
            os.close(fd)

    def reap_consumed(self) -> int:
        """Stop counting segments whose last reader removed them; returns the bytes that freed."""
        gone = [h.key for h in self.held if not h.handle.exists()]
        freed = 0
        for k in gone:
            held = self.held.pop(k, "consumed")
            assert held is not None   # just listed from self.held, each key once
            freed += held.nbytes
        return freed

    @property
    def held_bytes(self) -> int:
        self.reap_consumed()
        return self.held.nbytes

    def segments(self) -> list[str]:
        """This store's segments present in the shared-memory directory."""
        return sorted(p.name for p in self.dir.glob(f"{self._prefix}*"))


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


_PID_NS = _pid_namespace()


def reap_orphans(shm_dir: Path) -> int:
    """Remove segments left by dead producers of this pid namespace; returns how many. Only regular files
    of this process's user are ours to remove: the directory is world-writable, so an entry of a matching
    name may be anyone's (a directory, a link, another user's file). Such an entry, or one that cannot be
    removed, is skipped with one warning; it never stops a store from starting."""
    reaped = 0
    uid = os.geteuid()
    for path in shm_dir.glob(f"{SEGMENT_PREFIX}{_PID_NS}-*"):
        pid = path.name.removeprefix(f"{SEGMENT_PREFIX}{_PID_NS}-").split("-", 1)[0]
        if not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue
        try:
            st = os.lstat(path)   # the entry itself: a link is not followed
            if not stat.S_ISREG(st.st_mode):
                log.warning("shared memory: %s is not a regular file; not a segment of ours, left alone", path)
                continue
            if st.st_uid != uid:
                log.warning("shared memory: %s is owned by uid %d, not %d; not a segment of ours, left alone",
                            path, st.st_uid, uid)
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue   # removed meanwhile (its last reader, or another store starting)
        except OSError as e:
            log.warning("shared memory: cannot remove the orphaned segment %s (%s); left alone", path,
                        e.strerror or e)
            continue
        reaped += 1
    return reaped


def _write_segment(path: Path, header: TensorHeader, tensor: torch.Tensor) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.pwrite(fd, header.pack(), 0)
        view = memoryview(cast("Buffer", as_bytes(tensor).numpy()))
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:done + _IO_MAX], HEADER_BYTES + done)
    finally:
        os.close(fd)


def _read_segment(path: Path, ref: tensor_pb2.TensorRef) -> torch.Tensor:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise TensorNotFound(f"tensor {ref.key} is gone from shared memory (consumed, released or expired)") from None
    except OSError as e:  # a directory or a file not ours by that name
        raise BadReference(f"segment {ref.address} cannot be opened ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # readers count themselves off one at a time
        if os.fstat(fd).st_nlink == 0:
            raise TensorNotFound(f"tensor {ref.key} was released while being fetched")
        try:
            header = TensorHeader.unpack(os.pread(fd, HEADER_BYTES, 0), f"segment {ref.address}")
        except ConnectorError as e:
            raise BadReference(str(e)) from None
        if header.status != OK:  # a reply status: never written into a segment
            raise BadReference(f"segment {ref.address} does not hold a tensor (status {header.status})")
        if header.nbytes != ref.nbytes:
            raise BadReference(f"segment {ref.address} holds {header.nbytes} bytes, the reference to "
                               f"{ref.key} says {ref.nbytes}")
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES + header.nbytes:  # before allocating: the header's length is only a claim
            raise BadReference(f"segment {ref.address} is {size} bytes, too short for the {header.nbytes} "
                               "its header declares")
        raw = _map_bytes(fd, header.nbytes) if header.nbytes >= MAPPED_FROM else _copy_bytes(fd, header.nbytes, ref)
        if header.readers <= 1:
            path.unlink(missing_ok=True)
        else:
            os.pwrite(fd, header.with_readers(header.readers - 1), 0)
    finally:
        # Unlock before closing: a mapping made from this descriptor keeps its open file, and with it
        # the lock, alive for as long as the tensor lives.
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return from_bytes(raw, header)


def _map_bytes(fd: int, nbytes: int) -> torch.Tensor:
    """The segment's bytes as a tensor over a private (copy-on-write) mapping of it. The mapping lives
    as long as the last view of the tensor (numpy holds the `_Mapping` as the array's base, torch the
    array), and no file descriptor stays open for it. The mapping starts at the header (mmap offsets
    are page multiples); the bytes at 128 are aligned for every dtype."""
    return torch.from_numpy(np.asarray(_Mapping(fd, HEADER_BYTES + nbytes))[HEADER_BYTES:])


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """A private mapping of a whole segment, exposed to numpy. Its end queues the unmap for `_UNMAPPER`
    (ctypes drops the interpreter lock for the call), so the thread that drops the last view does not
    wait while the kernel frees the pages of a consumed segment."""

    def __init__(self, fd: int, size: int):
        _UNMAPPER.start()
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
        if addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise ConnectorError(f"shared memory: cannot map {size} bytes ({os.strerror(err)})")
        self.addr, self.size = addr, size
        self.__array_interface__ = {"data": (addr, False), "shape": (size,), "typestr": "|u1", "version": 3}

    def __del__(self):
        try:
            _UNMAPPER.unmap(self.addr, self.size)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the process's end unmaps it
            pass


class _Unmapper:
    """One daemon thread per process that unmaps what `_Mapping`s queue (started by the first mapping, and
    again in a forked child, which inherits the mappings but not the thread)."""

    def __init__(self):
        self._queue: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._pid = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        """The thread of this process, started if it has none. Called when a mapping is made, never from a
        finalizer: starting a thread allocates, an allocation may run the garbage collector, and a
        collected mapping's finalizer must never wait for this lock (it would wait for itself)."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._queue = queue.SimpleQueue()
                    threading.Thread(target=self._run, args=(self._queue,), name="omnistage-shm-unmap",
                                     daemon=True).start()
                    self._pid = os.getpid()

    def unmap(self, addr: int, size: int) -> None:
        """Queued for the thread; in a process without one (a forked child dropping a mapping it inherited
        before it made one of its own), unmapped here."""
        if self._pid == os.getpid():
            self._queue.put((addr, size))
        else:
            _libc.munmap(addr, size)

    def after_fork(self) -> None:
        """In a forked child: no thread yet, and a lock some parent thread held stays held otherwise."""
        self._lock = threading.Lock()
        self._pid = 0

    @staticmethod
    def _run(pending: queue.SimpleQueue) -> None:
        while True:
            addr, size = pending.get()
            _libc.munmap(addr, size)


_UNMAPPER = _Unmapper()
os.register_at_fork(after_in_child=_UNMAPPER.after_fork)


def _copy_bytes(fd: int, nbytes: int, ref: tensor_pb2.TensorRef) -> torch.Tensor:
    raw = empty_bytes(nbytes)
    view = memoryview(cast("Buffer", raw.numpy()))
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:done + _IO_MAX]], HEADER_BYTES + done)
        if n == 0:
            raise ConnectorError(f"segment {ref.address} ended after {done} of {len(view)} bytes")
        done += n
    return raw
