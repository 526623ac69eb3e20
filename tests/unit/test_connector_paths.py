"""Which memory a tensor goes through per edge: the path table, `auto` for CUDA tensors, the UCX
settings for device memory, the descriptor's memory fields, the device a connector hands tensors
out on, and the per-edge path metric over real shared-memory and UCX transfers (CPU: `host`).
CUDA-only tests skip without a device."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from omnistage.connector import ChunkReceiver, ChunkSender, ConnectorError, TensorKey, TransferMetrics, make_connector
from omnistage.connector.connector import choose_transport
from omnistage.connector.paths import PATHS, choose_path, device_kind, tls_allows_cuda, widen_tls_for_cuda
from omnistage.connector.ucx import cuda_transports
from omnistage.v1 import stage_pb2, tensor_pb2

from ..connector_peer import PeerProcess, decode, digest
from ..connector_support import connector_pair

KIB = 1 << 10
BIG = 256 * KIB  # above the inline threshold
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("transport, producer, ucx_cuda, consumer, same_host, path", [
    # both ends on CUDA
    ("ucx", "cuda", True, "cuda", True, "cuda-ipc"),         # UCX cuda_ipc between GPUs of one host
    ("ucx", "cuda", True, "cuda", False, "cuda"),            # device to device over the network
    ("ucx", "cuda", True, "cuda", None, "cuda"),             # host unknown: counted as another host
    ("ucx", "cuda", False, "cuda", True, "host-staged"),     # the producer's UCX cannot send device memory
    ("shm", "cuda", True, "cuda", True, "host-staged"),      # shared memory holds host memory
    ("inline", "cuda", True, "cuda", True, "host-staged"),   # bytes via .cpu()
    # the producer on CUDA, the consumer on the CPU: staged on the producer's end only
    ("ucx", "cuda", True, "cpu", True, "device-to-host"),
    ("ucx", "cuda", True, "cpu", False, "device-to-host"),
    ("ucx", "cuda", False, "cpu", False, "device-to-host"),
    ("shm", "cuda", False, "cpu", True, "device-to-host"),
    ("inline", "cuda", False, "cpu", None, "device-to-host"),
    # the producer on the CPU, the consumer on CUDA: moved to the device on the consumer's end only
    ("ucx", "cpu", True, "cuda", True, "host-to-device"),
    ("ucx", "cpu", True, "cuda", False, "host-to-device"),
    ("shm", "cpu", False, "cuda", True, "host-to-device"),
    ("inline", "cpu", False, "cuda", None, "host-to-device"),
    # neither end on CUDA
    ("ucx", "cpu", True, "cpu", False, "host"),
    ("ucx", "cpu", False, "cpu", True, "host"),
    ("shm", "cpu", False, "cpu", True, "host"),
    ("inline", "cpu", False, "cpu", None, "host"),
])
def test_path_per_edge(transport, producer, ucx_cuda, consumer, same_host, path):
    assert choose_path(transport, producer, ucx_cuda, consumer, same_host) == path
    assert path in PATHS


def test_path_refuses_unknown_devices():
    with pytest.raises(ValueError, match="devices are cpu or cuda"):
        choose_path("ucx", "tpu", False, "cpu", True)


@pytest.mark.parametrize("device, kind", [("cuda", "cuda"), ("cuda:1", "cuda"), ("cpu", "cpu"), ("", "cpu"),
                                          (None, "cpu")])
def test_device_kind(device, kind):
    assert device_kind(device) == kind


@pytest.mark.parametrize("nbytes, available, same_host, device_memory, consumer, transport", [
    (BIG, {"shm", "ucx"}, True, True, "cuda", "ucx"),     # CUDA IPC beats two host copies
    (BIG, {"shm", "ucx"}, True, True, "cpu", "shm"),      # a CPU consumer: shared memory as before
    (BIG, {"shm", "ucx"}, True, True, None, "shm"),       # consumer's device unknown: as before
    (BIG, {"shm", "ucx"}, True, False, "cuda", "shm"),    # UCX cannot carry device memory: staged anyway
    (BIG, {"shm"}, True, True, "cuda", "shm"),            # no UCX here
    (BIG, {"shm", "ucx"}, False, True, "cuda", "ucx"),    # another host: UCX, device to device
    (10, {"shm", "ucx"}, True, True, "cuda", "inline"),   # small tensors stay inline
])
def test_auto_prefers_ucx_for_cuda_tensors_between_gpus(nbytes, available, same_host, device_memory, consumer,
                                                        transport):
    assert choose_transport("auto", nbytes, available=available, inline_threshold=64 * KIB, same_host=same_host,
                            device_memory=device_memory, consumer_device=consumer) == transport


@pytest.mark.parametrize("tls, allows, widened", [
    ("all", True, "all"),
    ("tcp", False, "tcp,cuda_copy,cuda_ipc"),
    ("tcp,sm", False, "tcp,sm,cuda_copy,cuda_ipc"),
    ("tcp,cuda_copy,cuda_ipc", True, "tcp,cuda_copy,cuda_ipc"),
    ("tcp,cuda", True, "tcp,cuda"),
    ("^sm", True, "^sm"),
    ("^cuda_copy", False, "^cuda_copy"),  # an exclusion the operator wrote on purpose: left alone
    ("", False, ""),                      # unset: UCX's default is all
])
def test_ucx_tls_on_gpu_nodes(tls, allows, widened):
    assert tls_allows_cuda(tls) is allows
    assert widen_tls_for_cuda(tls) == widened


CONTEXT_INFO = """#
# UCP context
#
#     component 0  :  self
#     component 1  :  tcp
#     component 2  :  cuda_cpy
#     component 3  :  cuda_ipc
#
#            md 2  :  component 2  cuda_cpy
"""


def test_cuda_transports_from_the_ucx_context_info():
    assert cuda_transports(CONTEXT_INFO) == {"cuda_copy", "cuda_ipc"}
    assert cuda_transports(CONTEXT_INFO.replace("cuda_ipc", "sysv")) == {"cuda_copy"}
    assert cuda_transports("#     component 0  :  self\n#     component 1  :  tcp\n") == set()


def test_descriptor_memory_fields_round_trip():
    msg = tensor_pb2.Tensor(name="hidden", dtype=tensor_pb2.BFLOAT16, shape=[2, 3], device="cuda",
                            ref=tensor_pb2.TensorRef(backend="ucx", address="10.0.0.1:5000", key="r/s/0/hidden",
                                                     nbytes=12, host_id="h", memory="cuda"))
    back = tensor_pb2.Tensor.FromString(msg.SerializeToString())
    assert back == msg and back.ref.memory == "cuda" and back.device == "cuda"
    old = tensor_pb2.Tensor.FromString(tensor_pb2.Tensor(name="x", data=b"\0" * 4, dtype=tensor_pb2.FLOAT32,
                                                         shape=[1]).SerializeToString())
    assert old.device == ""  # an older producer's descriptor: a CPU tensor


@pytest.mark.parametrize("device", ["tpu", "cpu:0", "cuda:x", "gpu"])
async def test_make_connector_refuses_an_unknown_device(device):
    with pytest.raises(ConnectorError, match=f'connector device "{device}" is not "cpu", "cuda" or "cuda:<n>"'):
        await make_connector("talker", (), device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
async def test_make_connector_refuses_cuda_without_a_device():
    with pytest.raises(ConnectorError, match="torch sees no CUDA device"):
        await make_connector("talker", (), device="cuda")


@pytest.fixture
async def pair():
    async with connector_pair("h") as connectors:
        yield connectors


async def test_cpu_tensors_are_host_memory_in_the_descriptor(pair):
    producer, consumer = pair
    assert producer.device == "cpu" and not producer.ucx_device_memory  # no CUDA here
    t = torch.arange(BIG // 4, dtype=torch.float32)
    for transport in ("shm", "ucx"):
        msg = await producer.put(TensorKey("r1", "thinker", 0, transport), t, transport=transport)
        assert msg.ref.memory == "host" and msg.device == ""
        assert consumer.path_of(msg) == "host"
        assert torch.equal(await consumer.get(msg), t)
    inline = await producer.put(TensorKey("r1", "thinker", 0, "small"), torch.ones(3))
    assert inline.WhichOneof("payload") == "data" and consumer.path_of(inline) == "host"


async def test_a_cpu_consumer_reads_a_device_memory_descriptor_as_before(pair):
    """A producer on CUDA marks its reference `memory: cuda`; a CPU consumer allocates host memory
    and gets the same tensor (here the producer really holds host bytes: no CUDA on this machine)."""
    producer, consumer = pair
    t = torch.randn(BIG // 4)
    msg = await producer.put(TensorKey("r1", "thinker", 0, "hidden"), t, transport="ucx")
    msg.device, msg.ref.memory = "cuda", "cuda"
    got = await consumer.get(msg)
    assert got.device.type == "cpu" and torch.equal(got, t)
    assert consumer.path_of(msg) == "device-to-host"


def path_count(registry, edge, path):
    return registry.get_sample_value("omnistage_transfer_path_tensors_total", {"edge": edge, "path": path}) or 0


async def test_path_metric_per_edge_over_shared_memory_and_ucx(pair):
    producer, consumer = pair
    registry = CollectorRegistry()
    metrics = TransferMetrics(registry)
    sender = ChunkSender(producer, budget_bytes=8 * BIG, metrics=metrics)
    receiver = ChunkReceiver(consumer, metrics=metrics)
    for chunk_id, transport in enumerate(("shm", "ucx", "inline")):
        tensors = {"hidden": torch.full((BIG // 4,), float(chunk_id)), "codes": torch.arange(BIG // 8)}
        msgs = await sender.put_chunk("r1", chunk_id, tensors, consumer="talker", transport=transport)
        got = await receiver.fetch(stage_pb2.Chunk(stage="thinker", chunk_id=chunk_id, tensors=msgs))
        assert got.paths == {"hidden": "host", "codes": "host"} and got.path == "host"
        assert torch.equal(got.tensors["hidden"], tensors["hidden"])
    assert path_count(registry, "thinker->talker", "host") == 6
    assert producer.held_bytes == 0
    await sender.close()


@needs_cuda
async def test_cuda_to_cuda_over_ucx_in_one_process():
    producer = await make_connector("thinker", ("shm", "ucx"), host_id="h", device="cuda")
    consumer = await make_connector("talker", ("shm", "ucx"), host_id="h", device="cuda")
    try:
        assert producer.ucx_device_memory, "UCX here does not carry CUDA memory (see the connector's log line)"
        t = torch.randn(1 << 20, device="cuda")
        msg = await producer.put(TensorKey("r1", "thinker", 0, "hidden"), t, consumer_host="h",
                                 consumer_device="cuda")
        assert msg.ref.backend == "ucx" and msg.ref.memory == "cuda" and msg.device == "cuda"  # auto: not shm
        got = await consumer.get(msg)
        assert got.is_cuda and torch.equal(got, t)
        assert consumer.path_of(msg) == "cuda-ipc"
        staged = await producer.put(TensorKey("r1", "thinker", 0, "codes"), t, transport="shm")
        assert staged.ref.memory == "host" and consumer.path_of(staged) == "host-staged"
        assert torch.equal(await consumer.get(staged), t)
    finally:
        await consumer.close()
        await producer.close()


@needs_cuda
async def test_cuda_to_cuda_over_ucx_between_processes():
    peer = PeerProcess("thinker", "ucx", host_id="h", device="cuda")
    consumer = await make_connector("talker", ("ucx",), host_id="h", device="cuda")
    try:
        ready = await peer.start()
        assert ready["ucx_device_memory"]
        put = await peer.call(op="put", key=["r1", "thinker", 0, "hidden"], dtype="bfloat16", shape=[4, 1 << 18],
                              transport="ucx")
        msg = decode(put["tensor"])
        assert msg.ref.memory == "cuda"
        got = await consumer.get(msg)
        assert got.is_cuda and got.dtype == torch.bfloat16
        assert digest(got) == put["sha256"]
        assert consumer.path_of(msg) == "cuda-ipc"
    finally:
        await consumer.close()
        await peer.close()
