"""The connector: one stage's handle on the data plane.

`put` turns a tensor into a descriptor (an omnistage.v1.Tensor) that either carries the bytes
inline or references them in this stage's shared-memory or UCX store; `get` turns any descriptor
back into the tensor, from whichever host produced it. `auto` picks the transport per tensor.

A connector has a device: where `get` puts the tensors it returns (a CUDA consumer gets CUDA tensors
from every transport). A CUDA tensor leaves from device memory over UCX when UCX carries device
memory, else it is staged to host; which memory path each tensor took is `path_of` (paths.py).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable

import torch

from omnistage.api import TRANSPORTS
from omnistage.connector.errors import ConnectorError
from omnistage.connector.keys import TensorKey
from omnistage.connector.paths import CPU, CUDA, HOST, choose_path, device_kind, sends_device_memory, widen_tls_for_cuda
from omnistage.connector.shm import ShmStore
from omnistage.connector.store import TensorStore
from omnistage.connector.ucx import UcxStore
from omnistage.contract import tensors
from omnistage.contract.launch import is_loopback
from omnistage.v1 import tensor_pb2

STORES = (ShmStore.backend, UcxStore.backend)  # the transports that hold tensors (inline holds nothing)
INLINE_THRESHOLD = 64 << 10

log = logging.getLogger("omnistage.connector")


def choose_transport(requested: str, nbytes: int, *, available: set[str], inline_threshold: int,
                     same_host: bool | None, device_memory: bool = False, consumer_device: str | None = None) -> str:
    """The transport for one tensor. `same_host`: whether the consumer shares this host (None: unknown);
    `device_memory`: the tensor is on CUDA and this connector's UCX can send it from there;
    `consumer_device`: where the consumer wants it ("cpu", "cuda", None: unknown).

    auto: inline under the threshold; UCX for a CUDA tensor UCX can carry to a consumer known to be on
    CUDA (between GPUs of one host that is CUDA IPC, where shared memory would be two host copies);
    shared memory when the consumer is on this host; else UCX; with the consumer's host unknown, UCX
    (it reaches any host), or shared memory without UCX.
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
    if device_memory and consumer_device == CUDA and "ucx" in available:
        return "ucx"
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
                 inline_threshold: int = INLINE_THRESHOLD, device: str = CPU):
        self.stage = stage
        self.device = device  # where get puts tensors: "cpu", "cuda" or "cuda:<n>"
        self.host_id = host_id
        self.stores = stores
        self.inline_threshold = inline_threshold
        self.release_listeners: list[Callable[[int, str], None]] = []  # (bytes, reason) after each release
        for s in stores.values():
            s.held.on_release = self._released

    def _released(self, nbytes: int, reason: str) -> None:
        for listener in self.release_listeners:
            listener(nbytes, reason)

    @property
    def ucx_device_memory(self) -> bool:
        """Whether this connector's UCX sends and receives CUDA tensors as device memory."""
        ucx = self.stores.get("ucx")
        return isinstance(ucx, UcxStore) and ucx.device_memory

    def transport_for(self, tensor: torch.Tensor, transport: str = "auto", consumer_host: str | None = None,
                      consumer_device: str | None = None) -> str:
        """The transport `put` will use for this tensor."""
        same_host = None if consumer_host is None else consumer_host == self.host_id
        return choose_transport(transport, tensor.numel() * tensor.element_size(), available=set(self.stores),
                                inline_threshold=self.inline_threshold, same_host=same_host,
                                device_memory=tensor.is_cuda and self.ucx_device_memory,
                                consumer_device=consumer_device)

    def path_of(self, msg: tensor_pb2.Tensor) -> str:
        """The memory path a descriptor's tensor takes to this connector (paths.py): from the producer's
        tensor device and where it holds the bytes to this connector's device."""
        mine = device_kind(self.device)
        if msg.WhichOneof("payload") != "ref":
            return choose_path("inline", device_kind(msg.device), False, mine, None)
        ref = msg.ref
        from_device = ref.backend == "ucx" and ref.memory == CUDA
        if from_device and mine == CUDA and not self.ucx_device_memory:
            return "host-staged"  # our UCX cannot receive into the device: host buffer, then a copy
        return choose_path(ref.backend, device_kind(msg.device), from_device, mine, ref.host_id == self.host_id)

    async def put(self, key: TensorKey, tensor: torch.Tensor, *, transport: str = "auto",
                  consumer_host: str | None = None, readers: int = 1,
                  consumer_device: str | None = None) -> tensor_pb2.Tensor:
        """The descriptor of `tensor` for its consumer(s). Referenced tensors stay held for `readers` gets;
        the caller must not modify the tensor afterwards (UCX sends from it without a copy)."""
        if not isinstance(tensor, torch.Tensor):
            raise ConnectorError(f"put {key.wire}: expected a torch.Tensor, got {type(tensor).__name__}")
        if key.stage != self.stage:
            raise ConnectorError(f'put {key.wire}: this connector belongs to stage "{self.stage}"')
        if readers < 1:
            raise ConnectorError(f"put {key.wire}: readers must be >= 1, got {readers}")
        tensors.proto_dtype(tensor.dtype)  # a clear error for dtypes the wire cannot carry
        chosen = self.transport_for(tensor, transport, consumer_host, consumer_device)
        device = device_kind(tensor.device.type)
        on_wire = device if device == CUDA else ""  # unset means the CPU: descriptors of CPU tensors are unchanged
        if chosen == "inline":
            msg = tensors.to_proto(key.name, tensor)
            msg.device = on_wire
            return msg
        keep_device = sends_device_memory(chosen, device, self.ucx_device_memory)
        ref = await self.stores[chosen].put(key, _own(tensor, keep_device), readers)
        ref.memory = CUDA if keep_device else HOST
        return tensor_pb2.Tensor(name=key.name, dtype=tensors.proto_dtype(tensor.dtype), shape=list(tensor.shape),
                                 ref=ref, device=on_wire)

    async def get(self, msg: tensor_pb2.Tensor) -> torch.Tensor:
        """The tensor a descriptor stands for (inline bytes, or fetched from the producer's store)."""
        if msg.WhichOneof("payload") != "ref":
            return self._on_device(tensors.from_proto(msg))
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
        return self._on_device(t)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A received tensor where this connector's consumer wants it (UCX may have landed it there)."""
        if self.device == CPU or t.is_cuda:
            return t
        return t.to(self.device)

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


def _own(t: torch.Tensor, keep_device: bool = False) -> torch.Tensor:
    """A contiguous tensor that does not pin a much larger buffer it is a view of: on the CPU, or on
    its CUDA device when the store sends device memory (`keep_device`)."""
    t = t.detach()
    if t.device.type != "cpu" and not keep_device:
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
                         ucx_options: dict[str, str] | None = None, retain_fetched: bool = False,
                         device: str = CPU, ucx_device_memory: bool = True,
                         ucx_key: bytes | None = None) -> Connector:
    """A started connector for `stage` with the given stores ("shm", "ucx"; inline is always on).

    `ucx_host` is the address consumers reach this stage's UCX listener at (a pod IP on a cluster);
    `ucx_options` are UCX settings without the UCX_ prefix (the environment wins over them);
    `retain_fetched`: keep tensors after their last reader, for a retried consumer (store.py);
    `device`: where `get` puts tensors ("cpu", "cuda", "cuda:<n>"); `ucx_device_memory=False` keeps
    CUDA tensors off UCX's CUDA transports (staged through host memory); `ucx_key`: the pipeline's
    data-plane key (omnistage.connector.ucx_auth), needed unless `ucx_host` is loopback.
    """
    unknown = [t for t in transports if t not in STORES]
    if unknown:
        raise ConnectorError(f"unknown transport(s) {', '.join(unknown)}: choose from {', '.join(STORES)} "
                             "(inline is always on)")
    device = _checked_device(device)
    host_id = host_id or default_host_id()
    ucx_options = dict(ucx_options or {})
    if is_loopback(ucx_host):
        ucx_options.setdefault("NET_DEVICES", "lo")  # consumers come over loopback: keep UCX's lanes there too
    if device != CPU and ucx_device_memory and "ucx" in transports:
        _allow_cuda_transports(ucx_options)
    stores: dict[str, TensorStore] = {}
    if "shm" in transports:
        stores["shm"] = ShmStore(host_id, clock, shm_dir=shm_dir)
    if "ucx" in transports:
        ucx = UcxStore(host_id, clock, host=ucx_host, port=ucx_port, max_endpoints=max_endpoints,
                       fragment_bytes=fragment_bytes, get_timeout_s=get_timeout_s, options=ucx_options,
                       device=device, device_memory=ucx_device_memory, key=ucx_key)
        await ucx.start()
        stores["ucx"] = ucx
    for store in stores.values():
        store.retain_fetched = retain_fetched
    return Connector(stage, host_id, stores, inline_threshold, device)


def _checked_device(device: str) -> str:
    """`device` as torch names it, refused with one clear line when unknown or absent here."""
    kind, _, index = str(device).partition(":")
    if kind not in (CPU, CUDA) or (index and (kind == CPU or not index.isdigit())):
        raise ConnectorError(f'connector device "{device}" is not "cpu", "cuda" or "cuda:<n>"')
    if kind == CUDA and not torch.cuda.is_available():
        raise ConnectorError(f'connector device "{device}": torch sees no CUDA device in this process')
    return str(device)


def _allow_cuda_transports(ucx_options: dict[str, str]) -> None:
    """On CUDA, let UCX open cuda_copy / cuda_ipc: a UCX_TLS inclusion list written for CPU nodes
    (`tcp`) would keep device memory off UCX. UCX reads the environment first, so it is widened there."""
    current = os.environ.get("UCX_TLS") or ucx_options.get("TLS", "")
    widened = widen_tls_for_cuda(current)
    if widened != current:
        log.info("UCX_TLS %s -> %s: this connector is on CUDA", current, widened)
        ucx_options["TLS"] = widened
        if "UCX_TLS" in os.environ:
            os.environ["UCX_TLS"] = widened
