"""The HTTP API's connections against slow and hostile clients, over real sockets on 127.0.0.1 to an
in-process orchestrator (its real uvicorn) on the tiny Qwen3-Omni stages: half-open sockets that never
finish their headers (slowloris), bodies drip-fed a byte at a time, more connections from one address than
it may hold, more requests in progress than the door serves, a client that never reads a large answer, and
a Host header that names another site (DNS rebinding)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
from typing import AsyncIterator

import pytest

from orchestrator_service.http_api.gate import HostCheck
from orchestrator_service.server import OrchestratorServer

from ..harness import example, stage_servers_fixture
from ..polling import wait_until

# One request running and none waiting: the door's limits are small, so a modest number of sockets fills them.
PIPELINE = example("qwen3-omni-tiny", lambda d: d["spec"]["deployment"]["orchestrator"].update(
    maxInflight=1, maxQueued=0))
HALF_OPEN = 100  # more than uvicorn's old limit for this pipeline (1 + 0 + 64 connections)
HALF_HEADERS = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"  # and then silence
SHORT_S = 0.5  # a timeout made short for a test (the defaults are tens of seconds)
BOUND_S = 60.0  # a safety bound on waiting for what must happen; never a measurement
TEXT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "modalities": ["text"]}
AUDIO = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "seed": 11,
         "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}

stages = stage_servers_fixture(PIPELINE)


@contextlib.asynccontextmanager
async def served(stages: dict, **limits) -> AsyncIterator[OrchestratorServer]:
    """An orchestrator with its HTTP API over the running stages; `limits` replace the door's defaults."""
    orc = OrchestratorServer(PIPELINE, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()}, api_port=0)
    await orc.start(wait_for_stages=30)
    try:
        if limits:
            orc.api.door.limits = dataclasses.replace(orc.api.door.limits, **limits)
        yield orc
    finally:
        await orc.drain()


@dataclasses.dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


async def read_answer(reader: asyncio.StreamReader) -> Answer | None:
    """One HTTP answer from `reader`; None when the server closed the connection without one."""
    async with asyncio.timeout(BOUND_S):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if line)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Answer(int(lines[0].split()[1]), headers, body)


def request(method: str, path: str, port: int, body: dict | None = None, host: str | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    return (f"{method} {path} HTTP/1.1\r\nHost: {host or f'127.0.0.1:{port}'}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


async def ask(port: int, method: str, path: str, body: dict | None = None, host: str | None = None) -> Answer:
    """One request on a new connection, its answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request(method, path, port, body, host))
        await writer.drain()
        answer = await read_answer(reader)
        assert answer is not None, f"{method} {path}: the server closed the connection without an answer"
        return answer
    finally:
        writer.close()


async def chat(orc: OrchestratorServer, body: dict = TEXT) -> Answer:
    return await ask(orc.api_port, "POST", "/v1/chat/completions", {"model": orc.pipeline.name, **body})


async def half_open(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """`n` connections that each start a request's headers and never finish them."""
    conns = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HALF_HEADERS)
        await writer.drain()
        conns.append((reader, writer))
    return conns


async def body_pending(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """`n` chat requests in progress: headers complete, the body announced and never sent."""
    conns = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode())
        await writer.drain()
        conns.append((reader, writer))
    return conns


def close_all(conns) -> None:
    for _, writer in conns:
        writer.close()


def assert_openai_error(answer: Answer, status: int) -> dict:
    assert answer.status == status, (answer.status, answer.body[:200])
    assert answer.headers.get("content-type", "").startswith("application/json"), answer.headers
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    return error


async def test_half_open_sockets_leave_requests_and_health_served(stages):
    async with served(stages) as orc:
        conns = await half_open(orc.api_port, HALF_OPEN)
        try:
            assert (await ask(orc.api_port, "GET", "/health")).status == 200
            answer = await chat(orc)
            assert answer.status == 200, answer.body[:200]
            assert answer.json()["choices"][0]["message"]["content"]
        finally:
            close_all(conns)


async def test_silent_headers_closed_after_header_timeout(stages):
    async with served(stages, header_timeout_s=SHORT_S) as orc:
        reader, writer = await asyncio.open_connection("127.0.0.1", orc.api_port)
        writer.write(HALF_HEADERS)  # at once: before anything else can hold the loop past the timeout
        silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", orc.api_port)
        try:
            error = assert_openai_error(await read_answer(reader), 408)
            assert error["code"] == "request_timeout" and "headers" in error["message"], error
            assert await reader.read() == b""  # and closed
            # A connection that sent nothing at all is closed without an answer.
            assert await read_answer(silent_reader) is None
        finally:
            writer.close()
            silent_writer.close()


async def test_drip_fed_body_refused_below_minimum_rate(stages):
    async with served(stages, receive_window_s=SHORT_S, min_receive_bytes=1024) as orc:
        reader, writer = await asyncio.open_connection("127.0.0.1", orc.api_port)
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{orc.api_port}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n".encode())

        async def drip() -> None:  # a byte at a time: each piece well within the body's idle timeout
            with contextlib.suppress(ConnectionError):
                while not writer.is_closing():
                    writer.write(b" ")
                    await writer.drain()
                    await asyncio.sleep(SHORT_S / 10)

        dripping = asyncio.create_task(drip())
        try:
            error = assert_openai_error(await read_answer(reader), 408)
            assert "bytes" in error["message"], error
        finally:
            dripping.cancel()
            writer.close()


async def test_connections_per_address_capped(stages):
    async with served(stages, max_per_address=4, receive_window_s=BOUND_S) as orc:
        # Four requests in progress from 127.0.0.1: a fifth connection is refused, in the OpenAI shape.
        busy = await body_pending(orc.api_port, 4)
        try:
            await wait_until(lambda: orc.api.door.open_from("127.0.0.1") == 4, BOUND_S, what="4 connections")
            reader, writer = await asyncio.open_connection("127.0.0.1", orc.api_port)
            error = assert_openai_error(await read_answer(reader), 429)
            assert "127.0.0.1" in error["message"] and error["code"] == "too_many_connections", error
            writer.close()
        finally:
            close_all(busy)
        await wait_until(lambda: orc.api.door.open_from("127.0.0.1") == 0, BOUND_S, what="busy ones closed")
        # Four half-open sockets from the same address: a new connection takes the place of the oldest.
        idle = await half_open(orc.api_port, 4)
        try:
            await wait_until(lambda: orc.api.door.open_from("127.0.0.1") == 4, BOUND_S, what="4 connections")
            assert (await chat(orc)).status == 200
            assert await read_answer(idle[0][0]) is None  # the oldest half-open one was closed
            assert orc.api.door.open_from("127.0.0.1") <= 4
        finally:
            close_all(idle)


async def test_connections_in_all_capped(stages):
    async with served(stages, max_connections=4, receive_window_s=BOUND_S) as orc:
        # Full of half-open sockets: a new connection takes the place of the oldest (its address holds most).
        idle = await half_open(orc.api_port, 4)
        try:
            await wait_until(lambda: orc.api.door.total == 4, BOUND_S, what="4 connections")
            assert (await ask(orc.api_port, "GET", "/health")).status == 200
            assert await read_answer(idle[0][0]) is None
        finally:
            close_all(idle)
        await wait_until(lambda: orc.api.door.total == 0, BOUND_S, what="all closed")
        # Full of requests in progress: nothing to give up, the new connection is refused in the OpenAI shape.
        busy = await body_pending(orc.api_port, 4)
        try:
            await wait_until(lambda: orc.api.door.total == 4, BOUND_S, what="4 connections")
            reader, writer = await asyncio.open_connection("127.0.0.1", orc.api_port)
            error = assert_openai_error(answer := await read_answer(reader), 503)
            assert error["code"] == "too_many_connections" and answer.headers.get("retry-after") == "1", answer
            writer.close()
        finally:
            close_all(busy)


async def test_overload_answered_in_openai_shape_health_still_served(stages):
    # The door's own caps set well above the requests in progress, whatever the machine's descriptor limit.
    async with served(stages, receive_window_s=BOUND_S, max_connections=4096, max_per_address=2048) as orc:
        limit = orc.api.request_limit  # requests in progress at once
        busy = await body_pending(orc.api_port, limit)
        try:
            await wait_until(lambda: orc.api.gate.in_progress == limit, BOUND_S, what="the door full")
            error = assert_openai_error(answer := await chat(orc), 429)
            assert answer.headers.get("retry-after") == "1" and error["type"] == "rate_limit_error", answer.headers
            assert (await ask(orc.api_port, "GET", "/health")).status == 200
        finally:
            close_all(busy)
        await wait_until(lambda: orc.api.gate.in_progress == 0, BOUND_S, what="the door empty")
        assert (await chat(orc)).status == 200


def server_side(orc: OrchestratorServer, client: socket.socket):
    """The API's protocol object for the connection whose client end is `client`."""
    for conn in orc.api._server.server_state.connections:
        if conn.transport.get_extra_info("peername") == client.getsockname():
            return conn
    return None


async def small_buffered(orc, client: socket.socket):
    """Connect `client` to the API with 4 KiB kernel buffers on both sides (what the client does not read
    stays in the server process); returns the server's side of the connection."""
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", orc.api_port))
    conn = await wait_until(lambda: server_side(orc, client), BOUND_S, what="the connection accepted")
    conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return conn


async def test_client_that_never_reads_a_large_answer_is_cut_off(stages):
    async with served(stages, send_window_s=SHORT_S) as orc:
        loop = asyncio.get_running_loop()
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # Small kernel buffers on the server's side too: the answer (a few hundred KB of base64 audio) then
            # stays in the process, as a 10 MB answer does at any buffer size.
            conn = await small_buffered(orc, client)
            await loop.sock_sendall(client, request("POST", "/v1/chat/completions", orc.api_port,
                                                    {"model": orc.pipeline.name, **AUDIO}))
            await wait_until(lambda: conn.flow.write_paused, BOUND_S, what="the answer held by the server")
            await wait_until(lambda: server_side(orc, client) is None, BOUND_S, what="the stalled connection cut",
                             detail=lambda: conn.transport.get_write_buffer_size())
            await wait_until(lambda: not orc.servicer.runs, BOUND_S, what="the request cancelled")
        finally:
            client.close()


async def test_an_early_answer_is_read_while_the_body_still_comes(stages):
    # Refused on its Host before its body is read: the client, still sending its body (as an SDK does before
    # it reads), gets the answer, and the connection then serves its next request.
    async with served(stages) as orc:
        port = orc.api_port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            body = b" " * (200 << 10)  # past the headers' cap, were it counted as headers
            writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: rebound.example\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            assert_openai_error(await read_answer(reader), 421)
            writer.write(request("GET", "/health", port))
            answer = await read_answer(reader)
            assert answer is not None and answer.status == 200, answer
        finally:
            writer.close()


async def test_an_early_answer_drains_a_bounded_rest_of_the_body(stages):
    async with served(stages, linger_bytes=256 << 10) as orc:
        reader, writer = await asyncio.open_connection("127.0.0.1", orc.api_port)
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: rebound.example\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")

            async def upload() -> None:  # more than the server drains after its answer
                with contextlib.suppress(ConnectionError):
                    while not writer.is_closing():
                        writer.write(b" " * (64 << 10))
                        await writer.drain()

            uploading = asyncio.create_task(upload())
            assert_openai_error(await read_answer(reader), 421)
            await asyncio.wait_for(uploading, BOUND_S)  # the server closed the connection past its drain
            await wait_until(lambda: orc.api.door.total == 0, BOUND_S, what="the connection closed")
        finally:
            writer.close()


async def test_pipelined_headers_capped_while_a_request_is_in_progress(stages):
    async with served(stages, send_window_s=BOUND_S * 10, header_timeout_s=BOUND_S * 10) as orc:
        loop = asyncio.get_running_loop()
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            conn = await small_buffered(orc, client)
            # A stream the client does not read: its answer stays in progress (its sends wait on the connection,
            # whose buffer in the process is made small too).
            conn.transport.set_write_buffer_limits(high=1024)
            await loop.sock_sendall(client, request("POST", "/v1/chat/completions", orc.api_port,
                                                    {"model": orc.pipeline.name, **AUDIO, "stream": True,
                                                     "audio": {"voice": "ethan", "format": "pcm16"}}))
            await wait_until(lambda: conn.flow.write_paused, BOUND_S, what="the answer held by the server")
            assert conn.cycle.response_started and not conn.cycle.response_complete
            # The next request's headers, without end, while the first answer is in progress.
            await loop.sock_sendall(client, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ")
            with contextlib.suppress(ConnectionError):
                for _ in range(64):  # 1 MiB: far past the cap
                    await loop.sock_sendall(client, b"a" * (16 << 10))
            await wait_until(lambda: server_side(orc, client) is None, BOUND_S, what="the connection cut")
        finally:
            client.close()


async def test_foreign_host_refused_on_loopback(stages):
    async with served(stages) as orc:
        port = orc.api_port
        error = assert_openai_error(await ask(port, "GET", "/v1/models", host="rebound.example:80"), 421)
        assert "rebound.example" in error["message"] and error["code"] == "host_not_allowed", error
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
            assert (await ask(port, "GET", "/v1/models", host=host)).status == 200, host


async def test_allowed_hosts_from_the_environment_are_served(stages, monkeypatch):
    monkeypatch.setenv("OMNISTAGE_ALLOWED_HOSTS", "proxy.example,api.internal")
    async with served(stages) as orc:
        for host in ("proxy.example:8080", "api.internal"):
            assert (await ask(orc.api_port, "GET", "/v1/models", host=host)).status == 200, host
        assert_openai_error(await ask(orc.api_port, "GET", "/v1/models", host="rebound.example"), 421)


@pytest.mark.parametrize("bound, host, allowed", [
    ("127.0.0.1", "127.0.0.1:8000", True),
    ("127.0.0.1", "localhost:8000", True),
    ("127.0.0.1", "LOCALHOST.", True),
    ("127.0.0.1", "app.localhost:8000", True),
    ("127.0.0.1", "[::1]:8000", True),
    ("127.0.0.1", "127.8.9.10", True),
    ("127.0.0.1", None, True),  # HTTP/1.0 without a Host: not a browser
    ("127.0.0.1", "rebound.example:8000", False),
    ("127.0.0.1", "x", True),  # no dot: the machine's own name, a compose service; no domain a page owns
    ("127.0.0.1", "10.0.0.5:8000", True),  # an address was never resolved: no rebinding
    ("127.0.0.1", "localhost.example", False),
    ("127.0.0.1", "127.0.0.1.nip.io", False),
    ("::1", "[::1]", True),
    ("::1", "rebound.example", False),
])
def test_host_check_on_loopback(bound, host, allowed):
    check = HostCheck.for_bind(bound)
    assert check is not None
    assert (check.refusal(host) is None) == allowed


def test_host_check_extra_names_and_off_loopback():
    assert HostCheck.for_bind("127.0.0.1", ["proxy.internal"]).refusal("proxy.internal:443") is None
    assert HostCheck.for_bind("0.0.0.0") is None  # reachable from the network: any Host
    assert HostCheck.for_bind("10.1.2.3") is None
