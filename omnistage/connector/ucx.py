"""UCX backend (ucxx): the producer serves the tensors it holds from a listener; a consumer keeps
one endpoint per producer (cached, bounded) and fetches by key straight into a preallocated tensor.

Per get: the consumer posts, all at once, a fixed-size request (key, size, reply tag, fragment
size), the receive of the reply header and the receives of the bytes straight into the new tensor;
the producer answers with the header on the reply tag and the bytes on the following tags, one
message per fragment, all sent together from the held tensor itself. One round trip, no copies.
A tensor counts as consumed once its last reader's send completed.

Device memory: where the process's UCX context carries CUDA memory (decided once, when the context
starts: `_Runtime.device_memory`), the producer holds a CUDA tensor on its device and sends from it,
and a consumer on CUDA receives straight into a new CUDA tensor; UCX picks cuda_ipc between GPUs of
one host and cuda_copy otherwise. ucxx sends and receives any object with `__cuda_array_interface__`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from omnistage.v1 import tensor_pb2

from .buffers import empty_bytes
from .errors import ConnectorError, PeerUnreachable, TensorNotFound
from .keys import TensorKey
from .paths import CPU
from .store import TensorStore
from .wire import BAD_REQUEST, HEADER_BYTES, NOT_FOUND, OK, TensorHeader, as_bytes, from_bytes

REQUEST_BYTES = 1024
_REQUEST = struct.Struct("<4sHHQQQI")  # magic, op, pad, reply tag, fragment bytes, tensor bytes, key length
_MAGIC = b"OSRQ"
_GET, _BYE = 1, 2
MAX_KEY_BYTES = REQUEST_BYTES - _REQUEST.size
MIN_FRAGMENT_BYTES = 64 << 10
MAX_FRAGMENTS = 1 << 16  # a request asking for more is malformed: answered with a refusal header only
_EMPTY = np.empty(0, dtype=np.uint8)


# UCX settings the connector starts UCX with (UCX_* environment variables win). Endpoints made by
# a listener need peer error handling, and with it UCX's newer protocol layer sends large tcp
# messages as multi-fragment eager copies; the v1 protocols keep rendezvous zero-copy (measured:
# ucx_perftest -e over tcp/lo 0.5-1.2 GB/s with v2, 1.9-4 GB/s with v1).
UCX_DEFAULTS = {"PROTO_ENABLE": "n"}

log = logging.getLogger("omnistage.connector")


def _ucxx():
    """ucxx, imported on first use (an optional dependency), with UCX's unused-variable warnings off."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx
    return ucxx


def cuda_transports(context_info: str) -> set[str]:
    """The CUDA transports a UCX context opened, from its `ucp_context_print_info` text (components
    `cuda_cpy` and `cuda_ipc`; a UCX built with CUDA but without a driver, or with UCX_TLS excluding
    them, opens neither)."""
    names = {"cuda_cpy": "cuda_copy", "cuda_ipc": "cuda_ipc"}
    found = set()
    for line in context_info.splitlines():
        if "component" in line and ":" in line:
            name = line.rsplit(":", 1)[1].strip()
            if name in names:
                found.add(names[name])
    return found


def _device_memory_support() -> tuple[bool, str]:
    """Whether this process's UCX context carries CUDA memory, and why (for the log line)."""
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    ucxx = _ucxx()
    context = getattr(ucxx.core._get_ctx(), "context", None)  # the UCXContext; cuda_support is build-time
    if context is not None and not getattr(context, "cuda_support", True):
        return False, "this UCX build has no CUDA support"
    found = cuda_transports(ucxx.get_ucp_context_info())
    if "cuda_copy" not in found:
        return False, "the UCX context opened no cuda_copy transport (UCX_TLS, driver)"
    return True, ", ".join(sorted(found))


class _Runtime:
    """The process's one UCX context, shared by every UCX store in it and reset when the last closes.

    Progress runs on ucxx's progress thread and completions reach asyncio through its notifier
    thread: the other modes busy-wait (a pending receive costs a core) or were slower (measured).
    Whether the context carries device memory is decided once, when it starts.
    """

    users = 0
    owned = False  # this module started the context (not other ucxx code in the process)
    device_memory = False

    @classmethod
    def acquire(cls, options: dict[str, str]) -> None:
        ucxx = _ucxx()
        if cls.users == 0:
            try:
                ucxx.init({**UCX_DEFAULTS, **options}, env_takes_precedence=True, progress_mode="thread",
                          enable_python_future=True)
                cls.owned = True
            except RuntimeError:  # already started elsewhere in this process: use it as it is
                cls.owned = False
            cls.device_memory, why = _device_memory_support()
            if torch.cuda.is_available():
                log.log(logging.INFO if cls.device_memory else logging.WARNING,
                        "UCX %s device memory (%s)%s", "carries" if cls.device_memory else "does not carry", why,
                        "" if cls.device_memory else ": CUDA tensors are staged through host memory")
        cls.users += 1

    @classmethod
    def release(cls) -> None:
        cls.users -= 1
        if cls.users == 0 and cls.owned:
            ucxx = _ucxx()
            ucxx.stop_notifier_thread()  # a live notifier thread keeps the process from exiting
            try:
                ucxx.reset()
            except ucxx.exceptions.UCXError as e:
                log.warning("UCX context not reset: %s", str(e).splitlines()[0])


@dataclass
class _Peer:
    """A consumer's endpoint to one producer."""
    ep: object
    next_tag: int = 1
    inflight: int = 0

    def tags(self, n: int) -> int:
        tag, self.next_tag = self.next_tag, self.next_tag + n
        return tag


def _fragments(nbytes: int, fragment_bytes: int) -> list[tuple[int, int]]:
    step = fragment_bytes if fragment_bytes > 0 else max(nbytes, 1)
    return [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)]


class UcxStore(TensorStore):
    backend = "ucx"

    def __init__(self, host_id: str, clock: Callable[[], float], *, host: str = "127.0.0.1",
                 port: int = 0, max_endpoints: int = 64, fragment_bytes: int = 0, get_timeout_s: float = 60.0,
                 options: dict[str, str] | None = None, device: str = CPU, device_memory: bool = True):
        super().__init__(host_id, clock)
        if max_endpoints < 1:
            raise ValueError(f"max_endpoints must be >= 1, got {max_endpoints}")
        if fragment_bytes and fragment_bytes < MIN_FRAGMENT_BYTES:
            raise ValueError(f"fragment_bytes must be 0 (one message) or >= {MIN_FRAGMENT_BYTES}, got {fragment_bytes}")
        self.host, self.port = host, port
        self.max_endpoints = max_endpoints
        self.fragment_bytes = fragment_bytes
        self.get_timeout_s = get_timeout_s
        self.address = ""
        self._listener = None
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # consumer side, least recently used first
        self._connecting: dict[str, asyncio.Future] = {}
        self._served: set = set()  # producer side: endpoints of connected consumers
        self._all_served = asyncio.Event()
        self._all_served.set()
        self.options = options or {}
        self.device = device  # where a get puts the tensors it receives (CPU or CUDA)
        self._allow_device_memory = device_memory
        self.device_memory = False  # set at start: CUDA tensors sent and received as device memory

    async def start(self) -> None:
        _Runtime.acquire(self.options)
        try:
            self._listener = _ucxx().create_listener(self._serve_peer, self.port)
        except BaseException:
            _Runtime.release()
            raise
        self.address = f"{self.host}:{self._listener.port}"
        self.device_memory = self._allow_device_memory and _Runtime.device_memory

    @property
    def endpoints(self) -> int:
        """Open UCX endpoints: to producers (consumer side) plus from consumers (producer side)."""
        return len(self._peers) + len(self._served)

    # ---- producer side -------------------------------------------------------------------------

    async def put(self, key: TensorKey, tensor: torch.Tensor, readers: int = 1) -> tensor_pb2.TensorRef:
        if self._listener is None:
            raise ConnectorError("UCX store not started: call start() first")
        wire = key.wire.encode()
        if len(wire) > MAX_KEY_BYTES:
            raise ConnectorError(f"tensor key {key.wire[:60]}... is {len(wire)} bytes; UCX requests carry at most "
                                 f"{MAX_KEY_BYTES} (shorten the request id)")
        header = TensorHeader.of(tensor)
        if tensor.is_cuda:  # UCX's copy engines do not wait on torch's stream: the bytes must be written first
            torch.cuda.current_stream(tensor.device).synchronize()
        self.held.add(key, header.nbytes, tensor, readers)
        return tensor_pb2.TensorRef(backend=self.backend, address=self.address, key=key.wire, nbytes=header.nbytes,
                                    host_id=self.host_id)

    def _free(self, tensor: torch.Tensor) -> None:
        pass  # dropping the reference frees it (an in-flight send keeps its own)

    async def _serve_peer(self, ep) -> None:
        """One consumer's connection: answer its requests until it says bye or goes away."""
        ucxx = _ucxx()
        self._served.add(ep)
        self._all_served.clear()
        tasks: set[asyncio.Task] = set()
        request = np.empty(REQUEST_BYTES, dtype=np.uint8)
        try:
            while True:
                await ep.recv(request)
                magic, op, _, tag, fragment_bytes, nbytes, keylen = _REQUEST.unpack_from(request)
                if magic != _MAGIC or op != _GET:
                    break
                key = bytes(request[_REQUEST.size:_REQUEST.size + keylen]).decode(errors="replace")
                task = asyncio.create_task(self._send_tensor(ep, tag, fragment_bytes, nbytes, key))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except ucxx.exceptions.UCXError:
            pass  # the consumer closed or died; its unconsumed tensors wait for release or the TTL
        finally:
            for task in tasks:
                task.cancel()
            self._served.discard(ep)
            with contextlib.suppress(Exception):
                await ep.close()
            if not self._served:
                self._all_served.set()

    async def _send_tensor(self, ep, tag: int, fragment_bytes: int, nbytes: int, wire_key: str) -> None:
        """Reply to one get: the header on `tag`, then the bytes on the following tags (all posted at
        once). A refusal still sends one empty message per expected fragment, so that the consumer,
        which posted every receive up front, is left with none pending."""
        ucxx = _ucxx()
        try:
            held = self.held.get(TensorKey.parse(wire_key))
            status = NOT_FOUND if held is None else OK if held.nbytes == nbytes else BAD_REQUEST
        except ValueError:
            held, status = None, BAD_REQUEST
        if fragment_bytes and nbytes // fragment_bytes >= MAX_FRAGMENTS:
            status, nbytes = BAD_REQUEST, 0
        frags = _fragments(nbytes, fragment_bytes)
        if status == OK:
            header, data = TensorHeader.of(held.handle), _sendable(as_bytes(held.handle))
            payload = [data[o:o + n] for o, n in frags]
        else:
            header, payload = TensorHeader(torch.uint8, (), 0, status=status), [_EMPTY] * len(frags)
        try:
            await asyncio.gather(ep.send(_header_buffer(header), tag=tag),
                                 *(ep.send(p, tag=tag + 1 + i) for i, p in enumerate(payload)))
        except ucxx.exceptions.UCXError:
            return  # the consumer went away mid-send; the tensor stays held
        if status == OK:
            held.readers -= 1
            if held.readers <= 0:
                self.consumed(held)

    # ---- consumer side -------------------------------------------------------------------------

    async def get(self, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        ucxx = _ucxx()
        peer = await self._peer(ref.address)
        peer.inflight += 1
        try:
            async with asyncio.timeout(self.get_timeout_s):
                return await self._fetch(peer, ref)
        except TimeoutError:
            await self._drop(ref.address)  # closing the endpoint cancels its posted receives
            raise PeerUnreachable(f"UCX get of {ref.key} from {ref.address} took over {self.get_timeout_s} s") from None
        except ucxx.exceptions.UCXError as e:
            await self._drop(ref.address)
            raise PeerUnreachable(f"UCX get of {ref.key} from {ref.address} failed: {type(e).__name__}: {e}") from None
        finally:
            peer.inflight -= 1

    async def _fetch(self, peer: _Peer, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        """Post the request, the header receive and every fragment receive at once: one round trip."""
        frags = _fragments(ref.nbytes, self.fragment_bytes)
        tag = peer.tags(1 + len(frags))
        key = ref.key.encode()
        request = np.zeros(REQUEST_BYTES, dtype=np.uint8)
        _REQUEST.pack_into(request, 0, _MAGIC, _GET, 0, tag, self.fragment_bytes, ref.nbytes, len(key))
        request[_REQUEST.size:_REQUEST.size + len(key)] = np.frombuffer(key, dtype=np.uint8)
        reply = np.empty(HEADER_BYTES, dtype=np.uint8)
        raw = self._receive_buffer(ref.nbytes)
        buf = _sendable(raw)
        done = await asyncio.gather(peer.ep.send(request), peer.ep.recv(reply, tag=tag),
                                    *(peer.ep.recv(buf[o:o + n], tag=tag + 1 + i) for i, (o, n) in enumerate(frags)),
                                    return_exceptions=True)
        for outcome in done[:2]:
            if isinstance(outcome, BaseException):
                raise outcome
        header = TensorHeader.unpack(reply.tobytes(), f"UCX reply from {ref.address}")
        if header.status == NOT_FOUND:
            raise TensorNotFound(f"producer at {ref.address} no longer holds {ref.key} (consumed, released or expired)")
        if header.status != OK:
            raise ConnectorError(f'producer at {ref.address} refused "{ref.key}": the key is malformed or it holds '
                                 f"another size than the reference's {ref.nbytes} bytes")
        for outcome in done[2:]:
            if isinstance(outcome, BaseException):
                raise outcome
        return from_bytes(raw, header)

    def _receive_buffer(self, nbytes: int) -> torch.Tensor:
        """Where a get lands: a new tensor on this consumer's CUDA device when its UCX carries device
        memory (whatever memory the producer sends from), else host memory."""
        if self.device != CPU and self.device_memory:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            # The caching allocator may hand back a block that kernels queued on torch's stream still read;
            # UCX writes on streams of its own, so those kernels must be done first.
            torch.cuda.current_stream(buf.device).synchronize()
            return buf
        return empty_bytes(nbytes)

    async def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None:
            self._peers.move_to_end(address)
            return peer
        pending = self._connecting.get(address)
        if pending is None:
            pending = self._connecting[address] = asyncio.ensure_future(self._connect(address))
            pending.add_done_callback(lambda _: self._connecting.pop(address, None))
        return await asyncio.shield(pending)

    async def _connect(self, address: str) -> _Peer:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConnectorError(f'UCX address "{address}" is not "host:port"')
        try:
            ep = await _ucxx().create_endpoint(host, int(port))
        except Exception as e:  # noqa: BLE001 - any failure to connect means the same to the caller
            raise PeerUnreachable(f"cannot connect to the UCX listener at {address}: {type(e).__name__}: {e}") from None
        peer = self._peers[address] = _Peer(ep)
        await self._evict_idle()
        return peer

    async def _evict_idle(self) -> None:
        """Close least recently used idle endpoints while over the bound."""
        for address in [a for a, p in self._peers.items() if p.inflight == 0]:
            if len(self._peers) <= self.max_endpoints:
                return
            await self._drop(address, bye=True)

    async def _drop(self, address: str, bye: bool = False) -> None:
        peer = self._peers.pop(address, None)
        if peer is None:
            return
        if bye:
            with contextlib.suppress(Exception):
                request = np.zeros(REQUEST_BYTES, dtype=np.uint8)
                _REQUEST.pack_into(request, 0, _MAGIC, _BYE, 0, 0, 0, 0, 0)
                await asyncio.wait_for(peer.ep.send(request), 1.0)
        with contextlib.suppress(Exception):
            await peer.ep.close()

    async def close(self) -> None:
        if self._listener is None:
            return
        await super().close()
        for address in list(self._peers):
            await self._drop(address, bye=True)
        for ep in list(self._served):
            with contextlib.suppress(Exception):
                await ep.close()
        try:  # each consumer's handler ends once its endpoint is closed
            await asyncio.wait_for(self._all_served.wait(), 5.0)
        except TimeoutError:
            log.warning("UCX store %s: %d consumer handlers still running at close", self.address, len(self._served))
        self._listener.close()
        self._listener = None
        _Runtime.release()


def _sendable(raw: torch.Tensor):
    """A flat uint8 buffer as ucxx takes it: numpy for host memory, the CUDA tensor itself (it has
    `__cuda_array_interface__`) for device memory. Slices of either are views."""
    return raw if raw.is_cuda else raw.numpy()


def _header_buffer(header: TensorHeader) -> np.ndarray:
    return np.frombuffer(bytearray(header.pack()), dtype=np.uint8)
