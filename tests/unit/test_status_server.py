"""The HTTP status port every service serves: /livez answers the liveness check it is given, /drain only
callers from inside the pod or bearing its service-account token, and the gRPC connection settings."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from omnistage.contract import launch
from omnistage.serving import HttpStatusServer, drain_permitted, grpc_server_options

TOKEN = "pod-token"


@pytest.fixture
def status_server():
    servers = []

    def start(**kw) -> HttpStatusServer:
        srv = HttpStatusServer("127.0.0.1", 0, CollectorRegistry(), lambda: True, **kw).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


def get(srv: HttpStatusServer, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(launch.http_url("127.0.0.1", srv.port, path), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize("stalled, expected", [
    (None, (200, b"ok\n")),
    ("stage llm: an engine step has been running for 301s (stallSeconds 300)",
     (503, b"not live: stage llm: an engine step has been running for 301s (stallSeconds 300)\n")),
])
def test_livez_answers_what_the_liveness_check_says(status_server, stalled, expected):
    assert get(status_server(live=lambda: stalled), launch.LIVE_PATH) == expected


def test_livez_without_a_check_is_live(status_server):
    assert get(status_server(), launch.LIVE_PATH) == (200, b"ok\n")


def test_the_prestop_hook_drains_from_inside_the_pod(status_server):
    drained = threading.Event()
    srv = status_server(drain=drained.set)
    launch.drain_self({launch.ENV_POD_IP: "127.0.0.1"}, srv.port)  # what the exec hook runs
    assert drained.is_set()
    assert get(srv, launch.DRAIN_PATH) == (200, b"drained\n")


@pytest.mark.parametrize("peer, local, authorization, token, permitted", [
    ("127.0.0.1", "127.0.0.1", None, None, True),          # loopback
    ("127.8.9.10", "10.0.0.5", None, None, True),          # all of 127.0.0.0/8
    ("::1", "::1", None, None, True),
    ("::ffff:127.0.0.1", "::ffff:10.0.0.5", None, None, True),   # IPv4 loopback on a dual-stack socket
    ("10.0.0.5", "10.0.0.5", None, None, True),            # the pod calling its own IP (the preStop hook)
    ("10.0.0.9", "10.0.0.5", None, TOKEN, False),          # the node (an httpGet hook), no token
    ("10.0.0.9", "10.0.0.5", f"Bearer {TOKEN}", TOKEN, True),
    ("10.0.0.9", "10.0.0.5", f"bearer {TOKEN}", TOKEN + "\n", True),   # scheme in any case; file's newline
    ("10.0.0.9", "10.0.0.5", "Bearer not-the-token", TOKEN, False),
    ("10.0.0.9", "10.0.0.5", f"Basic {TOKEN}", TOKEN, False),
    ("10.0.0.9", "10.0.0.5", TOKEN, TOKEN, False),         # no scheme
    ("10.0.0.9", "10.0.0.5", f"Bearer {TOKEN}", None, False),          # no token file: inside the pod only
    ("10.0.0.9", "10.0.0.5", "Bearer ", "", False),        # an empty token matches nothing
    ("fd00::9", "fd00::5", None, None, False),
    ("not-an-address", "10.0.0.5", None, None, False),
])
def test_drain_is_permitted_inside_the_pod_or_with_its_token(tmp_path, peer, local, authorization, token,
                                                             permitted):
    token_file = tmp_path / "token"
    if token is not None:
        token_file.write_text(token)
    assert drain_permitted(peer, local, authorization, token_file) is permitted


def test_a_rotated_token_counts_at_once(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("first")
    assert drain_permitted("10.0.0.9", "10.0.0.5", "Bearer first", token_file)
    token_file.write_text("second")
    assert not drain_permitted("10.0.0.9", "10.0.0.5", "Bearer first", token_file)
    assert drain_permitted("10.0.0.9", "10.0.0.5", "Bearer second", token_file)


@pytest.mark.parametrize("request_timeout_s, grace_ms", [(600.0, 660_000), (2.5, 62_500), (0.0, None)])
def test_connection_age_grace_outlasts_the_longest_request(request_timeout_s, grace_ms):
    options = dict(grpc_server_options(1 << 20, 2 << 20, request_timeout_s))
    assert options["grpc.max_receive_message_length"] == 1 << 20
    assert options["grpc.max_send_message_length"] == 2 << 20
    assert options["grpc.keepalive_permit_without_calls"] == 1 and options["grpc.keepalive_time_ms"] > 0
    # Clients ping at the keepalive interval: the server must not count those pings as abuse.
    assert options["grpc.http2.min_ping_interval_without_data_ms"] < options["grpc.keepalive_time_ms"]
    assert options.get("grpc.max_connection_age_grace_ms") == grace_ms
