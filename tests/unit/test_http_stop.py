"""Stop strings watched in streamed text (orchestrator_service/http_api/stop.py): the text before the
first stop string, however the text is split into deltas, and never a piece of a stop string sent."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator_service.http_api.stop import StopWatch


def run(stops, deltas) -> tuple[list[str], bool]:
    watch = StopWatch(stops)
    sent = [watch.feed(d) for d in deltas]
    if not watch.stopped:
        sent.append(watch.flush())
    return sent, watch.stopped


@pytest.mark.parametrize("stops,deltas,sent,stopped", [
    ((), ["ab", "cd"], ["ab", "cd", ""], False),
    (("END",), ["hello E", "N", "D more"], ["hello", " ", ""], True),
    (("END",), ["hello E", "Nx"], ["hello", " E", "Nx"], False),
    (("\n\n", "!"), ["a\n", "b!c"], ["a", "\nb"], True),
    (("x",), ["abc"], ["abc", ""], False),
    (("abc",), ["abc"], [""], True),
    ((".", "a.a"), ["aa.a"], ["aa"], True),      # "." completes before "a.a", though "a.a" starts first
    ((".", "a.a"), ["aa.", "a"], ["aa", ""], True),  # the same, split
])
def test_stop_table(stops, deltas, sent, stopped):
    assert run(stops, deltas) == (sent, stopped)


def test_nothing_after_a_stop():
    watch = StopWatch(["."])
    assert watch.feed("one. two") == "one" and watch.stopped
    assert watch.feed("three") == "" and watch.flush() == ""


def test_held_back_at_most_the_longest_stop_less_one():
    watch = StopWatch(["abcd", "x"])
    assert watch.feed("0123456") == "0123" and watch.flush() == "456"


@given(text=st.text(alphabet="abc.\n", max_size=60), cuts=st.lists(st.integers(0, 60), max_size=8),
       stops=st.lists(st.text(alphabet="abc.\n", min_size=1, max_size=4), min_size=1, max_size=4))
def test_any_split_sends_the_text_before_the_first_stop(text, cuts, stops):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    # the first stop completed, as a generator checking after every character would see it
    found = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    got, stopped = run(stops, deltas)
    assert "".join(got) == (text[:min(found)[1]] if found else text)
    assert stopped is bool(found)
    # Nothing sent ever held the start of a stop string it then completed.
    prefix = ""
    for piece in got:
        prefix += piece
        assert not any(s in prefix for s in stops)
