"""The HTTP API's door below requests (orchestrator_service/http_api/connections.py) and its body bounds
(body_limits.py, routes.py): what the subclass of uvicorn's protocol relies on, which connection a full door
gives up, the escapes a media part may carry as common encoders write it, the whole-body minimum rate, and the
Host names an operator allows."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from collections import OrderedDict

from uvicorn.protocols.http import flow_control, httptools_impl

from omnistage.api import load_pipeline
from orchestrator_service.http_api import allowed_hosts_from, body_limits, routes
from orchestrator_service.http_api.connections import ConnectionLimits, Door

from ..conftest import EXAMPLES

OMNI = load_pipeline(EXAMPLES / "qwen3-omni-tiny.yaml")


def test_uvicorn_has_what_the_door_protocol_relies_on():
    # DoorProtocol reads and sets these private parts of uvicorn's httptools protocol: an upgrade that
    # renames one fails here by name, not as a door that quietly stops bounding.
    protocol = open(httptools_impl.__file__).read()
    for name in ("more_body", "body", "waiting_for_100_continue", "response_started", "response_complete",
                 "disconnected", "message_event", "keep_alive", "pipeline", "flow", "cycle", "loop", "client",
                 "transport"):
        assert f"self.{name} =" in protocol or f"self.{name}:" in protocol, name
    # Over HTTPS the door hands uvicorn the secured transport itself (connections.py): uvicorn must read its
    # scheme from the transport, not from its own ssl settings (which the door leaves unset).
    assert 'self.scheme = "https" if is_ssl(transport)' in protocol
    assert "self.read_paused =" in open(flow_control.__file__).read(), "FlowControl.read_paused"
    for method in ("on_message_begin", "on_url", "on_header", "on_headers_complete", "on_message_complete",
                   "on_response_complete", "data_received", "connection_made", "connection_lost"):
        assert callable(getattr(httptools_impl.HttpToolsProtocol, method, None)), method
    assert httptools_impl.STATUS_LINE[431].startswith(b"HTTP/1.1 431")


class Transport:
    def __init__(self, buffered: int):
        self.buffered, self.closed = buffered, False

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def close(self) -> None:
        self.closed = True

    abort = close


@dataclasses.dataclass(eq=False)
class Conn:
    transport: Transport
    address: str = "10.0.0.1"
    counted: bool = False
    lingering: bool = False


def test_a_full_door_gives_up_a_connection_with_no_answer_in_its_buffer_first():
    door = Door(ConnectionLimits(max_connections=10, max_per_address=2))
    downloading, idle = Conn(Transport(buffered=1 << 20)), Conn(Transport(buffered=0))
    for conn in (downloading, idle):  # the one still taking its answer is the older
        assert door.admit(conn) is None
        door.waits(conn)
    assert door.admit(Conn(Transport(0))) is None
    assert idle.transport.closed and not downloading.transport.closed
    # With no other choice it is given up last
    door.waiting = {"10.0.0.1": OrderedDict([(downloading, None)])}
    assert door.admit(Conn(Transport(0))) is None
    assert downloading.transport.closed


def test_escaped_base64_as_dotnet_and_php_write_it_is_within_the_bounds():
    limits = dataclasses.replace(OMNI.limits, max_parts=2, max_part_bytes=3 << 20)
    image = base64.b64encode(os.urandom(limits.max_part_bytes)).decode()
    url = f"data:image/png;base64,{image}"
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}
    bounds = body_limits.chat_bounds(limits)
    dotnet = json.dumps(body).replace("+", "\\u002B").encode()  # System.Text.Json
    php = json.dumps(body).replace("/", "\\/").encode()  # json_encode
    for raw in (dotnet, php):
        assert len(raw) <= bounds.size
        body_limits.BodyScan(bounds).add(raw)  # no too_many_escapes


def test_a_large_part_over_a_slow_uplink_has_time():
    part = 16 << 20  # a 16 MiB part at 1 Mbit/s
    needed = base64_len = body_limits.base64_bytes(part)
    assert routes.BODY_BASE_S + base64_len / routes.BODY_MIN_RATE >= needed / (1_000_000 / 8)


def test_allowed_hosts_from_the_environment():
    assert allowed_hosts_from({}) == ()
    assert allowed_hosts_from({"OMNISTAGE_ALLOWED_HOSTS": " proxy.internal, api.example.com ,,"}) == (
        "proxy.internal", "api.example.com")


def test_serve_takes_allowed_hosts():
    from omnistage.local.cli import build_parser

    args = build_parser().parse_args(["serve", "p.yaml", "--allowed-host", "proxy.internal", "--allowed-host", "b"])
    assert args.allowed_host == ["proxy.internal", "b"]
