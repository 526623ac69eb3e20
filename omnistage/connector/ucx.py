"""UCX backend (ucxx): the producer serves the tensors it holds from a listener; a consumer keeps
one endpoint per producer (cached, bounded) and fetches by key straight into a preallocated tensor.

Per get: the consumer posts, all at once, a fixed-size request (key, size, reply tag, fragment
size), the receive of the reply header and the receives of the bytes straight into the new tensor;
the producer answers with the header on the reply tag and the bytes on the following tags, one
message per fragment, all sent together from the held tensor itself. One round trip, no copies.
A tensor counts as consumed once its last reader's send completed. Requests travel on the
endpoint's stream (so the producer knows which consumer asked); replies on tags the consumer chose.

Progress: each store owns a UCX worker that its event loop progresses (`_LoopWorker`): the loop
waits on the worker's event file descriptor, progresses it and completes the waiting futures in
the same thread. No progress or notifier thread stands between a completion and the coroutine
that waits for it.

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
from typing import TYPE_CHECKING, Any, Callable, cast

import numpy as np
import torch

from omnistage.v1 import tensor_pb2

if TYPE_CHECKING:
    from typing_extensions import Buffer

from omnistage.connector.buffers import empty_bytes
from omnistage.connector.errors import ConnectorError, PeerUnreachable, TensorNotFound
from omnistage.connector.held import Held
from omnistage.connector.keys import TensorKey
from omnistage.connector.paths import CPU
from omnistage.connector.store import TensorStore
from omnistage.connector.wire import BAD_REQUEST, HEADER_BYTES, NOT_FOUND, OK, TensorHeader, as_bytes, from_bytes

REQUEST_BYTES = 1024
_REQUEST = struct.Struct("<4sHHQQQI")  # magic, op, pad, reply tag, fragment bytes, tensor bytes, key length
_MAGIC = b"OSRQ"
_GET, _BYE = 1, 2
_HELLO = np.frombuffer(b"OSHELLO\0", dtype=np.uint8)  # the producer's first word on a new endpoint
MAX_KEY_BYTES = REQUEST_BYTES - _REQUEST.size
MIN_FRAGMENT_BYTES = 64 << 10
MAX_FRAGMENTS = 1 << 16  # a request asking for more is malformed: answered with a refusal header only
CONNECT_TIMEOUT_S = 5.0  # a listener that does not say hello within this is unreachable
CLOSE_TIMEOUT_S = 1.0
# The loop progresses the worker when its event descriptor fires; while requests are pending it also
# looks this often, so that an event UCX did not signal cannot stall a transfer.
_SAFETY_PROGRESS_S = 0.1
_EMPTY = np.empty(0, dtype=np.uint8)


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

    def __init__(self, context):
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
        self.loop.add_reader(self._fd, self.progress)

    def close(self) -> None:
        self.loop.remove_reader(self._fd)
        for handle in (self._soon, self._safety):
            if handle is not None:
                handle.cancel()
        self.worker.progress()
        self._complete()
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(self.error("UCX worker closed"))
        self._pending.clear()

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
            self._complete()
            if self.worker.arm():  # armed: the descriptor fires on the next event
                break
        if self._pending and self._safety is None:
            self._safety = self.loop.call_later(_SAFETY_PROGRESS_S, self._safety_progress)

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
    inflight: int = 0


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
        self._worker: _LoopWorker | None = None
        self._listener: Any = None  # a ucxx UCXListener once started
        self._next_tag = 1  # reply tags: unique on this store's worker, whichever producer answers
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # consumer side, least recently used first
        self._connecting: dict[str, asyncio.Future] = {}
        self._served: dict[object, asyncio.Task] = {}  # producer side: endpoints of connected consumers
        self.options = options or {}
        self.device = device  # where a get puts the tensors it receives (CPU or CUDA)
        self._allow_device_memory = device_memory
        self.device_memory = False  # set at start: CUDA tensors sent and received as device memory

    async def start(self) -> None:
        context = _Runtime.acquire(self.options)
        try:
            self._worker = _LoopWorker(context)
            self._listener = self._worker.api.UCXListener.create(self._worker.worker, self.port, self._accept,
                                                                 deliver_endpoint=True)
        except BaseException:
            if self._worker is not None:
                self._worker.close()
                self._worker = None
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

    def _accept(self, ep) -> None:
        """The listener's callback (inside a progress of this store's worker, on its loop)."""
        if self._listener is None:
            return
        self._served[ep] = asyncio.get_running_loop().create_task(self._serve_peer(ep))

    async def _serve_peer(self, ep) -> None:
        """One consumer's connection: say hello, then answer its requests until it says bye or goes away."""
        worker = self._worker
        assert worker is not None   # close() cancels and awaits these handlers before dropping the worker
        tasks: set[asyncio.Task] = set()
        request = np.empty(REQUEST_BYTES, dtype=np.uint8)
        try:
            await worker.stream_send(ep, _HELLO)
            while True:
                await worker.stream_recv(ep, request)
                magic, op, _, tag, fragment_bytes, nbytes, keylen = _REQUEST.unpack_from(cast("Buffer", request))
                if magic != _MAGIC or op != _GET:
                    break
                key = bytes(request[_REQUEST.size:_REQUEST.size + keylen]).decode(errors="replace")
                task = asyncio.create_task(self._settle_reply(*self._reply(ep, tag, fragment_bytes, nbytes, key)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except worker.error:
            pass  # the consumer closed or died; its unconsumed tensors wait for release or the TTL
        finally:
            for task in tasks:
                task.cancel()
            self._served.pop(ep, None)
            worker.close_endpoint(ep)

    def _reply(self, ep, tag: int, fragment_bytes: int, nbytes: int, wire_key: str) -> tuple[list, Held | None]:
        """Post the reply to one get, at once: the header on `tag`, then the bytes on the following tags.
        A refusal still sends one empty message per expected fragment, so that the consumer, which posted
        every receive up front, is left with none pending. Returns the sends and the tensor sent (or None)."""
        worker = self._worker
        assert worker is not None   # called by a running consumer handler (_serve_peer)
        try:
            held = self.held.get(TensorKey.parse(wire_key))
            status = NOT_FOUND if held is None else OK if held.nbytes == nbytes else BAD_REQUEST
        except ValueError:
            held, status = None, BAD_REQUEST
        if fragment_bytes and nbytes // fragment_bytes >= MAX_FRAGMENTS:
            status, nbytes = BAD_REQUEST, 0
        frags = _fragments(nbytes, fragment_bytes)
        if status == OK:
            assert held is not None   # OK only when the key is held
            header, data = TensorHeader.of(held.handle), _sendable(as_bytes(held.handle))
            payload = [data[o:o + n] for o, n in frags]
        else:
            header, payload = TensorHeader(torch.uint8, (), 0, status=status), [_EMPTY] * len(frags)
        sends = [worker.send(ep, _header_buffer(header), tag)]
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
        if self._worker is None:
            raise ConnectorError("UCX store not started: call start() first")
        ucx_error = self._worker.error
        peer = await self._peer(ref.address)
        peer.inflight += 1
        try:
            async with asyncio.timeout(self.get_timeout_s):
                return await self._fetch(peer, ref)
        except TimeoutError:
            await self._drop(ref.address)  # closing the endpoint cancels its posted receives
            raise PeerUnreachable(f"UCX get of {ref.key} from {ref.address} took over {self.get_timeout_s} s") from None
        except ucx_error as e:
            await self._drop(ref.address)
            raise PeerUnreachable(f"UCX get of {ref.key} from {ref.address} failed: {type(e).__name__}: {e}") from None
        finally:
            peer.inflight -= 1

    async def _fetch(self, peer: _Peer, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        """Post the request, the header receive and every fragment receive at once: one round trip."""
        worker = self._worker
        assert worker is not None   # get() checked that the store started
        frags = _fragments(ref.nbytes, self.fragment_bytes)
        tag, self._next_tag = self._next_tag, self._next_tag + 1 + len(frags)
        key = ref.key.encode()
        request = np.zeros(REQUEST_BYTES, dtype=np.uint8)
        _REQUEST.pack_into(cast("Buffer", request), 0, _MAGIC, _GET, 0, tag, self.fragment_bytes, ref.nbytes, len(key))
        request[_REQUEST.size:_REQUEST.size + len(key)] = np.frombuffer(key, dtype=np.uint8)
        reply = np.empty(HEADER_BYTES, dtype=np.uint8)
        raw = self._receive_buffer(ref.nbytes)
        buf = _sendable(raw)
        # receives first, so that the reply never arrives unexpected (UCX would buffer it)
        posted = [worker.recv(peer.ep, reply, tag)]
        posted += [worker.recv(peer.ep, buf[o:o + n], tag + 1 + i) for i, (o, n) in enumerate(frags)]
        posted.append(worker.stream_send(peer.ep, request))
        done = await asyncio.gather(*posted, return_exceptions=True)
        for outcome in (done[-1], done[0]):
            if isinstance(outcome, BaseException):
                raise outcome
        header = TensorHeader.unpack(reply.tobytes(), f"UCX reply from {ref.address}")
        if header.status == NOT_FOUND:
            raise TensorNotFound(f"producer at {ref.address} no longer holds {ref.key} (consumed, released or expired)")
        if header.status != OK:
            raise ConnectorError(f'producer at {ref.address} refused "{ref.key}": the key is malformed or it holds '
                                 f"another size than the reference's {ref.nbytes} bytes")
        for outcome in done[1:-1]:
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
        worker = self._worker
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
        assert self._worker is not None   # peers exist only while started; close() drops them all first
        if bye:
            with contextlib.suppress(Exception):
                request = np.zeros(REQUEST_BYTES, dtype=np.uint8)
                _REQUEST.pack_into(cast("Buffer", request), 0, _MAGIC, _BYE, 0, 0, 0, 0, 0)
                await asyncio.wait_for(self._worker.stream_send(peer.ep, request), CLOSE_TIMEOUT_S)
        self._worker.close_endpoint(peer.ep)

    async def close(self) -> None:
        if self._listener is None:
            return
        await super().close()
        self._listener = None  # refuses new consumers; dropped with the worker below
        for address in list(self._peers):
            await self._drop(address, bye=True)
        served = list(self._served.values())
        for task in served:  # each consumer's handler closes its endpoint as it ends
            task.cancel()
        if served:
            _, running = await asyncio.wait(served, timeout=5.0)
            if running:
                log.warning("UCX store %s: %d consumer handlers still running at close", self.address, len(running))
        assert self._worker is not None   # started: start() sets the listener only once the worker is up
        self._worker.close()
        self._worker = None
        _Runtime.release()


def _sendable(raw: torch.Tensor):
    """A flat uint8 buffer as ucxx takes it: numpy for host memory, the CUDA tensor itself (it has
    `__cuda_array_interface__`) for device memory. Slices of either are views."""
    return raw if raw.is_cuda else raw.numpy()


def _header_buffer(header: TensorHeader) -> np.ndarray:
    return np.frombuffer(bytearray(header.pack()), dtype=np.uint8)
