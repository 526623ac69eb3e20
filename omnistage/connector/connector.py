"""The connector: one stage's handle on the data plane.

`put` turns a tensor into a descriptor (an omnistage.v1.Tensor) that either carries the bytes
inline or references them in this stage's shared-memory or UCX store; `get` turns any descriptor
back into the tensor, from whichever host produced it. `auto` picks the transport per tensor.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from typing import Callable

import torch

from omnistage import tensors
from omnistage.spec import TRANSPORTS
from omnistage.v1 import tensor_pb2

from .errors import ConnectorError
from .keys import TensorKey
from .shm import ShmStore
from .store import TensorStore
from .ucx import UcxStore

STORES = (ShmStore.backend, UcxStore.backend)  # the transports that hold tensors (inline holds nothing)
INLINE_THRESHOLD = 64 << 10


def choose_transport(requested: str, nbytes: int, *, available: set[str], inline_threshold: int,
                     same_host: bool | None) -> str:
    """The transport for one tensor. `same_host`: whether the consumer shares this host (None: unknown).

    auto: inline under the threshold; shared memory when the consumer is on this host; else UCX;
    with the consumer's host unknown, UCX (it reaches any host), or shared memory without UCX.
    """
    if requested not in TRANSPORTS:
        raise ConnectorError(f'transport "{requested}" is not one of {", ".join(TRANSPORTS)}')
    if requested != "auto":
        if requested != "inline" and requested not in available:
            raise ConnectorError(f'transport "{requested}" is not enabled on this connector '
                                 f'(enabled: {", ".join(sorted(available | {"inline"}))})')
        return requested
    if nbytes < inline_threshold:
        return "inline"
    if same_host is True and "shm" in available:
        return "shm"
    if "ucx" in available:
        return "ucx"
    if same_host is False:
        raise ConnectorError("the consumer is on another host and UCX is not enabled on this connector")
    return "shm" if "shm" in available else "inline"


def default_host_id() -> str:
    """Identifies the shared-memory domain: the host name (a pod sets it to its node, or itself)."""
    return socket.gethostname()


class Connector:
    """put / get / release of one stage's tensors; holds what it put until consumed, released or expired."""

    def __init__(self, stage: str, host_id: str, stores: dict[str, TensorStore],
                 inline_threshold: int = INLINE_THRESHOLD):
        self.stage = stage
        self.host_id = host_id
        self.stores = stores
        self.inline_threshold = inline_threshold
        self.release_listeners: list[Callable[[int, str], None]] = []  # (bytes, reason) after each release
        for s in stores.values():
            s.held.on_release = self._released

    def _released(self, nbytes: int, reason: str) -> None:
        for listener in self.release_listeners:
            listener(nbytes, reason)

    def transport_for(self, tensor: torch.Tensor, transport: str = "auto", consumer_host: str | None = None) -> str:
        """The transport `put` will use for this tensor."""
        same_host = None if consumer_host is None else consumer_host == self.host_id
        return choose_transport(transport, tensor.numel() * tensor.element_size(), available=set(self.stores),
                                inline_threshold=self.inline_threshold, same_host=same_host)

    async def put(self, key: TensorKey, tensor: torch.Tensor, *, transport: str = "auto",
                  consumer_host: str | None = None, readers: int = 1) -> tensor_pb2.Tensor:
        """The descriptor of `tensor` for its consumer(s). Referenced tensors stay held for `readers` gets;
        the caller must not modify the tensor afterwards (UCX sends from it without a copy)."""
        if not isinstance(tensor, torch.Tensor):
            raise ConnectorError(f"put {key.wire}: expected a torch.Tensor, got {type(tensor).__name__}")
        if key.stage != self.stage:
            raise ConnectorError(f'put {key.wire}: this connector belongs to stage "{self.stage}"')
        if readers < 1:
            raise ConnectorError(f"put {key.wire}: readers must be >= 1, got {readers}")
        tensors.proto_dtype(tensor.dtype)  # a clear error for dtypes the wire cannot carry
        chosen = self.transport_for(tensor, transport, consumer_host)
        if chosen == "inline":
            return tensors.to_proto(key.name, tensor)
        ref = await self.stores[chosen].put(key, _own(tensor), readers)
        return tensor_pb2.Tensor(name=key.name, dtype=tensors.proto_dtype(tensor.dtype), shape=list(tensor.shape),
                                 ref=ref)

    async def get(self, msg: tensor_pb2.Tensor) -> torch.Tensor:
        """The tensor a descriptor stands for (inline bytes, or fetched from the producer's store)."""
        if msg.WhichOneof("payload") != "ref":
            return tensors.from_proto(msg)
        ref = msg.ref
        store = self.stores.get(ref.backend)
        if store is None:
            raise ConnectorError(f'tensor "{msg.name}" ({ref.key}) is held in "{ref.backend}", which this connector '
                                 f'does not enable (enabled: {", ".join(sorted(self.stores)) or "inline only"})')
        t = await store.get(ref)
        if t.dtype != tensors.torch_dtype(msg.dtype) or list(t.shape) != list(msg.shape):
            raise tensors.TensorFormatError(
                f'tensor "{msg.name}" ({ref.key}): the descriptor says {tensors.DTYPE_NAMES.get(msg.dtype, msg.dtype)} '
                f"{list(msg.shape)}, the producer holds {t.dtype} {list(t.shape)}")
        return t

    def release(self, key: TensorKey, reason: str = "ack") -> int:
        """Stop holding one tensor; returns the bytes freed."""
        return sum(s.release([key], reason) for s in self.stores.values())

    def release_chunk(self, request_id: str, chunk_id: int, reason: str = "ack") -> int:
        return sum(s.release(s.held.select(request_id, chunk_id), reason) for s in self.stores.values())

    def release_request(self, request_id: str, reason: str = "cancel") -> int:
        """Free every tensor of a request (cancelled, failed or finished); returns the bytes freed."""
        return sum(s.release(s.held.select(request_id), reason) for s in self.stores.values())

    def evict_fetched(self, nbytes: int) -> int:
        """Free kept tensors their readers already fetched, oldest first, until `nbytes` are freed."""
        freed = 0
        for s in self.stores.values():
            if freed < nbytes:
                freed += s.evict_fetched(nbytes - freed)
        return freed

    @property
    def unfetched_bytes(self) -> int:
        """Bytes held that some consumer has still to fetch (what a draining stage waits for)."""
        return sum(s.unfetched_bytes for s in self.stores.values())

    def expire(self, max_age_s: float, now: float | None = None) -> int:
        """Free tensors held longer than `max_age_s` (their consumer vanished); returns the bytes freed."""
        return sum(s.release(s.held.older_than(max_age_s, now), "ttl") for s in self.stores.values())

    @property
    def held_bytes(self) -> int:
        """Bytes held for consumers (after noticing shared-memory segments their readers consumed)."""
        return sum(s.held_bytes for s in self.stores.values())

    @property
    def held_bytes_known(self) -> int:
        """Bytes held as last counted, without looking for consumed shared-memory segments (cheap)."""
        return sum(s.held.nbytes for s in self.stores.values())

    @property
    def held_tensors(self) -> int:
        return sum(len(s.held) for s in self.stores.values())

    @property
    def endpoints(self) -> int:
        ucx = self.stores.get("ucx")
        return ucx.endpoints if isinstance(ucx, UcxStore) else 0

    @property
    def ucx_address(self) -> str:
        ucx = self.stores.get("ucx")
        return ucx.address if isinstance(ucx, UcxStore) else ""

    async def close(self) -> None:
        for s in self.stores.values():
            await s.close()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that does not pin a much larger buffer it is a view of."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu")
    if not t.is_contiguous():
        return t.contiguous()
    if t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size():
        return t.clone()
    return t


async def make_connector(stage: str, transports: tuple[str, ...] | list[str] = STORES, *,
                         host_id: str | None = None, inline_threshold: int = INLINE_THRESHOLD,
                         ucx_host: str = "127.0.0.1", ucx_port: int = 0, max_endpoints: int = 64,
                         fragment_bytes: int = 0, get_timeout_s: float = 60.0, shm_dir: str = "/dev/shm",
                         clock: Callable[[], float] = time.monotonic,
                         ucx_options: dict[str, str] | None = None, retain_fetched: bool = False) -> Connector:
    """A started connector for `stage` with the given stores ("shm", "ucx"; inline is always on).

    `ucx_host` is the address consumers reach this stage's UCX listener at (a pod IP on a cluster);
    `ucx_options` are UCX settings without the UCX_ prefix (the environment wins over them);
    `retain_fetched`: keep tensors after their last reader, for a retried consumer (store.py).
    """
    unknown = [t for t in transports if t not in STORES]
    if unknown:
        raise ConnectorError(f"unknown transport(s) {', '.join(unknown)}: choose from {', '.join(STORES)} "
                             "(inline is always on)")
    host_id = host_id or default_host_id()
    ucx_options = dict(ucx_options or {})
    if _is_loopback(ucx_host):
        ucx_options.setdefault("NET_DEVICES", "lo")  # consumers come over loopback: keep UCX's lanes there too
    stores: dict[str, TensorStore] = {}
    if "shm" in transports:
        stores["shm"] = ShmStore(host_id, clock, shm_dir=shm_dir)
    if "ucx" in transports:
        ucx = UcxStore(host_id, clock, host=ucx_host, port=ucx_port, max_endpoints=max_endpoints,
                       fragment_bytes=fragment_bytes, get_timeout_s=get_timeout_s, options=ucx_options)
        await ucx.start()
        stores["ucx"] = ucx
    for store in stores.values():
        store.retain_fetched = retain_fetched
    return Connector(stage, host_id, stores, inline_threshold)
