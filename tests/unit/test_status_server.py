"""The HTTP status port every service serves: /livez answers the liveness check it is given, also past a
slowloris; /drain (a POST) only callers bearing the process's drain token; and the gRPC connection settings."""

from __future__ import annotations

import os
import socket
import stat
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from omnistage.contract import launch
from omnistage.serving import STATUS_MAX_CONNECTIONS, HttpStatusServer, drain_permitted, grpc_server_options

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


def post(srv: HttpStatusServer, path: str, headers: dict[str, str] | None = None,
         host: str = "127.0.0.1") -> tuple[int, bytes]:
    request = urllib.request.Request(launch.http_url(host, srv.port, path), data=b"", method="POST",
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_prestop_hook_drains_with_the_token_the_process_wrote(status_server, tmp_path):
    drained = threading.Event()
    srv = status_server(drain=drained.set, temp_dir=tmp_path)
    token_file = launch.drain_token_path(srv.port, tmp_path)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    launch.drain_self({launch.ENV_POD_IP: "127.0.0.1"}, srv.port, tmp_path)  # what the exec hook runs
    assert drained.is_set()
    srv.stop()
    assert not token_file.exists()   # the token goes with the process


@pytest.mark.parametrize("authorization", [None, "Bearer not-the-token", "Basic {token}", "{token}", "Bearer "])
def test_drain_refuses_a_loopback_caller_without_the_token(status_server, tmp_path, authorization):
    """Loopback is no proof of being inside the pod: a sidecar proxy (Istio, Linkerd) delivers every allowed
    client from there, and on a shared host any user reaches any process's loopback port."""
    drained = threading.Event()
    srv = status_server(drain=drained.set, temp_dir=tmp_path)
    token = launch.drain_token_path(srv.port, tmp_path).read_text().strip()
    headers = {"Authorization": authorization.format(token=token)} if authorization else {}
    status, body = post(srv, launch.DRAIN_PATH, headers)
    assert (status, body) == (403, b"forbidden: /drain takes the process's drain token (see the preStop hook)\n")
    assert not drained.is_set()


def test_drain_is_a_post_a_get_changes_nothing(status_server, tmp_path):
    drained = threading.Event()
    srv = status_server(drain=drained.set, temp_dir=tmp_path)
    assert get(srv, launch.DRAIN_PATH) == (405, b"method not allowed: POST /drain\n")
    assert not drained.is_set()


def test_a_token_folder_another_user_could_read_is_not_used(status_server, tmp_path):
    """A folder of the token's name that is not private (planted, or loosened) is not trusted: no token is
    written, and /drain refuses everyone (SIGTERM still drains)."""
    folder = launch.drain_token_path(1, tmp_path).parent
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    drained = threading.Event()
    srv = status_server(drain=drained.set, temp_dir=tmp_path)
    assert not launch.drain_token_path(srv.port, tmp_path).exists()
    assert post(srv, launch.DRAIN_PATH, {"Authorization": "Bearer "})[0] == 403
    assert not drained.is_set()


@pytest.mark.parametrize("authorization, permitted", [
    (f"Bearer {TOKEN}", True),
    (f"bearer {TOKEN}", True),            # the scheme in any case
    (f"Bearer  {TOKEN} ", True),
    ("Bearer not-the-token", False),
    (f"Basic {TOKEN}", False),
    (TOKEN, False),                       # no scheme
    (None, False),
    ("Bearer ", False),
])
def test_drain_is_permitted_only_with_the_token(authorization, permitted):
    assert drain_permitted(authorization, TOKEN) is permitted


def test_without_a_token_nothing_is_permitted():
    assert not drain_permitted("Bearer ", None) and not drain_permitted("Bearer x", None)


def silent_connections(port: int, n: int) -> list[socket.socket]:
    """Connections that send nothing (a slowloris): each holds what the server gives a connection."""
    conns = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /livez HTTP/1.1\r\n")   # a request line, and never the end of the headers
        conns.append(s)
    return conns


def test_livez_answers_past_100_silent_connections_and_threads_stay_bounded(status_server):
    srv = status_server()
    before = threading.active_count()
    conns = silent_connections(srv.port, 100 + STATUS_MAX_CONNECTIONS)
    try:
        assert get(srv, launch.LIVE_PATH) == (200, b"ok\n")
        assert get(srv, launch.READY_PATH) == (200, b"ready\n")
        # a thread per connection, up to the cap: the silent ones past it were shed, oldest first
        assert threading.active_count() - before <= STATUS_MAX_CONNECTIONS
    finally:
        for s in conns:
            s.close()


def test_stop_returns_with_silent_connections_open():
    srv = HttpStatusServer("127.0.0.1", 0, CollectorRegistry(), lambda: True).start()
    conns = silent_connections(srv.port, 100)
    try:
        assert get(srv, launch.LIVE_PATH) == (200, b"ok\n")
        stopper = threading.Thread(target=srv.stop, daemon=True)
        stopper.start()
        stopper.join(60)   # a safety bound: stop() does not wait on connections that send nothing
        assert not stopper.is_alive()
    finally:
        for s in conns:
            s.close()


@pytest.mark.parametrize("request_timeout_s, grace_ms", [(600.0, 660_000), (2.5, 62_500), (0.0, None)])
def test_connection_age_grace_outlasts_the_longest_request(request_timeout_s, grace_ms):
    options = dict(grpc_server_options(1 << 20, 2 << 20, request_timeout_s))
    assert options["grpc.max_receive_message_length"] == 1 << 20
    assert options["grpc.max_send_message_length"] == 2 << 20
    assert options["grpc.keepalive_permit_without_calls"] == 1 and options["grpc.keepalive_time_ms"] > 0
    # Clients ping at the keepalive interval: the server must not count those pings as abuse.
    assert options["grpc.http2.min_ping_interval_without_data_ms"] < options["grpc.keepalive_time_ms"]
    assert options.get("grpc.max_connection_age_grace_ms") == grace_ms
