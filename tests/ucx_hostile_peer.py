"""A hostile peer of the UCX data plane, for its abuse tests and benchmark (tests/integration/
test_ucx_hostile_peer.py, bench/abuse_ucx.py): a raw ucxx client on a worker of its own, in this
process, that connects to a store's listener and sends whatever it is told: forged reply headers
and payloads on guessed tags, raw or crafted requests. It speaks the wire by the constants ucx.py
names, so it follows the wire as it changes.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import torch

from omnistage.connector import ucx
from omnistage.connector.wire import NOT_FOUND, OK, TensorHeader

HELLO_TIMEOUT_S = 30.0  # a generous safety bound: a refused endpoint never says hello
_AUTH_WIRE = hasattr(ucx, "REPLY_BYTES")  # the wire whose requests end with a MAC


def forged_header(status: int, nbytes: int = 0) -> bytes:
    """A reply header a forger would send: NOT_FOUND, or OK describing `nbytes` of uint8."""
    if status == OK:
        return TensorHeader(torch.uint8, (nbytes,), nbytes).pack()
    return TensorHeader(torch.uint8, (), 0, status=NOT_FOUND).pack()


class HostilePeer:
    """One endpoint to a store's listener, on this peer's own UCX worker."""

    def __init__(self) -> None:
        self.worker: ucx._LoopWorker | None = None
        self.ep = None
        self.messages = 0   # tagged messages sent
        self.bytes = 0

    def dial(self, address: str) -> asyncio.Future:
        """Connect; the future is done once the producer's hello arrived (or the endpoint failed)."""
        self.worker = ucx._LoopWorker(ucx._Runtime.acquire({"NET_DEVICES": "lo"}))
        host, _, port = address.rpartition(":")
        self.ep = self.worker.api.UCXEndpoint.create(self.worker.worker, host, int(port), True)
        self._hello = np.zeros(8, dtype=np.uint8)
        hello = self.worker.stream_recv(self.ep, self._hello)
        hello.add_done_callback(lambda f: f.cancelled() or f.exception())  # a refused endpoint's error: expected
        return hello

    def greeted(self, hello: asyncio.Future) -> bool:
        """Whether the producer said hello (it serves this endpoint)."""
        return (hello.done() and not hello.cancelled() and hello.exception() is None
                and self._hello.tobytes() == b"OSHELLO\0")

    async def connect(self, address: str, timeout: float = HELLO_TIMEOUT_S) -> bool:
        """Connect and wait for the producer's hello: True when served, False when the endpoint failed."""
        hello = self.dial(address)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout):
                await asyncio.shield(hello)
        return self.greeted(hello)

    def send(self, payload: bytes, tag: int) -> asyncio.Future:
        """Post one tagged message (not awaited: a flood posts many)."""
        assert self.worker is not None
        self.messages += 1
        self.bytes += len(payload)
        return self.worker.send(self.ep, np.frombuffer(bytearray(payload), dtype=np.uint8), tag)

    async def request(self, tag: int, fragment_bytes: int, nbytes: int, key: str, op: int = 1,
                      secret: bytes | None = None) -> None:
        """A request as a consumer sends it, MACed with `secret` (None: the unauthenticated wire's zeros)."""
        assert self.worker is not None
        raw = bytearray(ucx.REQUEST_BYTES)
        ucx._REQUEST.pack_into(raw, 0, ucx._MAGIC, op, 0, tag, fragment_bytes, nbytes, len(key))
        raw[ucx._REQUEST.size:ucx._REQUEST.size + len(key)] = key.encode()
        if _AUTH_WIRE:
            from omnistage.connector.ucx_auth import MAC_BYTES, Authenticator
            raw[-MAC_BYTES:] = Authenticator(secret).request_mac(bytes(raw[:-MAC_BYTES]))
        await self.raw_request(bytes(raw))

    async def raw_request(self, raw: bytes) -> None:
        assert self.worker is not None
        await self.worker.stream_send(self.ep, np.frombuffer(bytearray(raw), dtype=np.uint8))

    async def receive(self, nbytes: int, tag: int, timeout: float = HELLO_TIMEOUT_S) -> bytes | None:
        """One tagged message of at most `nbytes` (None if none came within the safety bound)."""
        assert self.worker is not None
        buf = np.zeros(nbytes, dtype=np.uint8)
        try:
            async with asyncio.timeout(timeout):
                await self.worker.recv(self.ep, buf, tag)
        except TimeoutError:
            return None
        return buf.tobytes()

    def count_waiting(self, tag: int, mask: int) -> int:
        """Tagged messages that reached this peer's worker under (tag, mask) and nobody received: taken
        out of UCX's queue and counted."""
        assert self.worker is not None
        api, count = self.worker.api, 0
        self.worker.worker.progress()
        while True:
            probe = self.worker.worker.tag_probe(api.UCXXTag(tag), api.UCXXTagMask(mask), remove=True)
            if not probe.matched:
                return count
            count += 1
            scratch = np.zeros(max(probe.length, 1), dtype=np.uint8)
            self.worker.post(self.worker.worker.tag_recv_with_handle(self.worker._Array(scratch), probe), scratch)
            self.worker.worker.progress()

    async def close(self) -> None:
        if self.worker is None:
            return
        if self.ep is not None:
            self.worker.close_endpoint(self.ep)
        self.worker.close()
        self.worker = None
        ucx._Runtime.release()


class HostileProducer:
    """A listener that answers every get with what a broken or hostile producer would: `mode` "short"
    (a valid header, then half the bytes), "forged_mac" (a header whose MAC is made with `secret`) or
    "wrong_nbytes" (a valid header describing twice the bytes asked, then the bytes asked)."""

    def __init__(self, mode: str, secret: bytes | None = None) -> None:
        self.mode, self.secret = mode, secret
        self.worker: ucx._LoopWorker | None = None
        self.listener = None
        self.address = ""
        self.requests = 0
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        self.worker = ucx._LoopWorker(ucx._Runtime.acquire({"NET_DEVICES": "lo"}))
        self.listener = self.worker.api.UCXListener.create(self.worker.worker, 0, self._accept, deliver_endpoint=True)
        self.address = f"127.0.0.1:{self.listener.port}"
        return self.address

    def _accept(self, ep) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(ep))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, ep) -> None:
        from omnistage.connector.ucx_auth import MAC_BYTES, Authenticator
        worker = self.worker
        assert worker is not None
        await worker.stream_send(ep, np.frombuffer(b"OSHELLO\0", dtype=np.uint8))
        request = np.zeros(ucx.REQUEST_BYTES, dtype=np.uint8)
        try:
            while True:
                await worker.stream_recv(ep, request)
                self.requests += 1
                raw = request.tobytes()
                _, _, _, tag, _, nbytes, _ = ucx._REQUEST.unpack_from(raw)
                header = forged_header(OK, 2 * nbytes if self.mode == "wrong_nbytes" else nbytes)
                mac = Authenticator(self.secret).reply_mac(raw[-MAC_BYTES:], header) if _AUTH_WIRE else b""
                worker.send(ep, np.frombuffer(bytearray(header + mac), dtype=np.uint8), tag)
                payload = nbytes // 2 if self.mode == "short" else nbytes
                worker.send(ep, np.full(payload, 0xAB, dtype=np.uint8), tag + 1)
        except worker.error:
            pass

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.worker is not None:
            self.listener = None
            self.worker.close()
            self.worker = None
            ucx._Runtime.release()
