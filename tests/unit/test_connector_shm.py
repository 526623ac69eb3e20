"""Shared-memory reads over a mapping (no second copy): the bytes for every dtype, copy-on-write between
readers, the last reader unlinking, the mapping living exactly as long as the last view of its tensor,
and what a release does to readers that mapped already and to those that did not."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest
import torch

from omnistage.connector import TensorKey, TensorNotFound
from omnistage.connector.shm import MAPPED_FROM

from ..connector_peer import DTYPES, make_tensor


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def mappings_of(segment: str) -> int:
    """How many mappings of `segment` this process has (an unlinked one stays listed, marked deleted)."""
    return sum(segment in line for line in Path("/proc/self/maps").read_text().splitlines())


def unmapped_to(segment: str, count: int, timeout: float = 5.0) -> bool:
    """Whether this process's mappings of `segment` fall to `count` within `timeout` (the unmap of a
    dead tensor's mapping runs on the store's unmapping thread, so it lands a moment after the del)."""
    deadline = time.monotonic() + timeout
    while mappings_of(segment) != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def mapped_size(dtype: torch.dtype) -> list[int]:
    """A shape whose bytes are at least MAPPED_FROM, so the read maps instead of copying."""
    return [3, MAPPED_FROM // dtype.itemsize // 3 + 7]


@pytest.mark.parametrize("dtype", list(DTYPES))
async def test_a_mapped_read_holds_the_producers_bytes_for_every_dtype(shm_pair, dtype):
    producer, consumer = shm_pair
    t = make_tensor(dtype, mapped_size(DTYPES[dtype]), seed=5)
    msg = await producer.put(TensorKey("r1", "thinker", 0, "x"), t, transport="shm")
    got = await consumer.get(msg)
    assert mappings_of(msg.ref.address) == 1  # a tensor over the segment, not a copy of it
    assert same_bits(got, t) and got.data_ptr() % 64 == 0
    assert producer.held_bytes == 0 and producer.stores["shm"].segments() == []  # the last reader unlinked


async def test_small_segments_are_copied_not_mapped(shm_pair):
    producer, consumer = shm_pair
    t = make_tensor("float32", [MAPPED_FROM // 4 - 1], seed=6)
    msg = await producer.put(TensorKey("r1", "thinker", 0, "x"), t, transport="shm")
    got = await consumer.get(msg)
    assert same_bits(got, t) and mappings_of(msg.ref.address) == 0


async def test_writing_into_one_readers_tensor_changes_no_other_readers(shm_pair):
    producer, consumer = shm_pair
    t = make_tensor("float32", mapped_size(torch.float32), seed=7)
    msg = await producer.put(TensorKey("r1", "thinker", 0, "x"), t, transport="shm", readers=3)
    first = await consumer.get(msg)
    first.fill_(1.5)  # before the next reader maps the segment
    second = await consumer.get(msg)
    assert same_bits(second, t)
    third = await consumer.get(msg)
    second.fill_(-2.5)  # after the third one mapped it
    assert same_bits(third, t) and bool((first == 1.5).all()) and bool((second == -2.5).all())
    assert producer.held_bytes == 0 and producer.stores["shm"].segments() == []


async def test_the_last_reader_unlinks_and_the_mapping_lives_as_long_as_its_last_view(shm_pair):
    producer, consumer = shm_pair
    t = make_tensor("bfloat16", mapped_size(torch.bfloat16), seed=8)
    msg = await producer.put(TensorKey("r1", "thinker", 0, "x"), t, transport="shm", readers=2)
    segment = msg.ref.address
    open_files = len(os.listdir("/proc/self/fd"))
    first = await consumer.get(msg)
    assert len(os.listdir("/proc/self/fd")) == open_files  # a mapping keeps no file descriptor open
    assert producer.stores["shm"].segments() == [segment] and producer.held_bytes == t.nbytes
    second = await consumer.get(msg)
    assert producer.stores["shm"].segments() == [] and producer.held_bytes == 0  # consumed, as before
    assert mappings_of(segment) == 2  # unlinked, still valid while mapped
    assert same_bits(first, t) and same_bits(second, t)
    row = second[1:2]  # a view keeps the mapping
    del second
    assert mappings_of(segment) == 2 and same_bits(row, t[1:2])
    del row
    assert unmapped_to(segment, 1) and same_bits(first, t)
    del first
    assert unmapped_to(segment, 0)


async def test_a_release_leaves_mapped_readers_reading_and_refuses_later_ones(shm_pair):
    producer, consumer = shm_pair
    t = make_tensor("int64", mapped_size(torch.int64), seed=9)
    key = TensorKey("r1", "thinker", 0, "x")
    msg = await producer.put(key, t, transport="shm", readers=2)
    got = await consumer.get(msg)
    assert producer.release(key) == t.nbytes and producer.stores["shm"].segments() == []
    assert same_bits(got, t)  # mapped before the release: reads right
    with pytest.raises(TensorNotFound, match="r1/thinker/0/x"):
        await consumer.get(msg)  # not opened before the release
    got.add_(1)  # its own copy-on-write pages
    assert torch.equal(got, t + 1)


async def test_a_mapped_tensor_outlives_its_producer_and_consumer(shm_pair):
    producer, consumer = shm_pair
    t = make_tensor("float16", mapped_size(torch.float16), seed=10)
    msg = await producer.put(TensorKey("r1", "thinker", 0, "x"), t, transport="shm", readers=2)
    got = await consumer.get(msg)
    await producer.close()  # unlinks what it still holds
    await consumer.close()
    assert same_bits(got, t) and mappings_of(msg.ref.address) == 1


async def test_a_live_mapped_tensor_holds_no_lock_on_its_segment(shm_pair):
    producer, consumer = shm_pair
    t = make_tensor("float32", mapped_size(torch.float32), seed=11)
    msg = await producer.put(TensorKey("r1", "thinker", 0, "x"), t, transport="shm", readers=2)
    first = await consumer.get(msg)  # its mapping keeps the reader's open file alive
    fd = os.open(producer.stores["shm"].dir / msg.ref.address, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the reader still held it
    finally:
        os.close(fd)
    assert same_bits(await consumer.get(msg), t) and same_bits(first, t)


def test_dropping_a_mapping_never_waits_for_the_unmappers_lock(tmp_path):
    """A mapping's finalizer may run inside a garbage collection that starting the unmapping thread set off,
    while that start holds the lock: the finalizer's path must not take it (it would wait for itself)."""
    import threading

    from omnistage.connector import shm

    seg = tmp_path / "seg"
    seg.write_bytes(b"\0" * 8192)
    fd = os.open(seg, os.O_RDWR)
    try:
        unmapper = shm._Unmapper()
        for started in (False, True):   # a process without its thread yet, and one with it
            if started:
                unmapper.start()
            addr = shm._libc.mmap(None, 8192, 3, 2, fd, 0)   # PROT_READ | PROT_WRITE, MAP_PRIVATE
            assert addr != shm._MAP_FAILED
            with unmapper._lock:   # held, as by a start the collection interrupted
                done = threading.Event()
                threading.Thread(target=lambda: (unmapper.unmap(addr, 8192), done.set()), daemon=True).start()
                assert done.wait(10), f"unmap waited for the lock (thread started: {started})"
    finally:
        os.close(fd)
