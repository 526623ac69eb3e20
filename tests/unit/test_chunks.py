"""Per-edge chunk ordering: any arrival order is consumed in order; end of stream is seen once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnistage.contract.chunks import ChunkOrderError, EdgeReorderBuffer


@given(st.integers(1, 40).flatmap(lambda n: st.permutations(list(range(n)))))
def test_any_arrival_order_is_delivered_in_order(order):
    buf = EdgeReorderBuffer("a->b")
    last = max(order)
    delivered = []
    for i in order:
        delivered += buf.push(i, i, end_of_stream=(i == last))
    assert delivered == sorted(order)
    assert buf.finished and buf.pending == 0


def test_duplicates_and_late_chunks_are_refused():
    buf = EdgeReorderBuffer("a->b")
    assert buf.push(0, "x", False) == ["x"]
    with pytest.raises(ChunkOrderError, match="duplicate chunk 0"):
        buf.push(0, "x", False)
    buf.push(2, "z", True)
    with pytest.raises(ChunkOrderError, match="duplicate chunk 2"):
        buf.push(2, "z", True)
    with pytest.raises(ChunkOrderError, match="after end of stream"):
        buf.push(3, "w", False)
    assert buf.push(1, "y", False) == ["y", "z"] and buf.finished


def test_second_end_of_stream_is_refused():
    buf = EdgeReorderBuffer("a->b")
    buf.push(1, "b", True)
    with pytest.raises(ChunkOrderError, match="second end of stream"):
        buf.push(0, "a", True)


def test_end_before_later_chunk_is_refused():
    buf = EdgeReorderBuffer("a->b")
    buf.push(3, "d", False)
    with pytest.raises(ChunkOrderError, match="end of stream at 1 before later chunks"):
        buf.push(1, "b", True)


def test_out_of_order_window_is_bounded():
    buf = EdgeReorderBuffer("a->b", max_pending=3)
    for i in (1, 2, 3):
        buf.push(i, i, False)
    with pytest.raises(ChunkOrderError, match="more than 3 chunks out of order"):
        buf.push(4, 4, False)
