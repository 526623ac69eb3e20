"""Fuzz the data plane's own wire formats, which a stage reads from its peers: the tensor header (at the
head of every shared-memory segment and every UCX reply), tensor keys, and a shared-memory segment as a
consumer reads it (a real ShmStore over a scratch directory). Whatever the bytes, decoding gives a
consistent header or the connector's own error (ConnectorError), never struct.error, IndexError or
ValueError leaking out, and a declared length never makes the reader allocate more than is there."""

from __future__ import annotations

import asyncio
import struct
import time

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnistage.connector import ConnectorError, TensorKey
from omnistage.connector.shm import SEGMENT_PREFIX, ShmStore
from omnistage.connector.wire import BAD_REQUEST, HEADER_BYTES, MAX_DIMS, NOT_FOUND, OK, TensorHeader, from_bytes
from omnistage.contract.tensors import proto_dtype
from omnistage.v1 import tensor_pb2

from ..connector_peer import DTYPES

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_FIXED = struct.Struct("<4sHHQII")  # the header's fixed part as wire.py lays it out (magic ... readers)
_MAGIC = b"OSTN"
u16, u32, u64 = st.integers(0, 2**16 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
dims = st.integers(-2**63, 2**63 - 1) | st.integers(0, 8)


def raw_header(status: int, code: int, nbytes: int, ndim: int, readers: int, shape: list[int],
               magic: bytes = _MAGIC) -> bytes:
    """A header laid out by hand, so that fields TensorHeader.pack would never write can be sent."""
    shape = (shape + [0] * MAX_DIMS)[:MAX_DIMS]
    return (_FIXED.pack(magic, status, code, nbytes, ndim, readers) + struct.pack(f"<{MAX_DIMS}q", *shape)).ljust(
        HEADER_BYTES, b"\0")


def valid_header(dtype: torch.dtype, shape: list[int], readers: int = 1) -> bytes:
    return TensorHeader.of(torch.zeros(shape, dtype=dtype), readers).pack()


headers = st.one_of(
    st.binary(max_size=2 * HEADER_BYTES),
    st.builds(raw_header, st.sampled_from([OK, NOT_FOUND, BAD_REQUEST]) | u16, st.integers(0, 12) | u16,
              st.integers(0, 4096) | u64, st.integers(0, MAX_DIMS + 1) | u32, st.integers(0, 4) | u32,
              st.lists(dims, max_size=MAX_DIMS)),
    # a valid header with some bytes overwritten
    st.builds(lambda h, edits: bytes(_overwrite(bytearray(h), edits)),
              st.builds(valid_header, st.sampled_from(list(DTYPES.values())), st.lists(st.integers(0, 4), max_size=4)),
              st.lists(st.tuples(st.integers(0, HEADER_BYTES - 1), st.integers(0, 255)), min_size=1, max_size=6)),
)


def _overwrite(buf: bytearray, edits) -> bytearray:
    for at, byte in edits:
        buf[at] = byte
    return buf


def check_decoded(h: TensorHeader) -> None:
    """A header unpack returned agrees with itself: the bytes it declares are the bytes its shape needs."""
    if h.status != OK:
        return
    assert len(h.shape) <= MAX_DIMS and all(d >= 0 for d in h.shape)
    numel = 1
    for d in h.shape:
        numel *= d
    assert h.nbytes == numel * torch.empty((), dtype=h.dtype).element_size()
    proto_dtype(h.dtype)


@FUZZ
@given(headers)
@example(b"").via("a short read: struct.error leaked")
@example(raw_header(OK, 0, 0, 0, 1, [])).via("dtype code 0: TensorFormatError leaked")
@example(raw_header(OK, 1, 4, 1, 1, [-1])).via("a negative dimension was accepted")
@example(raw_header(OK, 1, 8, 1, 1, [1])).via("nbytes disagreeing with the shape was accepted")
@example(raw_header(OK, 1, 0, 3, 1, [1 << 32, 0, 1 << 32])).via("an empty shape whose other sizes overflow numel")
def test_any_bytes_decode_to_a_consistent_header_or_a_connector_error(raw):
    try:
        h = TensorHeader.unpack(raw, "fuzz")
    except ConnectorError as e:
        assert "fuzz" in str(e)  # names where the header came from
        return
    check_decoded(h)
    if h.status == OK and h.nbytes <= 1 << 16:
        t = from_bytes(torch.zeros(h.nbytes, dtype=torch.uint8), h)  # what a consumer then does with it
        assert (t.dtype, tuple(t.shape)) == (h.dtype, h.shape)


@FUZZ
@given(st.text(max_size=60) | st.lists(st.text(max_size=12), max_size=6).map("/".join))
@example("a/b/²/c").via("a digit int() cannot read")
def test_any_text_parses_to_a_key_or_value_error(wire):
    try:
        key = TensorKey.parse(wire)
    except ValueError:
        return
    assert TensorKey.parse(key.wire) == key


# ---- a shared-memory segment, as a consumer reads it ---------------------------------------------------


@pytest.fixture(scope="module")
def shm(tmp_path_factory):
    return ShmStore("host-a", time.monotonic, shm_dir=str(tmp_path_factory.mktemp("shm")))


segment_names = st.one_of(
    st.just("ok"), st.text(max_size=20).map(lambda s: s.replace("/", "")),
    st.sampled_from(["..", ".", "\0", "x" * 300, "a\0b"]))


@FUZZ
@given(content=st.one_of(headers, st.builds(lambda h, body: h + body, headers, st.binary(max_size=64))),
       declared=st.integers(0, 64) | u64, name=segment_names, host=st.sampled_from(["host-a", "host-b", ""]))
@example(content=valid_header(torch.float32, [2]) + b"\0" * 8, declared=8, name="\0", host="host-a")
@example(content=valid_header(torch.float32, [2]) + b"\0" * 8, declared=8, name="x" * 300, host="host-a")
@example(content=raw_header(OK, 9, 1 << 40, 1, 1, [1 << 40]), declared=1 << 40, name="ok", host="host-a")
@example(content=raw_header(NOT_FOUND, 0, 0, 0, 1, []), declared=0, name="ok", host="host-a").via(
    "a reply status in a segment: RuntimeError from reshape")
@example(content=raw_header(OK, 9, 2**63, 1, 1, [2**63 - 1]), declared=2**63, name="ok", host="host-a")
def test_a_segment_reads_as_its_tensor_or_a_connector_error(shm, content, declared, name, host):
    """Whatever a segment holds and whatever the reference declares: the tensor, or ConnectorError, and no
    buffer bigger than the segment's own bytes."""
    seg = f"{SEGMENT_PREFIX}fuzz-{name}"
    path = shm.dir / seg
    written = False
    if "\0" not in seg and len(seg) < 200 and name not in (".", ".."):
        path.write_bytes(content)
        written = True
    ref = tensor_pb2.TensorRef(backend="shm", address=seg, key="r/s/0/t", nbytes=declared, host_id=host)
    try:
        t = asyncio.run(shm.get(ref))
    except ConnectorError:
        return
    finally:
        if written:
            path.unlink(missing_ok=True)
    assert t.numel() * t.element_size() == declared <= len(content) - HEADER_BYTES
