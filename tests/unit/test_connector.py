"""Connector building blocks: keys, the tensor header, the `auto` rule, and the inline and
shared-memory paths (in one process), bit for bit for every dtype; bad input names what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omnistage.connector import ConnectorError, TensorKey, TensorNotFound, choose_transport, make_connector
from omnistage.connector.wire import MAX_DIMS, TensorHeader
from omnistage.contract.tensors import TensorFormatError
from omnistage.v1 import tensor_pb2

from ..connector_peer import DTYPES, make_tensor

SHM = Path("/dev/shm")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@given(st.text(min_size=1), st.text(min_size=1), st.integers(0, 2**31), st.text(min_size=1))
def test_key_survives_the_wire_whatever_its_text(request_id, stage, chunk_id, name):
    key = TensorKey(request_id, stage, chunk_id, name)
    assert TensorKey.parse(key.wire) == key


@pytest.mark.parametrize("args, part", [(("", "s", 0, "x"), "request_id"), (("r", "s", -1, "x"), "chunk_id"),
                                        (("r", "s", 0, ""), "name"), (("r", "s", True, "x"), "chunk_id")])
def test_bad_key_names_the_part(args, part):
    with pytest.raises(ValueError, match=part):
        TensorKey(*args)


def test_unparsable_wire_key_is_refused():
    with pytest.raises(ValueError, match="request_id>/<stage>/<chunk_id>/<name>"):
        TensorKey.parse("a/b/notanumber/c")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (2, 1, 3) * (MAX_DIMS // 3)])
def test_header_round_trip(dtype, shape):
    t = torch.zeros(shape, dtype=DTYPES[dtype])
    h = TensorHeader.unpack(TensorHeader.of(t, readers=3).pack(), "test")
    assert (h.dtype, h.shape, h.nbytes, h.readers) == (t.dtype, tuple(shape), t.numel() * t.element_size(), 3)


def test_header_refuses_too_many_dims_and_foreign_bytes():
    with pytest.raises(ConnectorError, match=f"at most {MAX_DIMS}"):
        TensorHeader.of(torch.zeros([1] * (MAX_DIMS + 1)))
    with pytest.raises(ConnectorError, match="not an omnistage tensor header"):
        TensorHeader.unpack(b"\0" * 128, "segment x")


KIB = 1024
AUTO_RULES = [  # requested, nbytes, available, same_host -> chosen
    ("auto", 10, {"shm", "ucx"}, True, "inline"),
    ("auto", 64 * KIB, {"shm", "ucx"}, True, "shm"),
    ("auto", 64 * KIB, {"shm", "ucx"}, False, "ucx"),
    ("auto", 64 * KIB, {"shm", "ucx"}, None, "ucx"),
    ("auto", 64 * KIB, {"shm"}, None, "shm"),
    ("auto", 64 * KIB, {"ucx"}, True, "ucx"),
    ("auto", 64 * KIB, set(), None, "inline"),
    ("inline", 1 << 30, {"shm", "ucx"}, True, "inline"),
    ("ucx", 1, {"shm", "ucx"}, True, "ucx"),
    ("shm", 1, {"shm"}, None, "shm"),
]


@pytest.mark.parametrize("requested, nbytes, available, same_host, chosen", AUTO_RULES)
def test_auto_rule(requested, nbytes, available, same_host, chosen):
    assert choose_transport(requested, nbytes, available=available, inline_threshold=64 * KIB,
                            same_host=same_host) == chosen


@pytest.mark.parametrize("requested, available, same_host, message", [
    ("rdma", {"shm"}, None, 'transport "rdma" is not one of'),
    ("ucx", {"shm"}, None, 'transport "ucx" is not enabled'),
    ("auto", {"shm"}, False, "another host and UCX is not enabled"),
])
def test_impossible_transport_is_refused(requested, available, same_host, message):
    with pytest.raises(ConnectorError, match=message):
        choose_transport(requested, 1 << 20, available=available, inline_threshold=64 * KIB, same_host=same_host)


@pytest.mark.parametrize("transport", ["inline", "shm"])
@pytest.mark.parametrize("dtype", list(DTYPES))
async def test_every_dtype_moves_bit_for_bit(shm_pair, transport, dtype):
    producer, consumer = shm_pair
    for i, shape in enumerate([(), (1,), (3, 5, 7), (0, 4), (64, 1031)]):
        t = make_tensor(dtype, list(shape), seed=i)
        msg = await producer.put(TensorKey("r1", "thinker", i, "hidden"), t, transport=transport)
        assert msg.WhichOneof("payload") == ("data" if transport == "inline" else "ref")
        assert same_bits(await consumer.get(msg), t)
    assert producer.held_bytes == 0 and producer.stores["shm"].segments() == []


@pytest.mark.parametrize("nbytes", [1, 4096, 65537, 1 << 20, 16 << 20])
async def test_shm_sizes_and_auto_placement(shm_pair, nbytes):
    producer, consumer = shm_pair
    t = make_tensor("uint8", [nbytes], seed=nbytes)
    msg = await producer.put(TensorKey("r1", "thinker", 0, "x"), t, consumer_host="host-a")
    assert msg.WhichOneof("payload") == ("data" if nbytes < 64 * KIB else "ref")
    if nbytes >= 64 * KIB:
        assert msg.ref.backend == "shm" and msg.ref.nbytes == nbytes and producer.held_bytes == nbytes
    assert same_bits(await consumer.get(msg), t)
    assert producer.held_bytes == 0


async def test_views_are_sent_as_their_own_bytes(shm_pair):
    producer, consumer = shm_pair
    big = make_tensor("float32", [512, 256], seed=1)
    for i, view in enumerate([big.T, big[::2], big[100:164]]):
        msg = await producer.put(TensorKey("r1", "thinker", i, "v"), view, transport="shm")
        assert producer.held_bytes == view.numel() * 4  # a slice does not pin its whole base tensor
        assert same_bits(await consumer.get(msg), view.contiguous())


async def test_several_readers_then_gone(shm_pair):
    producer, consumer = shm_pair
    t = make_tensor("bfloat16", [300, 300], seed=2)
    msg = await producer.put(TensorKey("r1", "thinker", 0, "x"), t, transport="shm", readers=2)
    assert same_bits(await consumer.get(msg), t) and producer.held_bytes == t.numel() * 2
    assert same_bits(await consumer.get(msg), t) and producer.held_bytes == 0
    with pytest.raises(TensorNotFound, match="r1/thinker/0/x"):
        await consumer.get(msg)


async def test_release_by_chunk_request_and_age(shm_pair):
    producer, _ = shm_pair
    t = make_tensor("int64", [1 << 14], seed=3)  # 128 KiB
    for rid in ("a", "b"):
        for c in range(3):
            await producer.put(TensorKey(rid, "thinker", c, "x"), t, transport="shm")
    assert producer.held_tensors == 6
    assert producer.release_chunk("a", 1) == t.nbytes and producer.held_tensors == 5
    assert producer.release_request("a") == 2 * t.nbytes and producer.held_tensors == 3
    assert producer.expire(3600) == 0
    assert producer.expire(0) == 3 * t.nbytes and producer.held_bytes == 0
    assert producer.stores["shm"].segments() == []


async def test_bad_input_names_what_is_wrong(shm_pair):
    producer, consumer = shm_pair
    key = TensorKey("r1", "thinker", 0, "x")
    with pytest.raises(TensorFormatError, match="unsupported tensor dtype torch.complex64"):
        await producer.put(key, torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(ConnectorError, match='belongs to stage "thinker"'):
        await producer.put(TensorKey("r1", "talker", 0, "x"), torch.zeros(4))
    with pytest.raises(ConnectorError, match="readers must be >= 1"):
        await producer.put(key, torch.zeros(4), readers=0)
    with pytest.raises(ConnectorError, match="expected a torch.Tensor, got list"):
        await producer.put(key, [1, 2])
    with pytest.raises(ConnectorError, match='"ucx" is not enabled'):
        await producer.put(key, torch.zeros(4), transport="ucx")
    with pytest.raises(ConnectorError, match='held in "ucx", which this connector does not enable'):
        await consumer.get(tensor_pb2.Tensor(name="x", ref=tensor_pb2.TensorRef(backend="ucx", key=key.wire)))
    msg = await producer.put(key, torch.zeros(1 << 16), transport="shm")
    moved = tensor_pb2.Tensor()
    moved.CopyFrom(msg)
    moved.ref.host_id = "host-b"
    with pytest.raises(ConnectorError, match='lives on host "host-b".*same host only'):
        await consumer.get(moved)
    moved.ref.host_id, moved.ref.address = "host-a", "../etc/passwd"
    with pytest.raises(ConnectorError, match="not an omnistage shared-memory segment name"):
        await consumer.get(moved)
    lying = tensor_pb2.Tensor()
    lying.CopyFrom(msg)
    lying.dtype = tensor_pb2.INT32
    with pytest.raises(TensorFormatError, match="the descriptor says int32"):
        await consumer.get(lying)
    with pytest.raises(ConnectorError, match="unknown transport"):
        await make_connector("x", ("tcp",))


def test_large_receive_buffers_are_recycled_when_their_last_view_dies(monkeypatch):
    from omnistage.connector import buffers
    pool = buffers._Pool(buffers.POOL_MAX_BYTES)  # a pool of its own: earlier receives left theirs warm
    monkeypatch.setattr(buffers, "_POOL", pool)
    size, rounded = 5 << 20, 6 << 20  # sizes round up to whole 2 MiB pages
    idle_before = pool.idle_bytes
    t = buffers.empty_bytes(size)
    assert t.numel() == size and t.dtype == torch.uint8
    address = t.data_ptr()
    view = t[8:].view(torch.int16)  # a view keeps the buffer leased
    del t
    assert pool.idle_bytes == idle_before
    view.fill_(7)
    del view
    assert pool.idle_bytes == idle_before + rounded
    again = buffers.empty_bytes(size + 1000)  # the same rounded size: the same mapping, already faulted in
    assert again.data_ptr() == address and pool.idle_bytes == idle_before
    assert buffers.empty_bytes(1000).numel() == 1000  # small buffers are plain torch allocations


def test_receive_buffer_pool_is_bounded_and_keeps_the_most_recent():
    from omnistage.connector.buffers import _Pool
    pool = _Pool(max_bytes=8 << 20)
    small = [pool.take(2 << 20) for _ in range(3)]
    for r in small:
        pool.give_back(r)
    assert pool.idle_bytes == 6 << 20
    pool.give_back(pool.take(6 << 20))  # the oldest small ones make room for it
    assert pool.idle_bytes == 8 << 20
    assert pool.take(6 << 20) is not None and pool.idle_bytes == 2 << 20
    pool.give_back(pool.take(16 << 20))  # bigger than the whole pool: not kept
    assert pool.idle_bytes == 2 << 20
