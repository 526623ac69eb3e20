"""Which memory a tensor's bytes go through on one edge: pure rules, table-tested.

A tensor leaves the producer from device memory only over UCX, and only when the producer's UCX
can carry device memory (CUDA in torch and cuda_copy in the UCX context): shared memory and inline
bytes are host memory, so a CUDA tensor sent through them is staged to host by the producer. The
consumer allocates its receive buffer on its own device, so bytes reach a CUDA consumer's device
straight from UCX, or with one copy to the device after a host transport.

The path names the memory at both ends (a small fixed set: it labels a Prometheus counter):

| path | producer bytes | consumer | how |
| --- | --- | --- | --- |
| `cuda-ipc` | device | CUDA, same host | UCX cuda_ipc: GPU to GPU, no host copy |
| `cuda` | device | CUDA, other host | UCX device to device over the network (cuda_copy) |
| `device-to-host` | device, or staged by the producer | CPU | staged on the producer's end only |
| `host-to-device` | host (a CPU tensor) | CUDA | moved to the device on the consumer's end only |
| `host-staged` | staged by the producer (shm, inline, no CUDA UCX) | CUDA | host copies on both ends |
| `host` | host | CPU | no device involved |
"""

from __future__ import annotations

from omnistage.contract.devices import CPU, CUDA  # devices (torch's names)

HOST = "host"              # memory of a CPU tensor or a staged one (a TensorRef's `memory`)
DEVICES = (CPU, CUDA)
PATHS = ("cuda-ipc", "cuda", "device-to-host", "host-to-device", "host-staged", "host")


def device_kind(device: str | None) -> str:
    """"cuda" for any CUDA device ("cuda", "cuda:1"), else "cpu" (empty: an older peer, a CPU one)."""
    return CUDA if device and str(device).split(":", 1)[0] == CUDA else CPU


def sends_device_memory(transport: str, producer_device: str, ucx_device_memory: bool) -> bool:
    """Whether the producer sends from device memory (else it stages the tensor to host first)."""
    return transport == "ucx" and producer_device == CUDA and ucx_device_memory


def choose_path(transport: str, producer_device: str, ucx_device_memory: bool, consumer_device: str,
                same_host: bool | None) -> str:
    """The path of one tensor: `transport` ("inline", "shm", "ucx") as chosen, `producer_device` of its
    tensor, whether the producer's UCX carries device memory, the consumer's device, and whether both
    ends share a host (None: unknown; counted as another host)."""
    if producer_device not in DEVICES or consumer_device not in DEVICES:
        raise ValueError(f"devices are {' or '.join(DEVICES)}, got {producer_device!r} -> {consumer_device!r}")
    if sends_device_memory(transport, producer_device, ucx_device_memory):
        if consumer_device == CUDA:
            return "cuda-ipc" if same_host is True else "cuda"
        return "device-to-host"
    if producer_device == CUDA:
        return "host-staged" if consumer_device == CUDA else "device-to-host"
    return "host-to-device" if consumer_device == CUDA else "host"


def tls_allows_cuda(tls: str) -> bool:
    """Whether a UCX_TLS value lets UCX use its CUDA transports (cuda_copy, and cuda_ipc on one host)."""
    names = [t.strip() for t in tls.removeprefix("^").split(",") if t.strip()]
    if tls.startswith("^"):  # an exclusion list
        return not any(n in ("cuda", "cuda_copy") for n in names)
    return any(n in ("all", "cuda", "cuda_copy") for n in names)


def widen_tls_for_cuda(tls: str) -> str:
    """A UCX_TLS inclusion list that also allows the CUDA transports (a list such as `tcp`, set for
    CPU nodes, would keep device memory off UCX); other values unchanged."""
    if not tls or tls_allows_cuda(tls) or tls.startswith("^"):
        return tls
    return f"{tls},cuda_copy,cuda_ipc"
