"""The UCX data plane against a hostile peer on 127.0.0.1 (docs/security.md): forged replies flooded
at guessed tags change no get, a listener serves only its advertised address and a bounded number of
consumers, a request costs the producer a bounded number of messages, a short or forged reply is
refused, a cancelled get frees what it posted; and a fuzz of requests never breaks the producer."""

from __future__ import annotations

import asyncio
import os
import secrets as random_bytes
import signal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("UCX_TLS", "tcp")  # before ucxx loads; peer processes inherit it
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from omnistage.connector import ConnectorError, TensorKey, make_connector, ucx
from omnistage.connector.connector import Connector
from omnistage.connector.wire import NOT_FOUND, OK
from omnistage.v1 import tensor_pb2

from ..connector_peer import PeerProcess, decode
from ..ucx_hostile_peer import HostilePeer, HostileProducer, forged_header

KIB = 1 << 10
SAFETY_S = 60.0  # generous bounds on waits for something that must happen


def _store(conn: Connector) -> ucx.UcxStore:
    store = conn.stores["ucx"]
    assert isinstance(store, ucx.UcxStore)
    return store


def _posted(store: ucx.UcxStore) -> int:
    """UCX requests a store still has posted (each keeps its buffer alive)."""
    workers = [getattr(store, "_worker", None), getattr(store, "_client", None)]
    return sum(len(w._pending) for w in workers if w is not None)


async def _until(condition, what: str) -> None:
    async with asyncio.timeout(SAFETY_S):
        while not condition():
            await asyncio.sleep(0.01)


async def test_forged_replies_flooded_at_guessed_tags_neither_corrupt_nor_fail_real_gets():
    """A peer connected to the consumer's own listener floods NOT_FOUND and OK headers (with payloads)
    at every tag a get could use, and at random ones, while the consumer runs its gets."""
    producer = await make_connector("thinker", ("ucx",), host_id="h")
    consumer = await make_connector("talker", ("ucx",), host_id="h")
    hostile = HostilePeer()
    requests, size = 24, 4 * KIB
    try:
        tensors = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
                   for i in range(requests)]
        refs = [await producer.put(TensorKey("r", "thinker", i, "x"), t, transport="ucx")
                for i, t in enumerate(tensors)]
        assert await hostile.connect(consumer.ucx_address)
        stop = asyncio.Event()

        async def flood() -> None:
            forged_payload = bytes([0xAB]) * size
            while not stop.is_set():
                sends = []
                for i in range(requests + 2):  # tags a get could use: sequential from 1, one fragment each
                    header = forged_header(OK, size) if i % 2 else forged_header(NOT_FOUND)
                    sends += [hostile.send(header, 2 * i + 1), hostile.send(forged_payload, 2 * i + 2)]
                sends += [hostile.send(forged_header(NOT_FOUND), random_bytes.randbits(64)) for _ in range(16)]
                await asyncio.gather(*sends, return_exceptions=True)

        flooding = asyncio.create_task(flood())
        corrupted = failed = 0
        try:
            await asyncio.sleep(0)  # the first round goes out before the first get
            for ref, tensor in zip(refs, tensors):
                try:
                    got = await consumer.get(ref)
                except Exception:  # noqa: BLE001 - counted: a get the flood made fail
                    failed += 1
                else:
                    corrupted += not torch.equal(got, tensor)
        finally:
            stop.set()
            await flooding
        assert hostile.messages > 2 * requests
        assert (corrupted, failed) == (0, 0)
        # the flood reached the consumer's listener, which expects no tagged message: nothing piles up there
        await _until(lambda: _store(consumer).discarded_messages == hostile.messages, "the flood was discarded")
    finally:
        await hostile.close()
        await consumer.close()
        await producer.close()


async def test_the_listener_refuses_endpoints_that_reach_it_at_another_address():
    """Advertised at 127.0.0.2, reached at 127.0.0.1: closed at accept, no hello, counted."""
    store = ucx.UcxStore("h", lambda: 0.0, host="127.0.0.2")
    await store.start()
    hostile = HostilePeer()
    try:
        port = store.address.rpartition(":")[2]
        hello = hostile.dial(f"127.0.0.1:{port}")
        await _until(lambda: store.refused_endpoints == 1, "the endpoint was refused")
        assert len(store._served) == 0 and not hostile.greeted(hello)
    finally:
        await hostile.close()
        await store.close()


async def test_without_a_key_the_store_refuses_to_listen_beyond_loopback():
    store = ucx.UcxStore("h", lambda: 0.0, host="10.1.2.3")
    with pytest.raises(ConnectorError, match="data-plane key"):
        await store.start()  # refused before anything is bound


async def test_a_request_for_too_many_fragments_gets_one_refusal_message():
    """~65535 fragments asked: the producer answers with the header alone, not one message per fragment."""
    producer = await make_connector("thinker", ("ucx",), host_id="h")
    hostile = HostilePeer()
    try:
        await producer.put(TensorKey("r", "thinker", 0, "x"), torch.zeros(16, dtype=torch.uint8), transport="ucx")
        assert await hostile.connect(producer.ucx_address)
        base, fragment = 1 << 40, 64 * KIB
        await hostile.request(base, fragment, fragment * 65535, TensorKey("r", "thinker", 0, "x").wire)
        header = await hostile.receive(ucx.HEADER_BYTES + 64, base)
        assert header is not None and header[4:6] != bytes(2)  # a refusal status
        # a second request's reply comes after anything the first one still had to send (one endpoint)
        await hostile.request(base * 2, 0, 16, TensorKey("r", "thinker", 0, "x").wire)
        assert await hostile.receive(ucx.HEADER_BYTES + 64, base * 2) is not None
        assert hostile.count_waiting(base, ~((1 << 40) - 1) & ((1 << 64) - 1)) == 0
    finally:
        await hostile.close()
        await producer.close()


async def test_a_producer_serves_at_most_max_consumers_endpoints():
    """Two consumers that authenticated fill the slots: a third endpoint is closed at accept."""
    store = ucx.UcxStore("h", lambda: 0.0, max_consumers=2)
    await store.start()
    peers = [HostilePeer() for _ in range(3)]
    try:
        for i, p in enumerate(peers[:2]):
            assert await p.connect(store.address)
            await p.request((i + 1) << 40, 0, 16, TensorKey("r", "thinker", i, "x").wire)  # a valid request
            assert await p.receive(ucx.REPLY_BYTES, (i + 1) << 40) is not None  # answered: authenticated
        hello = peers[2].dial(store.address)
        await _until(lambda: store.refused_endpoints == 1, "the third endpoint was refused")
        assert len(store._served) == 2 and not peers[2].greeted(hello)
    finally:
        for p in peers:
            await p.close()
        await store.close()


async def test_replies_in_flight_to_one_consumer_are_capped():
    """A consumer that asks and never receives (rendezvous sends wait on it) holds at most
    MAX_REPLIES_PER_PEER replies: the producer stops reading its requests."""
    producer = await make_connector("thinker", ("ucx",), host_id="h")
    store = _store(producer)
    hostile = HostilePeer()
    asked, size = 200, 8 << 20
    try:
        key = TensorKey("r", "thinker", 0, "x")
        await producer.put(key, torch.zeros(size, dtype=torch.uint8), transport="ucx", readers=asked)
        assert await hostile.connect(producer.ucx_address)
        for i in range(asked):
            await hostile.request((i + 1) << 20, 0, size, key.wire)
        cap = getattr(ucx, "MAX_REPLIES_PER_PEER", asked)
        await _until(lambda: store.replies_in_flight >= min(cap, asked), "the producer read the requests")
        for _ in range(200):  # turns of the loop in which more requests could be read
            await asyncio.sleep(0)
        assert store.replies_in_flight == cap < asked
    finally:
        await hostile.close()
        await producer.close()


async def test_a_short_payload_is_refused_not_delivered():
    hostile = HostileProducer("short")
    address = await hostile.start()
    consumer = await make_connector("talker", ("ucx",), host_id="h")
    try:
        ref = tensor_pb2.TensorRef(backend="ucx", address=address, key=TensorKey("r", "thinker", 0, "x").wire,
                                   nbytes=64 * KIB, host_id="h")
        with pytest.raises(ConnectorError, match="bytes"):
            await _store(consumer).get(ref)
    finally:
        await consumer.close()
        await hostile.close()


async def test_a_reply_header_failing_its_mac_is_discarded_and_counted():
    """A producer that knows the tag (it was asked) but not the pipeline's key: its reply never lands."""
    hostile = HostileProducer("forged_mac", secret=b"w" * 32)
    address = await hostile.start()
    consumer = await make_connector("talker", ("ucx",), host_id="h", ucx_key=b"k" * 32)
    store = _store(consumer)
    try:
        ref = tensor_pb2.TensorRef(backend="ucx", address=address, key=TensorKey("r", "thinker", 0, "x").wire,
                                   nbytes=4 * KIB, host_id="h")
        with pytest.raises(ConnectorError, match="authentication"):
            await store.get(ref)
        assert store.forged_replies == 1
        await _until(lambda: not _waiting(store), "the payload sent after the forged header was drained")
    finally:
        await consumer.close()
        await hostile.close()


async def test_a_request_without_the_key_gets_no_reply_and_loses_its_endpoint():
    producer = await make_connector("thinker", ("ucx",), host_id="h", ucx_key=b"k" * 32)
    store = _store(producer)
    hostile = HostilePeer()
    try:
        key = TensorKey("r", "thinker", 0, "x")
        await producer.put(key, torch.zeros(16, dtype=torch.uint8), transport="ucx")
        assert await hostile.connect(producer.ucx_address)
        await hostile.request(1 << 30, 0, 16, key.wire, secret=b"w" * 32)
        await _until(lambda: store.refused_requests == 1 and not store._served, "the endpoint was dropped")
        assert _posted(store) == 0
        assert producer.held_tensors == 1  # nothing was sent or counted as read
    finally:
        await hostile.close()
        await producer.close()


async def test_a_get_cancelled_while_its_reply_is_outstanding_releases_its_receives():
    """The producer answers nothing: the cancelled get's drain gives up after the get timeout and closes the
    endpoint, which frees what the get had posted."""
    producer = PeerProcess("thinker", "ucx", host_id="host-a")
    await producer.start()
    consumer = await make_connector("talker", ("ucx",), host_id="host-a", get_timeout_s=2)
    store = _store(consumer)
    try:
        puts = [await producer.call(op="put", key=["r1", "thinker", i, "x"], dtype="uint8", shape=[1 << 20], seed=i,
                                    transport="ucx") for i in range(2)]
        await consumer.get(decode(puts[0]["tensor"]))  # the endpoint is now cached
        os.kill(producer.proc.pid, signal.SIGSTOP)  # the producer answers nothing
        try:
            get = asyncio.create_task(consumer.get(decode(puts[1]["tensor"])))
            await _until(lambda: _posted(store) > 0, "the get posted its receives")
            get.cancel()
            with pytest.raises(asyncio.CancelledError):
                await get
            await _until(lambda: consumer.endpoints == 0, "the drain closed the endpoint")
            await _until(lambda: _posted(store) == 0, "the cancelled receives were released")
        finally:
            os.kill(producer.proc.pid, signal.SIGCONT)
    finally:
        await consumer.close()
        assert await producer.close() == 0


# ---- fuzz: whatever a peer sends, the producer stays up and bounded ------------------------------

_VALID_KEY = TensorKey("r", "thinker", 0, "x")
_TENSOR = torch.arange(4096, dtype=torch.int32)
_MAX_MESSAGES_PER_REQUEST = 1 + getattr(ucx, "MAX_FRAGMENTS", 1 << 16)

requests_st = st.one_of(
    st.binary(min_size=ucx.REQUEST_BYTES, max_size=ucx.REQUEST_BYTES),  # noise
    st.builds(lambda tag, frag, nbytes, key, op: (tag, frag, nbytes, key, op),  # well-formed, hostile values
              st.integers(0, (1 << 64) - 1), st.sampled_from([0, 1, 4096, 64 * KIB, 1 << 40, (1 << 64) - 1]),
              st.sampled_from([0, 1, _TENSOR.numel() * 4, (1 << 63), (1 << 64) - 1]),
              st.sampled_from([_VALID_KEY.wire, "", "x" * 900, "r|thinker|0|x\0", "é" * 40]),
              st.sampled_from([1, 2, 0, 7])),
)


@pytest.fixture(scope="module")
def fuzz_target():
    loop = asyncio.new_event_loop()
    producer = loop.run_until_complete(make_connector("thinker", ("ucx",), host_id="h"))
    consumer = loop.run_until_complete(make_connector("talker", ("ucx",), host_id="h"))
    loop.run_until_complete(producer.put(_VALID_KEY, _TENSOR, transport="ucx", readers=1 << 30))
    yield loop, producer, consumer
    loop.run_until_complete(consumer.close())
    loop.run_until_complete(producer.close())
    loop.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sent=st.lists(requests_st, min_size=1, max_size=3))
def test_fuzzed_requests_never_break_the_producer_nor_cost_more_than_bounded_replies(fuzz_target, sent):
    loop, producer, consumer = fuzz_target

    async def example() -> None:
        hostile = HostilePeer()
        try:
            assert await hostile.connect(producer.ucx_address)
            for item in sent:
                if isinstance(item, bytes):
                    await hostile.raw_request(item)
                else:
                    tag, frag, nbytes, key, op = item
                    if len(key.encode()) <= ucx.MAX_KEY_BYTES:
                        await hostile.request(tag, frag, nbytes, key, op=op)
            # whatever came back: at most one header and bounded fragments per request
            ref = await producer.put(TensorKey("fuzz", "thinker", 0, "y"), _TENSOR, transport="ucx")
            assert torch.equal(await consumer.get(ref), _TENSOR)  # real traffic unaffected
            assert hostile.count_waiting(0, 0) <= len(sent) * _MAX_MESSAGES_PER_REQUEST
        finally:
            await hostile.close()
        store = _store(producer)
        assert len(store._served) <= store.max_consumers

    loop.run_until_complete(example())


async def test_stores_sharing_the_key_exchange_tensors_and_one_with_another_key_is_refused():
    producer = await make_connector("thinker", ("ucx",), host_id="h", ucx_key=b"k" * 32, fragment_bytes=64 * KIB)
    consumer = await make_connector("talker", ("ucx",), host_id="h", ucx_key=b"k" * 32, fragment_bytes=64 * KIB)
    stranger = await make_connector("talker", ("ucx",), host_id="h", ucx_key=b"w" * 32, get_timeout_s=10)
    try:
        t = torch.arange(100_000, dtype=torch.float32)
        msg = await producer.put(TensorKey("r", "thinker", 0, "x"), t, transport="ucx", readers=2)
        assert torch.equal(await consumer.get(msg), t)  # several fragments, every header checked
        with pytest.raises(ConnectorError):  # its request fails the MAC: no reply, the endpoint closed
            await stranger.get(msg)
        assert _store(producer).refused_requests == 1
        assert producer.held_tensors == 1  # the stranger read nothing
    finally:
        await stranger.close()
        await consumer.close()
        await producer.close()


async def test_stages_read_the_key_their_flag_names_and_fetch_over_authenticated_ucx(tmp_path):
    """`omnistage serve`'s layout: each stage's TLS folder holds the pipeline's key, which its --data-plane-key
    names; two stages' data planes exchange a tensor over UCX with it, and a store without it is refused."""
    from omnistage import tls
    from stage_service.data_plane import DataPlane

    from ..harness import example, pipeline_tls

    def ucx_edges(doc):
        for s in doc["spec"]["topology"]["stages"]:
            for e in s.get("inputs", []):
                e["transport"] = "ucx"

    p = example("qwen3-omni-tiny", ucx_edges)
    ca = tls.new_ca()
    dirs = pipeline_tls(tmp_path, p, ca=ca)
    env = {"OMNISTAGE_TRANSPORTS": "ucx"}
    planes = [DataPlane(p, p.stage(s), env=env, key_file=str(dirs[s].folder / tls.DATA_PLANE_KEY_FILE))
              for s in ("thinker", "talker")]
    stranger = await make_connector("talker", ("ucx",), host_id="h", get_timeout_s=10)
    try:
        for plane in planes:
            assert plane.ucx_key == tls.data_plane_key(ca[1], "test", p.name)
            await plane.start()
        producer, consumer = (plane.connector for plane in planes)
        assert _store(producer).auth.enabled and _store(consumer).auth.enabled
        t = torch.arange(1000, dtype=torch.int64)
        msg = await producer.put(TensorKey("r", "thinker", 0, "x"), t, transport="ucx", readers=2)
        assert torch.equal(await consumer.get(msg), t)
        with pytest.raises(ConnectorError):
            await stranger.get(msg)  # unauthenticated: no reply
        assert _store(producer).refused_requests == 1
    finally:
        await stranger.close()
        for plane in planes:
            await plane.close()


# ---- gets that end early, idle endpoints, IPv6 ---------------------------------------------------

def _waiting(store: ucx.UcxStore) -> bool:
    """Whether a tagged message sits in the consumer worker's queue, arrived and never received."""
    worker = store._client
    assert worker is not None
    worker.worker.progress()
    return bool(worker.worker.tag_probe(worker.api.UCXXTag(0), worker.api.UCXXTagMask(0), remove=False).matched)


async def test_cancelled_gets_under_steady_traffic_leave_the_edge_usable():
    """More than MAX_REPLIES_PER_PEER gets cancelled mid-reply while another get of the edge stays in flight:
    the producer's sends for them complete (drained), its reply slots free, and the next get goes through
    on the same endpoint."""
    producer = await make_connector("thinker", ("ucx",), host_id="h", fragment_bytes=64 * KIB)
    consumer = await make_connector("talker", ("ucx",), host_id="h", fragment_bytes=64 * KIB,
                                    get_timeout_s=SAFETY_S)
    ps, cs = _store(producer), _store(consumer)
    cancelled, size = ucx.MAX_REPLIES_PER_PEER + 6, 2 << 20
    try:
        small = torch.arange(256, dtype=torch.int32)
        await consumer.get(await producer.put(TensorKey("s", "thinker", 0, "x"), small, transport="ucx"))
        peer = next(iter(cs._peers.values()))
        peer.inflight += 1  # another get of this consumer to this producer, in flight throughout
        ref = await producer.put(TensorKey("r", "thinker", 0, "x"), torch.zeros(size, dtype=torch.uint8),
                                 transport="ucx", readers=cancelled)
        gets = [asyncio.create_task(consumer.get(ref)) for _ in range(cancelled)]
        await _until(lambda: ps.replies_in_flight >= ucx.MAX_REPLIES_PER_PEER or all(g.done() for g in gets),
                     "the producer has a full window of replies in flight")
        for g in gets:
            g.cancel()
        await asyncio.gather(*gets, return_exceptions=True)
        await _until(lambda: ps.replies_in_flight == 0, "the cancelled replies were drained")
        ref = await producer.put(TensorKey("s", "thinker", 1, "x"), small, transport="ucx")
        assert torch.equal(await consumer.get(ref), small)
        assert consumer.endpoints == 1 and cs._peers.get(ps.address) is peer  # the shared endpoint stayed
        peer.inflight -= 1
    finally:
        await consumer.close()
        await producer.close()


async def test_fragments_of_a_get_refused_after_its_header_do_not_stay_queued():
    """The header describes another size than the reference: the get fails, and the fragment that arrived
    for it is taken out of the consumer worker's queue."""
    hostile = HostileProducer("wrong_nbytes")
    address = await hostile.start()
    consumer = await make_connector("talker", ("ucx",), host_id="h")
    store = _store(consumer)
    try:
        ref = tensor_pb2.TensorRef(backend="ucx", address=address, key=TensorKey("r", "thinker", 0, "x").wire,
                                   nbytes=4 * KIB, host_id="h")
        with pytest.raises(ConnectorError, match="describes"):
            await store.get(ref)
        await _until(lambda: not _waiting(store), "the fragment was drained")
    finally:
        await consumer.close()
        await hostile.close()


async def test_an_endpoint_that_never_authenticates_is_closed(monkeypatch):
    monkeypatch.setattr(ucx, "FIRST_REQUEST_TIMEOUT_S", 0.5, raising=False)
    store = ucx.UcxStore("h", lambda: 0.0)
    await store.start()
    hostile = HostilePeer()
    try:
        assert await hostile.connect(store.address)
        await _until(lambda: not store._served, "the silent endpoint was closed")
        assert store.evicted_endpoints == 1
    finally:
        await hostile.close()
        await store.close()


async def test_at_the_cap_a_new_consumer_evicts_the_oldest_unauthenticated_endpoint():
    """Idle connections fill every slot: a real consumer still gets served; authenticated ones are kept."""
    producer = ucx.UcxStore("h", lambda: 0.0, max_consumers=2)
    await producer.start()
    consumer = ucx.UcxStore("h", lambda: 0.0)
    await consumer.start()
    idle = [HostilePeer() for _ in range(2)]
    try:
        key = TensorKey("r", "thinker", 0, "x")
        ref = await producer.put(key, torch.arange(64, dtype=torch.int32), readers=2)
        for p in idle:
            assert await p.connect(producer.address)
        assert torch.equal(await consumer.get(ref), torch.arange(64, dtype=torch.int32))
        assert len(producer._served) == 2
        late = HostilePeer()
        idle.append(late)
        assert await late.connect(producer.address)  # evicts the other idle peer, not the consumer
        assert torch.equal(await consumer.get(ref), torch.arange(64, dtype=torch.int32))
        assert (producer.refused_endpoints, producer.evicted_endpoints) == (0, 2)
    finally:
        for p in idle:
            await p.close()
        await consumer.close()
        await producer.close()


async def test_a_store_advertised_at_an_ipv6_address_starts():
    store = ucx.UcxStore("h", lambda: 0.0, host="::1")
    await store.start()
    try:
        assert store.address.startswith("::1:") and store._bind_ip == "::1"
    finally:
        await store.close()


async def test_a_stage_whose_named_key_file_is_missing_refuses_to_start_naming_it(tmp_path, model_dir):
    """A stage process told where its data-plane key is never runs without it (nor with UCX unauthenticated):
    it exits 2 with one line naming the file, before any weights are read."""
    from .test_stage_process import StageProcess

    missing = tmp_path / "nowhere" / "ucx.key"
    stage = StageProcess(tmp_path, model_dir, flags={"data_plane_key": missing})
    try:
        assert await stage.exit_code(60) == 2, stage.output()
        assert f"stage llm: TLS: {missing}: no UCX data-plane key" in stage.output()
    finally:
        stage.kill()
