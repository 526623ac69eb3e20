"""UCX backend (ucxx): the producer serves the tensors it holds from a listener; a consumer keeps
one endpoint per producer (cached, bounded) and fetches by key straight into a preallocated tensor.

Per get: the consumer posts the receive of the reply header and a fixed-size request (key, size,
reply tag, fragment size, MAC); the producer answers with the header (and its MAC) on the reply tag
and, when it holds the tensor, the bytes on the following tags, one message per fragment, all sent
together from the held tensor itself. The consumer receives the bytes, straight into the new tensor,
once the header checked out, each fragment once it arrived and its length checked (large fragments
wait as rendezvous: no copies).
A refusal is the header alone. A tensor counts as consumed once its last reader's send completed.
Requests travel on the endpoint's stream (so the producer knows which consumer asked); replies on
tags the consumer chose.

Hostile peers (docs/security.md): UCP tag matching is worker-wide, so the consumer's endpoints live on
a worker of their own, with no listener, and reply tags are random 64-bit values told only to the
producer asked; a request and a reply header carry an HMAC with the pipeline's key (ucx_auth.py), so a
forged header is discarded and counted (`UcxStore.forged_replies`), never delivered. The producer
accepts connections only on its advertised address (ucxx's Python listener binds the wildcard, so the
local address of each new endpoint is checked), at most `max_consumers` endpoints, at most
MAX_REPLIES_PER_PEER replies in flight per consumer, at most MAX_FRAGMENTS fragments per request; a
request that fails its MAC or is malformed gets no reply and loses its endpoint, and so does an endpoint
that sends no authenticated request within FIRST_REQUEST_TIMEOUT_S (at the cap, a new endpoint evicts the
oldest such one). A get that ends after its request went out (cancelled, refused after its header) hands
the rest of its reply to a drain (`_drain`), so that the producer's sends complete and nothing is left in
UCX's queue, without closing the endpoint its other gets share.

Progress: each store owns two UCX workers (the listener's, the consumer's) that its event loop
progresses (`_LoopWorker`): the loop waits on each worker's event file descriptor, progresses it
and completes the waiting futures in the same thread. No progress or notifier thread stands between
a completion and the coroutine that waits for it.

Device memory: where the process's UCX context carries CUDA memory (decided once, when the context
starts: `_Runtime.device_memory`), the producer holds a CUDA tensor on its device and sends from it,
and a consumer on CUDA receives straight into a new CUDA tensor; UCX picks cuda_ipc between GPUs of
one host and cuda_copy otherwise. ucxx sends and receives any object with `__cuda_array_interface__`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import logging
import os
import secrets
import socket
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from omnistage.connector.buffers import empty_bytes
from omnistage.connector.errors import ConnectorError, PeerUnreachable, TensorNotFound
from omnistage.connector.held import Held
from omnistage.connector.keys import TensorKey
from omnistage.connector.paths import CPU
from omnistage.connector.store import TensorStore
from omnistage.connector.ucx_auth import MAC_BYTES, Authenticator
from omnistage.connector.wire import BAD_REQUEST, HEADER_BYTES, NOT_FOUND, OK, TensorHeader, as_bytes, from_bytes
from omnistage.contract.launch import is_loopback
from omnistage.v1 import tensor_pb2

# A request: this header, the tensor key, zeros, and the MAC of everything before it in the last MAC_BYTES.
REQUEST_BYTES = 1024
_REQUEST = struct.Struct("<4sHHQQQI")  # magic, op, pad, reply tag, fragment bytes, tensor bytes, key length
_MAGIC = b"OSR2"  # 2: MACed requests and replies, random tags (a consumer of the first wire is refused)
_GET, _BYE = 1, 2
_HELLO = np.frombuffer(b"OSHELLO\0", dtype=np.uint8)  # the producer's first word on a new endpoint
_SIGNED = REQUEST_BYTES - MAC_BYTES  # the request bytes its MAC covers
MAX_KEY_BYTES = _SIGNED - _REQUEST.size
REPLY_BYTES = HEADER_BYTES + MAC_BYTES  # a reply header: the tensor header, then its MAC
MIN_FRAGMENT_BYTES = 64 << 10
# Sends one request may cost the producer: a consumer widens its fragments to stay under it (a 64 GiB
# tensor at 16 MiB); a request asking for more is refused with the header alone.
MAX_FRAGMENTS = 4096
# Replies a producer has in flight to one consumer: past it, it reads that consumer's next request only
# once one finished (the consumer's own gets wait; no other consumer does). The consumer's prefetch of a
# step's tensors (a few per chunk, a few chunks ahead) stays well under it.
MAX_REPLIES_PER_PEER = 64
_DISCARD = np.empty(1, dtype=np.uint8)  # where a refused message is received (and truncated)
CONNECT_TIMEOUT_S = 5.0  # a listener that does not say hello within this is unreachable
# A consumer sends its first request right after the hello (it connects for a get): an endpoint that has
# sent no authenticated request within this is closed, so idle connections cannot hold consumer slots.
# Twice CONNECT_TIMEOUT_S: room for a busy consumer's loop (and its idle-endpoint evictions) in between.
FIRST_REQUEST_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 1.0
# The loop progresses the worker when its event descriptor fires; while requests are pending it also
# looks this often, so that an event UCX did not signal cannot stall a transfer.
_SAFETY_PROGRESS_S = 0.1


# UCX settings the connector starts UCX with (UCX_* environment variables win). Endpoints made by
# a listener need peer error handling, and with it UCX's newer protocol layer sends large tcp
# messages as multi-fragment eager copies; the v1 protocols keep rendezvous zero-copy (measured:
# ucx_perftest -e over tcp/lo 0.5-1.2 GB/s with v2, 1.9-4 GB/s with v1).
UCX_DEFAULTS = {"PROTO_ENABLE": "n"}

log = logging.getLogger("omnistage.connector")


def _ucx_api():
    """ucxx's core (non-asyncio) API, imported on first use (an optional dependency), with UCX's
    unused-variable warnings off."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as api
    return api


def _ucx_error():
    from ucxx.exceptions import UCXError
    return UCXError


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


def _device_memory_support(context) -> tuple[bool, str]:
    """Whether a UCX context carries CUDA memory, and why (for the log line)."""
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    if not context.cuda_support:  # build-time
        return False, "this UCX build has no CUDA support"
    found = cuda_transports(context.info)
    if "cuda_copy" not in found:
        return False, "the UCX context opened no cuda_copy transport (UCX_TLS, driver)"
    return True, ", ".join(sorted(found))


class _Runtime:
    """The process's one UCX context, shared by every UCX store in it and dropped when the last closes.
    Whether it carries device memory is decided once, when it starts."""

    users = 0
    context = None
    device_memory = False

    @classmethod
    def acquire(cls, options: dict[str, str]):
        if cls.users == 0:
            api = _ucx_api()
            config = {k: v for k, v in {**UCX_DEFAULTS, **options}.items() if f"UCX_{k}" not in os.environ}
            cls.context = api.UCXContext(config)
            cls.device_memory, why = _device_memory_support(cls.context)
            if torch.cuda.is_available():
                log.log(logging.INFO if cls.device_memory else logging.WARNING,
                        "UCX %s device memory (%s)%s", "carries" if cls.device_memory else "does not carry", why,
                        "" if cls.device_memory else ": CUDA tensors are staged through host memory")
        cls.users += 1
        return cls.context

    @classmethod
    def release(cls) -> None:
        cls.users -= 1
        if cls.users == 0:
            cls.context = None


class _LoopWorker:
    """A UCX worker progressed by one asyncio loop, in the loop's own thread.

    The loop watches the worker's event descriptor (UCX's blocking progress mode): when it fires, or
    right after something was posted, the loop progresses the worker and completes the future of every
    request that finished, then arms the worker again (arming fails while events are unprocessed:
    progress again). So a completion reaches its coroutine with no thread in between; ucxx's own
    asyncio modes either hand it over from a progress thread through a notifier thread (about 1.5 ms
    per round trip here) or poll with `asyncio.sleep(0)` (a core per waiting receive).
    """

    def __init__(self, context, discard_tags: bool = False):
        api = _ucx_api()
        from ucxx._lib.arr import Array
        self.api, self._Array, self.error = api, Array, _ucx_error()
        self.worker = api.UCXWorker(context)  # no delayed submission, no Python futures: we complete requests
        self.worker.init_blocking_progress_mode()
        self.loop = asyncio.get_running_loop()
        self._fd = self.worker.epoll_file_descriptor
        self._pending: dict[Any, tuple[asyncio.Future, object]] = {}  # request -> (future, buffer kept alive)
        self._soon: asyncio.Handle | None = None
        self._safety: asyncio.TimerHandle | None = None
        self._arrivals: list[asyncio.Future] = []  # waiters for a message to arrive: woken by each progress
        # A producer's worker receives requests on streams only: any tagged message reaching it is a peer's
        # junk, received into a one-byte buffer (truncated) so that it does not pile up in UCX's queue.
        self._discard_tags = discard_tags
        self.discarded = 0
        self.loop.add_reader(self._fd, self.progress)

    def close(self) -> None:
        self.loop.remove_reader(self._fd)
        for handle in (self._soon, self._safety):
            if handle is not None:
                handle.cancel()
        self.worker.progress()
        self._complete()
        for future in [f for f, _ in self._pending.values()] + self._arrivals:
            if not future.done():
                future.set_exception(self.error("UCX worker closed"))
        self._pending.clear()
        self._arrivals.clear()

    def post(self, request, buffer=None) -> asyncio.Future:
        """A future of a posted request: done when it completed, with its UCX error if it failed. `buffer`
        is kept alive until then (a cancelled waiter leaves the request to finish, or to be cancelled
        with its endpoint). Awaiting futures (not coroutines) costs no task and no extra turn of the loop."""
        future = self.loop.create_future()
        if request.completed:
            _settle(request, future)
        else:
            self._pending[request] = (future, buffer)
            self.kick()
        return future

    def kick(self) -> None:
        """Progress soon: something was posted (UCX signals no event for what this process started)."""
        if self._soon is None:
            self._soon = self.loop.call_soon(self.progress)

    def progress(self) -> None:
        self._soon = None
        while True:
            self.worker.progress()
            if self._discard_tags:
                self._discard()
            self._complete()
            if self.worker.arm():  # armed: the descriptor fires on the next event
                break
        arrivals, self._arrivals = self._arrivals, []
        for waiter in arrivals:
            if not waiter.done():
                waiter.set_result(None)
        if (self._pending or self._arrivals) and self._safety is None:
            self._safety = self.loop.call_later(_SAFETY_PROGRESS_S, self._safety_progress)

    def _discard(self) -> None:
        while (probe := self.worker.tag_probe(self.api.UCXXTag(0), self.api.UCXXTagMask(0), remove=True)).matched:
            self.discarded += 1
            self.post(self.worker.tag_recv_with_handle(self._array(_DISCARD), probe), _DISCARD).add_done_callback(
                _retrieved)

    def _safety_progress(self) -> None:
        self._safety = None
        self.progress()

    def _complete(self) -> None:
        for request in [r for r in self._pending if r.completed]:
            future, _ = self._pending.pop(request)
            if not future.done():  # else its waiter was cancelled
                _settle(request, future)

    # ---- operations: each posts at once and returns the request's future ------------------------

    def _array(self, buffer):
        return buffer if isinstance(buffer, self._Array) else self._Array(buffer)

    def send(self, ep, buffer, tag: int) -> asyncio.Future:
        return self.post(ep.tag_send(self._array(buffer), self.api.UCXXTag(tag)), buffer)

    def recv(self, ep, buffer, tag: int) -> asyncio.Future:
        return self.post(ep.tag_recv(self._array(buffer), self.api.UCXXTag(tag), self.api.UCXXTagMaskFull), buffer)

    async def arrived(self, tag: int):
        """The next message on `tag`, once it reached this worker: taken out of UCX's queue with its length
        known before any byte lands (ucxx does not report a receive's length); `recv_arrived` receives it
        (a rendezvous message waits for that, so a large one still lands without a copy)."""
        while True:
            probe = self.worker.tag_probe(self.api.UCXXTag(tag), self.api.UCXXTagMaskFull, remove=True)
            if probe.matched:
                return probe
            waiter = self.loop.create_future()
            self._arrivals.append(waiter)
            if self._safety is None:
                self._safety = self.loop.call_later(_SAFETY_PROGRESS_S, self._safety_progress)
            await waiter

    def recv_arrived(self, buffer, probe) -> asyncio.Future:
        return self.post(self.worker.tag_recv_with_handle(self._array(buffer), probe), buffer)

    def stream_send(self, ep, buffer) -> asyncio.Future:
        return self.post(ep.stream_send(self._array(buffer)), buffer)

    def stream_recv(self, ep, buffer) -> asyncio.Future:
        return self.post(ep.stream_recv(self._array(buffer)), buffer)

    def close_endpoint(self, ep) -> None:
        """Close `ep` (once: its owner calls this), flushing what was sent for at most CLOSE_TIMEOUT_S
        (UCX progresses the worker meanwhile); receives still posted on it fail."""
        with contextlib.suppress(Exception):
            ep.close_blocking(period=int(CLOSE_TIMEOUT_S * 1e9), max_attempts=1)
        ep.remove_close_callback()
        self._complete()


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # a discarded message's truncation: expected, not worth asyncio's warning


def _settle(request, future: asyncio.Future) -> None:
    try:
        request.check_error()
    except Exception as e:  # noqa: BLE001 - any UCX error is the waiter's to raise
        future.set_exception(e)
    else:
        future.set_result(None)


@dataclass
class _Peer:
    """A consumer's endpoint to one producer."""
    ep: object
    inflight: int = 0  # gets, and drains of gets that ended early, using it


@dataclass
class _Exchange:
    """What one get posted on its endpoint, so that a get ending early (cancelled, refused after its header)
    hands the rest to a drain: the producer's sends must complete and arrived fragments leave UCX's queue."""
    tag: int = 0
    fragments: list[tuple[int, int]] = field(default_factory=list)
    request_mac: bytes = b""
    reply: np.ndarray | None = None
    header: asyncio.Future | None = None  # the header's receive, once posted (the request follows it)
    taken: int = 0  # fragments taken out of the worker's queue, in order
    receives: list[asyncio.Future] = field(default_factory=list)  # fragment receives posted
    finished: bool = False  # nothing more will arrive for it


def _random_tag() -> int:
    """A reply tag nobody but the producer asked can guess; its fragments' tags follow it."""
    return secrets.randbelow((1 << 64) - MAX_FRAGMENTS - 2) + 1


def _fragment_size(nbytes: int, wanted: int) -> int:
    """The consumer's fragment size, widened so that a tensor never needs more than MAX_FRAGMENTS."""
    if not wanted:
        return 0
    return max(wanted, -(-nbytes // MAX_FRAGMENTS))


def _fragment_count(nbytes: int, fragment_bytes: int) -> int:
    return -(-nbytes // fragment_bytes) if fragment_bytes else int(nbytes > 0)


_WILDCARDS = ("", "0.0.0.0", "::")
_EP_ATTR_LOCAL_SOCKADDR = 1 << 1  # ucp.h UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR
_EP_ATTR_LOCAL_AT = 8 + 32        # ucp_ep_attr_t: field_mask (uint64), name[UCP_ENTITY_NAME_MAX], local_sockaddr


def local_address(ep) -> str | None:
    """The local IP address a listener's endpoint was reached at (ucp_ep_query), or None if UCX cannot
    say. ucxx's Python listener takes no host (its C++ ListenerBuilder does), so the store binds the
    wildcard and refuses endpoints that arrive on any other address than the advertised one."""
    try:
        lib = ctypes.CDLL("libucp.so.0", mode=os.RTLD_NOLOAD)  # the UCX ucxx loaded
        lib.ucp_ep_query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        attr = ctypes.create_string_buffer(1024)  # ucp_ep_attr_t is smaller
        ctypes.c_uint64.from_buffer(attr).value = _EP_ATTR_LOCAL_SOCKADDR
        if lib.ucp_ep_query(ctypes.c_void_p(ep.handle), attr) != 0:
            return None
        raw = attr.raw[_EP_ATTR_LOCAL_AT:_EP_ATTR_LOCAL_AT + 28]  # a sockaddr_in or sockaddr_in6
    except (OSError, AttributeError):
        return None
    family = int.from_bytes(raw[:2], "little")
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8])
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24])
    return None


def _bind_address(host: str) -> str:
    """The advertised host as an IP address (IPv4 or IPv6), or "" for the wildcard."""
    if host in _WILDCARDS:
        return ""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_UNSPEC)[0][4][0])
    except (OSError, IndexError):
        raise ConnectorError(f'the UCX host "{host}" is neither an IP address nor a name that resolves') from None


def _same_address(got: str, advertised: str) -> bool:
    try:
        a, b = ipaddress.ip_address(got), ipaddress.ip_address(advertised)
    except ValueError:
        return False
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return a == b


def _fragments(nbytes: int, fragment_bytes: int) -> list[tuple[int, int]]:
    step = fragment_bytes if fragment_bytes > 0 else max(nbytes, 1)
    return [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)]


class UcxStore(TensorStore):
    backend = "ucx"

    def __init__(self, host_id: str, clock: Callable[[], float], *, host: str = "127.0.0.1",
                 port: int = 0, max_endpoints: int = 64, fragment_bytes: int = 0, get_timeout_s: float = 60.0,
                 options: dict[str, str] | None = None, device: str = CPU, device_memory: bool = True,
                 key: bytes | None = None, max_consumers: int = 256):
        super().__init__(host_id, clock)
        if max_endpoints < 1 or max_consumers < 1:
            raise ValueError(f"max_endpoints and max_consumers must be >= 1, got {max_endpoints}, {max_consumers}")
        if fragment_bytes and fragment_bytes < MIN_FRAGMENT_BYTES:
            raise ValueError(f"fragment_bytes must be 0 (one message) or >= {MIN_FRAGMENT_BYTES}, got {fragment_bytes}")
        self.host, self.port = host, port
        self.max_endpoints = max_endpoints
        self.max_consumers = max_consumers  # endpoints the listener serves at once; more are closed at accept
        self.fragment_bytes = fragment_bytes
        self.get_timeout_s = get_timeout_s
        self.address = ""
        self.auth = Authenticator(key)
        self._worker: _LoopWorker | None = None  # the producer's: the listener and the consumers' endpoints
        self._client: _LoopWorker | None = None  # the consumer's: only endpoints it made, so only they can tag it
        self._listener: Any = None  # a ucxx UCXListener once started
        self._bind_ip = ""  # the advertised address as an IP: endpoints reaching another one are refused
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # consumer side, least recently used first
        self._connecting: dict[str, asyncio.Future] = {}
        self._served: dict[object, asyncio.Task] = {}  # producer side: endpoints of connected consumers
        self._replies: dict[object, set[asyncio.Task]] = {}  # producer side: replies in flight, per consumer
        self.options = options or {}
        self.device = device  # where a get puts the tensors it receives (CPU or CUDA)
        self._allow_device_memory = device_memory
        self.device_memory = False  # set at start: CUDA tensors sent and received as device memory
        # What hostile traffic cost, counted (never delivered): reply headers that failed their MAC,
        # endpoints refused at accept, requests refused (malformed or failing their MAC: endpoint closed).
        self.forged_replies = 0
        self.refused_endpoints = 0
        self.refused_requests = 0
        # Endpoints closed before their first authenticated request: silent past FIRST_REQUEST_TIMEOUT_S, or
        # the oldest such one when a new consumer arrived at the cap.
        self.evicted_endpoints = 0
        self._unauthenticated: OrderedDict[object, None] = OrderedDict()  # producer side, oldest first
        self._drains: set[asyncio.Task] = set()  # consumer side: gets that ended early, being drained

    async def start(self) -> None:
        if not self.auth.enabled and not is_loopback(self.host):
            raise ConnectorError(f"the UCX listener at {self.host} needs the pipeline's data-plane key (the stage's "
                                 "--data-plane-key): without one UCX runs unauthenticated, on loopback only")
        self._bind_ip = _bind_address(self.host)
        context = _Runtime.acquire(self.options)
        try:
            self._worker = _LoopWorker(context, discard_tags=True)
            self._client = _LoopWorker(context)
            self._listener = self._worker.api.UCXListener.create(self._worker.worker, self.port, self._accept,
                                                                 deliver_endpoint=True)
        except BaseException:
            for worker in (self._worker, self._client):
                if worker is not None:
                    worker.close()
            self._worker = self._client = None
            _Runtime.release()
            raise
        self.address = f"{self.host}:{self._listener.port}"
        self.device_memory = self._allow_device_memory and _Runtime.device_memory

    @property
    def endpoints(self) -> int:
        """Open UCX endpoints: to producers (consumer side) plus from consumers (producer side)."""
        return len(self._peers) + len(self._served)

    @property
    def discarded_messages(self) -> int:
        """Tagged messages peers sent to this store's listener (nothing legitimate does): received and dropped."""
        return self._worker.discarded if self._worker is not None else 0

    @property
    def replies_in_flight(self) -> int:
        """Replies the producer has posted and not yet seen completed, to all consumers."""
        return sum(len(tasks) for tasks in self._replies.values())

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

    def _accept(self, ep) -> None:
        """The listener's callback (inside a progress of this store's worker, on its loop)."""
        worker = self._worker
        if self._listener is None or worker is None:
            return
        refusal = None
        if self._bind_ip:
            local = local_address(ep)
            if local is None or not _same_address(local, self._bind_ip):
                refusal = f"reached at {local}, not at the advertised {self.host}"
        if refusal is None and len(self._served) >= self.max_consumers:
            if self._unauthenticated:  # an idle connection gives way to a new one
                self._evict(next(iter(self._unauthenticated)))
            else:
                refusal = f"{self.max_consumers} consumers connected already"
        if refusal is None:
            self._unauthenticated[ep] = None
            self._served[ep] = worker.loop.create_task(self._serve_peer(ep))
            return
        self.refused_endpoints += 1
        log.debug("UCX store %s refused an endpoint: %s", self.address, refusal)
        worker.loop.call_soon(worker.close_endpoint, ep)  # not inside the progress that delivered it

    def _evict(self, ep) -> None:
        """Close an endpoint that has not authenticated (its handler closes it as it ends)."""
        self._unauthenticated.pop(ep, None)
        task = self._served.pop(ep, None)
        if task is not None:
            self.evicted_endpoints += 1
            task.cancel()
            if ep not in self._replies and self._worker is not None:  # cancelled before it ran: close it here
                self._worker.loop.call_soon(self._worker.close_endpoint, ep)

    async def _serve_peer(self, ep) -> None:
        """One consumer's connection: say hello, then answer its requests until it says bye or goes away."""
        worker = self._worker
        assert worker is not None   # close() cancels and awaits these handlers before dropping the worker
        tasks = self._replies[ep] = set()
        request = np.empty(REQUEST_BYTES, dtype=np.uint8)
        deadline = worker.loop.time() + FIRST_REQUEST_TIMEOUT_S  # for the hello and the first request
        try:
            async with asyncio.timeout_at(deadline):
                await worker.stream_send(ep, _HELLO)
            while True:
                if ep in self._unauthenticated:
                    async with asyncio.timeout_at(deadline):
                        await worker.stream_recv(ep, request)
                else:
                    await worker.stream_recv(ep, request)
                raw = request.tobytes()
                magic, op, _, tag, fragment_bytes, nbytes, keylen = _REQUEST.unpack_from(raw)
                mac = raw[_SIGNED:]
                if (magic != _MAGIC or op not in (_GET, _BYE) or keylen > MAX_KEY_BYTES
                        or not self.auth.verify(self.auth.request_mac(raw[:_SIGNED]), mac)):
                    self.refused_requests += 1  # a stranger or a broken consumer: no reply, no endpoint
                    break
                self._unauthenticated.pop(ep, None)
                if op == _BYE:
                    break
                while len(tasks) >= MAX_REPLIES_PER_PEER:  # read this consumer's next request once one finished
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                key = raw[_REQUEST.size:_REQUEST.size + keylen].decode(errors="replace")
                task = asyncio.create_task(self._settle_reply(*self._reply(ep, tag, fragment_bytes, nbytes, key, mac)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except worker.error:
            pass  # the consumer closed or died; its unconsumed tensors wait for release or the TTL
        except TimeoutError:
            self.evicted_endpoints += 1  # connected and said nothing authenticated in time
        finally:
            for task in tasks:
                task.cancel()
            self._unauthenticated.pop(ep, None)
            self._replies.pop(ep, None)
            self._served.pop(ep, None)
            worker.close_endpoint(ep)

    def _reply(self, ep, tag: int, fragment_bytes: int, nbytes: int, wire_key: str,
               request_mac: bytes) -> tuple[list, Held | None]:
        """Post the reply to one get, at once: the header (MACed, bound to the request) on `tag`, then, when
        the tensor is sent, its bytes on the following tags. A refusal is the header alone. Returns the
        sends and the tensor sent (or None)."""
        worker = self._worker
        assert worker is not None   # called by a running consumer handler (_serve_peer)
        try:
            held = self.held.get(TensorKey.parse(wire_key))
            status = NOT_FOUND if held is None else OK if held.nbytes == nbytes else BAD_REQUEST
        except ValueError:
            held, status = None, BAD_REQUEST
        if ((fragment_bytes and fragment_bytes < MIN_FRAGMENT_BYTES)
                or _fragment_count(nbytes, fragment_bytes) > MAX_FRAGMENTS or tag > (1 << 64) - MAX_FRAGMENTS - 2):
            status = BAD_REQUEST
        if status == OK:
            assert held is not None   # OK only when the key is held
            header, data = TensorHeader.of(held.handle), _sendable(as_bytes(held.handle))
            payload = [data[o:o + n] for o, n in _fragments(nbytes, fragment_bytes)]
        else:
            header, payload = TensorHeader(torch.uint8, (), 0, status=status), []
        packed = header.pack()
        reply = np.frombuffer(bytearray(packed + self.auth.reply_mac(request_mac, packed)), dtype=np.uint8)
        sends = [worker.send(ep, reply, tag)]
        sends += [worker.send(ep, p, tag + 1 + i) for i, p in enumerate(payload)]
        return sends, held if status == OK else None

    async def _settle_reply(self, sends: list, held: Held | None) -> None:
        """Count the reader once every send of its reply completed."""
        outcomes = await asyncio.gather(*sends, return_exceptions=True)
        if any(isinstance(o, BaseException) for o in outcomes):
            return  # the consumer went away mid-send; the tensor stays held
        if held is not None:
            held.readers -= 1
            if held.readers <= 0:
                self.consumed(held)

    # ---- consumer side -------------------------------------------------------------------------

    async def get(self, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        if self._client is None:
            raise ConnectorError("UCX store not started: call start() first")
        ucx_error = self._client.error
        peer = await self._peer(ref.address)
        peer.inflight += 1
        exchange = _Exchange()
        delivered = False
        try:
            async with asyncio.timeout(self.get_timeout_s):
                tensor = await self._fetch(peer, ref, exchange)
            delivered = True
            return tensor
        except TimeoutError:
            await self._drop(ref.address)  # closing the endpoint cancels its posted receives
            raise PeerUnreachable(f"UCX get of {ref.key} from {ref.address} took over {self.get_timeout_s} s") from None
        except ucx_error as e:
            await self._drop(ref.address)
            raise PeerUnreachable(f"UCX get of {ref.key} from {ref.address} failed: {type(e).__name__}: {e}") from None
        finally:
            peer.inflight -= 1
            # A get that ended early on an endpoint still in use (cancelled, or refused after its request went
            # out): what the producer still sends for it must be received, or its sends never complete.
            if (not delivered and exchange.header is not None and not exchange.finished
                    and self._peers.get(ref.address) is peer):
                self._start_drain(ref.address, peer, exchange)

    def _start_drain(self, address: str, peer: _Peer, exchange: _Exchange) -> None:
        peer.inflight += 1  # the endpoint stays while the drain uses it
        task = asyncio.get_running_loop().create_task(self._drain(address, peer, exchange))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _drain(self, address: str, peer: _Peer, exchange: _Exchange) -> None:
        """Receive what the producer still sends for a get that ended early: the header, then the fragments
        not yet taken, each into one byte (truncated: dropped), so that the producer's sends complete, its
        reply slot frees and nothing stays in UCX's queue; the receives the get posted complete too. Bounded
        by the get timeout: past it, the endpoint is closed (which cancels what is still posted)."""
        worker = self._client
        assert worker is not None and exchange.header is not None and exchange.reply is not None
        try:
            async with asyncio.timeout(self.get_timeout_s):
                await exchange.header
                raw = exchange.reply.tobytes()
                packed = raw[:HEADER_BYTES]
                if self.auth.verify(self.auth.reply_mac(exchange.request_mac, packed), raw[HEADER_BYTES:]):
                    with contextlib.suppress(ConnectorError):  # else garbage: drain what was asked
                        if TensorHeader.unpack(packed, "").status != OK:
                            return  # a refusal is the header alone
                for i in range(exchange.taken, len(exchange.fragments)):
                    arrived = await worker.arrived(exchange.tag + 1 + i)
                    exchange.taken = i + 1
                    exchange.receives.append(worker.recv_arrived(_DISCARD, arrived))
                await asyncio.gather(*exchange.receives, return_exceptions=True)
        except (TimeoutError, worker.error):
            if self._peers.get(address) is peer:
                log.debug("UCX store %s: a get's reply from %s did not drain: closing the endpoint",
                          self.address, address)
                await self._drop(address)
        finally:
            peer.inflight -= 1

    async def _fetch(self, peer: _Peer, ref: tensor_pb2.TensorRef, exchange: _Exchange) -> torch.Tensor:
        """Post the header receive and the request; once the header checked out, the fragment receives
        (fragments that arrived first wait for them in UCX: large ones as rendezvous, without a copy).
        Posted receives are shielded: a cancelled get leaves them to its drain."""
        worker = self._client
        assert worker is not None   # get() checked that the store started
        fragment_bytes = _fragment_size(ref.nbytes, self.fragment_bytes)
        tag = _random_tag()
        key = ref.key.encode()
        if len(key) > MAX_KEY_BYTES:
            raise ConnectorError(f"tensor key {ref.key[:60]}... is {len(key)} bytes; UCX requests carry at most "
                                 f"{MAX_KEY_BYTES}")
        request, request_mac = self._request(_GET, tag, fragment_bytes, ref.nbytes, key)
        reply = np.zeros(REPLY_BYTES, dtype=np.uint8)
        exchange.tag, exchange.request_mac, exchange.reply = tag, request_mac, reply
        exchange.fragments = _fragments(ref.nbytes, fragment_bytes)
        # the header's receive first, so that the header never arrives unexpected
        exchange.header = worker.recv(peer.ep, reply, tag)
        await asyncio.shield(worker.stream_send(peer.ep, request))
        await asyncio.shield(exchange.header)
        raw_reply = reply.tobytes()
        packed = raw_reply[:HEADER_BYTES]
        if not self.auth.verify(self.auth.reply_mac(request_mac, packed), raw_reply[HEADER_BYTES:]):
            self.forged_replies += 1
            raise ConnectorError(f"UCX reply from {ref.address} for {ref.key} failed authentication (discarded)")
        header = TensorHeader.unpack(packed, f"UCX reply from {ref.address}")
        exchange.finished = header.status != OK  # a refusal is the header alone
        if header.status == NOT_FOUND:
            raise TensorNotFound(f"producer at {ref.address} no longer holds {ref.key} (consumed, released or expired)")
        if header.status != OK:
            raise ConnectorError(f'producer at {ref.address} refused "{ref.key}": the key is malformed, the request '
                                 f"out of bounds, or it holds another size than the reference's {ref.nbytes} bytes")
        if header.nbytes != ref.nbytes:
            raise ConnectorError(f"producer at {ref.address} describes {header.nbytes} bytes for {ref.key}; "
                                 f"the reference says {ref.nbytes}")
        raw = self._receive_buffer(ref.nbytes)
        buf = _sendable(raw)
        for i, (o, n) in enumerate(exchange.fragments):
            arrived = await worker.arrived(tag + 1 + i)
            exchange.taken = i + 1
            if arrived.length != n:  # else a short one would leave bytes of this process's memory in the tensor
                # out of UCX's queue (a longer one fails as truncated)
                exchange.receives.append(worker.recv_arrived(_DISCARD, arrived))
                raise ConnectorError(f"producer at {ref.address} sent {arrived.length} bytes as fragment {i} of "
                                     f"{ref.key}; {n} expected (refused)")
            exchange.receives.append(worker.recv_arrived(buf[o:o + n], arrived))
        outcomes = await asyncio.shield(asyncio.gather(*exchange.receives, return_exceptions=True))
        exchange.finished = True
        for outcome in outcomes:
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
        worker = self._client
        assert worker is not None   # reached from get(), which checked that the store started
        ep = None
        try:
            ep = worker.api.UCXEndpoint.create(worker.worker, host, int(port), True)
            hello = np.empty_like(_HELLO)
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await worker.stream_recv(ep, hello)  # the listener accepted and answers
            if not np.array_equal(hello, _HELLO):
                raise ConnectorError(f"the UCX listener at {address} is not an omnistage producer")
        except Exception as e:  # noqa: BLE001 - any failure to connect means the same to the caller
            if ep is not None:
                worker.close_endpoint(ep)
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
        client = self._client
        assert client is not None   # peers exist only while started; close() drops them all first
        if bye:
            with contextlib.suppress(Exception):
                request, _ = self._request(_BYE, 0, 0, 0, b"")
                await asyncio.wait_for(client.stream_send(peer.ep, request), CLOSE_TIMEOUT_S)
        client.close_endpoint(peer.ep)

    def _request(self, op: int, tag: int, fragment_bytes: int, nbytes: int, key: bytes) -> tuple[np.ndarray, bytes]:
        """A request on the wire, and its MAC (a reply header's MAC covers it)."""
        body = bytearray(_SIGNED)
        _REQUEST.pack_into(body, 0, _MAGIC, op, 0, tag, fragment_bytes, nbytes, len(key))
        body[_REQUEST.size:_REQUEST.size + len(key)] = key
        mac = self.auth.request_mac(bytes(body))
        return np.frombuffer(bytes(body) + mac, dtype=np.uint8), mac

    async def close(self) -> None:
        if self._listener is None:
            return
        await super().close()
        self._listener = None  # refuses new consumers; dropped with the worker below
        for task in list(self._drains):
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        for address in list(self._peers):
            await self._drop(address, bye=True)
        served = list(self._served.values())
        for task in served:  # each consumer's handler closes its endpoint as it ends
            task.cancel()
        if served:
            _, running = await asyncio.wait(served, timeout=5.0)
            if running:
                log.warning("UCX store %s: %d consumer handlers still running at close", self.address, len(running))
        assert self._worker is not None and self._client is not None   # started: both made before the listener
        self._client.close()
        self._worker.close()
        self._worker = self._client = None
        _Runtime.release()


def _sendable(raw: torch.Tensor):
    """A flat uint8 buffer as ucxx takes it: numpy for host memory, the CUDA tensor itself (it has
    `__cuda_array_interface__`) for device memory. Slices of either are views."""
    return raw if raw.is_cuda else raw.numpy()

