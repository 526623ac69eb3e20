"""The front doors' reading pace and per-client cap, on their own (orchestrator_service/consumer_pace.py,
client_cap.py): pure, so driven with numbers rather than connections."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator_service import client_cap
from orchestrator_service.admission import Overloaded
from orchestrator_service.client_cap import ClientCap, client_of, default_cap, peer_host
from orchestrator_service.consumer_pace import ConsumerPace

KB = 1024


def read_at(pace: ConsumerPace, bps: float, event_bytes: int, events: int) -> int | None:
    """Sends of `event_bytes` each to a reader taking `bps` (every send waits its bytes' reading time): the
    index of the first send that outwaits its allowance, or None when all go through."""
    for i in range(events):
        wait = event_bytes / bps
        if wait > pace.allowed_wait(event_bytes):
            return i
        pace.sent(event_bytes, wait)
    return None


@pytest.mark.parametrize("bps, event_bytes, cut", [
    (1 * KB, 1 * KB, True),      # the trickle that used to pin a request: each send waits 1 s and succeeds
    (4 * KB, 96 * KB, True),     # half the minimum rate, big audio chunks
    (8 * KB, 96 * KB, False),    # at the minimum rate
    (100 * KB, 96 * KB, False),  # a real client
    (9 * KB, 1 * KB, False),
])
def test_a_reader_below_the_minimum_rate_is_cut_and_one_above_it_never(bps, event_bytes, cut):
    pace = ConsumerPace(grace_s=60, min_bps=8 * KB)
    assert (read_at(pace, bps, event_bytes, 5000) is not None) == cut


def test_a_reader_that_stopped_is_cut_after_the_grace():
    pace = ConsumerPace(grace_s=60, min_bps=8 * KB)
    assert pace.allowed_wait(0) == 60
    assert pace.allowed_wait(8 * KB) == 61  # the bytes of the send itself earn their reading time


def test_fast_reading_banks_at_most_the_grace():
    pace = ConsumerPace(grace_s=10, min_bps=1000)
    pace.sent(10**9, 0.0)  # a gigabyte taken at once
    assert pace.allowed_wait(0) == 10


def test_time_the_server_spends_making_the_answer_is_not_the_clients():
    pace = ConsumerPace(grace_s=1, min_bps=1000)
    for _ in range(100):  # sends that never wait, however far apart
        pace.sent(10, 0.0)
    assert pace.allowed_wait(0) == 1


def test_the_verdict_says_how_slowly():
    pace = ConsumerPace(grace_s=2, min_bps=8192)
    pace.sent(100, 1.5)
    why = pace.too_slow(0, 0.6)
    assert why.startswith("the client read 100 bytes while the answer waited 2.1 s on it")
    assert "under the minimum of 8192 bytes/s after a grace of 2 s" in why


@given(st.lists(st.tuples(st.integers(0, 10**6), st.floats(0, 100)), max_size=50))
def test_the_allowance_stays_between_zero_and_grace_plus_the_sends_bytes(sends):
    pace = ConsumerPace(grace_s=5, min_bps=1000)
    for n, wait in sends:
        wait = min(wait, pace.allowed_wait(n))  # a send completes only within its allowance
        pace.sent(n, wait)
        assert 0 <= pace.allowed_wait(0) <= 5


# ------------------------------------------------------------------------ the per-client cap

@pytest.mark.parametrize("inflight, queued, cap", [(64, 256, 160), (4, 4, 16), (1, 0, 16), (100, 0, 50)])
def test_the_default_cap_is_a_share_with_a_floor(inflight, queued, cap):
    assert default_cap(inflight, queued) == cap


@pytest.mark.parametrize("peer, host", [("ipv4:10.1.2.3:5555", "10.1.2.3"), ("ipv6:[::1]:80", "::1"),
                                        ("ipv6:[2001:db8::7]:1", "2001:db8::7"), ("unix:/tmp/s", None), ("", None),
                                        ("ipv6:%5B::1%5D:5", "::1")])  # as gRPC Python reports IPv6 peers
def test_peer_host(peer, host):
    assert peer_host(peer) == host


def test_who_a_client_is(monkeypatch):
    assert client_of(2, "10.0.0.1") == "API key #2"
    assert client_of(None, "10.0.0.1") == "address 10.0.0.1"
    assert client_of(None, "127.0.0.1") is None and client_of(None, "::1") is None  # a local proxy or the operator
    assert client_of(0, "127.0.0.1") == "API key #0"  # keys are capped wherever they come from
    assert client_of(None, None) is None
    assert client_of(None, "::ffff:127.0.0.1") is None  # IPv4 loopback through a dual-stack socket
    assert client_of(None, "::ffff:10.0.0.1") == "address 10.0.0.1"
    monkeypatch.setattr(client_cap, "CAP_LOOPBACK", True)
    assert client_of(None, "127.0.0.1") == "address 127.0.0.1"


def test_a_trusted_proxys_address_is_not_capped_its_keys_are():
    """Behind an ingress every client shares its address: capping the address would cap them all together."""
    trusted = client_cap.trusted_proxies({"OMNISTAGE_TRUSTED_PROXIES": "10.42.0.0/16, 192.168.1.7"})
    assert client_of(None, "10.42.3.9", trusted) is None and client_of(None, "192.168.1.7", trusted) is None
    assert client_of(None, "10.43.0.1", trusted) == "address 10.43.0.1"
    assert client_of(1, "10.42.3.9", trusted) == "API key #1"
    with pytest.raises(ValueError, match="OMNISTAGE_TRUSTED_PROXIES: 'ingress' is not an address or network"):
        client_cap.trusted_proxies({"OMNISTAGE_TRUSTED_PROXIES": "ingress"})


def test_an_images_request_of_the_most_images_fits_one_clients_cap():
    from orchestrator_service.http_api.schemas import MAX_IMAGES

    assert default_cap(1, 1) >= MAX_IMAGES  # n images are n requests of the one client


def test_a_client_over_its_cap_is_refused_naming_it_and_others_are_not():
    cap = ClientCap(2)
    with cap.holding("address a"), cap.holding("address a"):
        with pytest.raises(Overloaded, match="address a already has 2 requests in flight, the most one client"):
            with cap.holding("address a"):
                pass
        with cap.holding("address b"), cap.holding(None):
            assert cap.held == {"address a": 2, "address b": 1}
    assert cap.held == {}
