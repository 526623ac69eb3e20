"""The HTTPS API's handshakes (orchestrator_service/http_api/connections.py), over real sockets on 127.0.0.1 to
a real uvicorn API with a certificate: a client that opens TCP and never sends its ClientHello is closed at the
door's handshake deadline (not asyncio's 60 s); connections still in their handshake count against the door's
caps, and are given up first when an address is full; a normal HTTPS request is served all along."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
from typing import AsyncIterator

from omnistage import tls
from omnistage.api import load_pipeline
from orchestrator_service.http_api import HttpApi

from ..conftest import EXAMPLES
from ..polling import wait_until
from ..unit.test_http_call import ScriptedPath

OMNI = load_pipeline(EXAMPLES / "qwen3-omni-tiny.yaml")
SHORT_S = 0.5  # the handshake deadline made short for a test (the default is 10 s)
# A safety bound on waiting for what must happen; never a measurement. Below asyncio's own 60 s handshake
# timeout, so that a door without a deadline of its own fails here.
BOUND_S = 30.0
PER_ADDRESS = 3  # connections one address may hold, made small for a test


@contextlib.asynccontextmanager
async def https_api(tmp_path, ca=None, **limits) -> AsyncIterator[tuple[HttpApi, ssl.SSLContext]]:
    """A real API over HTTPS on 127.0.0.1 (its door's limits replaced by `limits`) and a client context that
    trusts its certificate."""
    ca = ca or tls.new_ca()
    cert, key = tls.issue(*ca, tls.identity("test", OMNI.name, tls.ORCHESTRATOR_ROLE), ip_addresses=["127.0.0.1"])
    files = tls.write_dir(tmp_path / "api", ca[0], cert, key)
    api = HttpApi(ScriptedPath(), OMNI, "127.0.0.1", 0, tls=files)
    api.door.limits = dataclasses.replace(api.door.limits, **limits)
    await api.start()
    try:
        yield api, ssl.create_default_context(cadata=ca[0].decode())
    finally:
        await api.stop()


async def models_over_https(port: int, context: ssl.SSLContext) -> int:
    """The status of GET /v1/models over HTTPS on a new connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        writer.write(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        async with asyncio.timeout(BOUND_S):
            head = await reader.readuntil(b"\r\n\r\n")
        return int(head.split()[1])
    finally:
        writer.close()


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (EOF or reset) within the safety bound."""
    try:
        async with asyncio.timeout(BOUND_S):
            return await reader.read(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def test_a_client_that_never_sends_its_client_hello_is_closed_at_the_handshake_deadline(tmp_path):
    async with https_api(tmp_path, handshake_timeout_s=SHORT_S) as (api, context):
        reader, writer = await asyncio.open_connection("127.0.0.1", api.port)  # TCP only, then silence
        try:
            await wait_until(lambda: api.door.open_from("127.0.0.1") == 1, BOUND_S,
                             what="the connection in its handshake counted by the door")
            assert await closed_by_server(reader), "the silent connection was not closed"
            await wait_until(lambda: api.door.total == 0, BOUND_S, what="the closed connection counted out")
        finally:
            writer.close()
        assert await models_over_https(api.port, context) == 200


async def test_connections_in_their_handshake_count_against_the_address_cap_and_are_given_up_first(tmp_path):
    async with https_api(tmp_path, max_per_address=PER_ADDRESS) as (api, context):
        silent = [await asyncio.open_connection("127.0.0.1", api.port) for _ in range(PER_ADDRESS)]
        try:
            await wait_until(lambda: api.door.open_from("127.0.0.1") == PER_ADDRESS, BOUND_S,
                             what="every connection in its handshake counted")
            # The address is full of handshakes: a real client's connection gives up the oldest of them.
            assert await models_over_https(api.port, context) == 200
            assert await closed_by_server(silent[0][0]), "the oldest handshake was not given up"
            assert api.door.open_from("127.0.0.1") <= PER_ADDRESS
        finally:
            for _, writer in silent:
                writer.close()


async def test_a_plain_http_request_to_the_https_port_fails_its_handshake_and_is_counted_out(tmp_path):
    async with https_api(tmp_path) as (api, context):
        reader, writer = await asyncio.open_connection("127.0.0.1", api.port)
        try:
            writer.write(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{api.port}\r\n\r\n".encode())
            await writer.drain()
            assert await closed_by_server(reader)
        finally:
            writer.close()
        await wait_until(lambda: api.door.total == 0, BOUND_S, what="the failed handshake counted out")
        assert await models_over_https(api.port, context) == 200


def handshake_then_reset(port: int, context: ssl.SSLContext) -> None:
    """A TLS client that completes its handshake and resets the connection at once (SO_LINGER 0), as health
    checkers and scanners do."""
    import socket
    import struct

    raw = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    secured = context.wrap_socket(raw, server_hostname="127.0.0.1")
    secured.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    secured.close()


async def test_connections_reset_right_after_their_handshake_are_counted_out_where_they_were_counted(tmp_path):
    """The door counts a connection under the address it had at accept: one reset after its handshake has no
    peer address any more, and reading it again would count it out under another (leaving its own count, and
    the per-address cap, wrong for good)."""
    async with https_api(tmp_path, max_per_address=PER_ADDRESS) as (api, context):
        for _ in range(4 * PER_ADDRESS):
            await asyncio.to_thread(handshake_then_reset, api.port, context)
        await wait_until(lambda: api.door.total == 0 and not api.door.open and not api.door.waiting, BOUND_S,
                         what="every reset connection counted out",
                         detail=lambda: (api.door.total, dict(api.door.open), dict(api.door.waiting)))
        # the cap still holds: PER_ADDRESS silent connections fill it, and the next one gives up the oldest
        silent = [await asyncio.open_connection("127.0.0.1", api.port) for _ in range(PER_ADDRESS + 1)]
        try:
            await wait_until(lambda: api.door.open_from("127.0.0.1") == PER_ADDRESS, BOUND_S,
                             what="the address held at its cap")
            assert await closed_by_server(silent[0][0])
        finally:
            for _, writer in silent:
                writer.close()
        assert await models_over_https(api.port, context) == 200


async def served_certificate(port: int, context: ssl.SSLContext) -> bytes:
    """The DER certificate a new HTTPS connection to the API is shown."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        return writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()


async def test_a_rotated_certificate_is_shown_to_new_connections_and_open_ones_keep_theirs(tmp_path):
    ca = tls.new_ca()
    async with https_api(tmp_path, ca=ca) as (api, context):
        before = await served_certificate(api.port, context)
        kept, kept_writer = await asyncio.open_connection("127.0.0.1", api.port, ssl=context)
        try:
            cert, key = tls.issue(*ca, tls.identity("test", OMNI.name, tls.ORCHESTRATOR_ROLE),
                                  ip_addresses=["127.0.0.1"])
            tls.write_dir(tmp_path / "api", ca[0], cert, key)
            api.reload_tls()
            after = await served_certificate(api.port, context)
            assert after != before and after == ssl.PEM_cert_to_DER_cert(cert.decode())
            # the connection opened before the rotation still works on its own session
            kept_writer.write(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{api.port}\r\n\r\n".encode())
            async with asyncio.timeout(BOUND_S):
                head = await kept.readuntil(b"\r\n\r\n")
            assert int(head.split()[1]) == 200
        finally:
            kept_writer.close()
