"""The headline benchmark's round-robin dispatcher in front of the monolith replicas and the order requests
take (logic only, no model)."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from e2e_vs_monolith import VECTOR_FLAGS, RoundRobin, cpu_cores, cpu_flags, request_order
from omni_load import prompts


@pytest.mark.parametrize(("replicas", "picks", "expected"), [
    (1, 3, [0, 0, 0]),
    (2, 5, [0, 1, 0, 1, 0]),
    (3, 7, [0, 1, 2, 0, 1, 2, 0]),
])
def test_each_replica_in_turn(replicas, picks, expected):
    rr = RoundRobin(replicas)
    assert [rr.pick() for _ in range(picks)] == expected


def test_no_replica_is_refused():
    with pytest.raises(ValueError):
        RoundRobin(0)


def test_concurrent_callers_share_the_replicas_evenly():
    """32 clients picking at once (as the bench's c32 does) never skip or double a turn."""
    rr = RoundRobin(2)
    picked: list[int] = []
    lock = threading.Lock()

    def client():
        for _ in range(100):
            i = rr.pick()
            with lock:
                picked.append(i)

    threads = [threading.Thread(target=client) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(picked) == {0: 1600, 1: 1600}


def test_request_order_is_the_same_prompts_reordered_the_same_way():
    order = request_order(48, 0)
    assert sorted(order) == sorted(prompts(48, 0))
    assert order == request_order(48, 0)


def test_request_order_does_not_hand_every_long_prompt_to_one_of_two_replicas():
    """`prompts` alternates short and long: taken in that order, round-robin over two replicas would
    split them by length exactly (the reason for `request_order`)."""
    rr = RoundRobin(2)
    replica_of = [rr.pick() for _ in range(48)]
    long_per_replica = Counter(r for r, (_, max_tokens) in zip(replica_of, request_order(48, 0)) if max_tokens > 8)
    assert sorted(long_per_replica.values())[0] >= 8  # of 24 long prompts, not 0 and 24


def test_cpu_flags_read_the_first_processor():
    cpuinfo = ("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse avx avx2 fma avx512f avx512_vnni\n\n"
               "processor\t: 1\nflags\t\t: fpu sse\n")
    flags = cpu_flags(cpuinfo)
    assert set(flags) == set(VECTOR_FLAGS)
    assert {f for f, on in flags.items() if on} == {"avx2", "fma", "avx512f", "avx512_vnni"}
    assert not any(cpu_flags("").values())   # no /proc/cpuinfo: nothing claimed


def test_cpu_cores_per_process_over_the_wall_time():
    before = {"thinker": 10.0, "talker": 4.0}
    after = {"thinker": 12.0, "talker": 7.0, "talker[+1]": 1.0}   # a replica started in between counts from 0
    assert cpu_cores(before, after, 2.0) == {"thinker": 1.0, "talker": 1.5, "talker[+1]": 0.5}
