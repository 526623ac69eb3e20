"""Mutual TLS between a real orchestrator and a real tiny LM stage: a request goes through; a plaintext caller,
a caller with another CA's certificate, and a caller of another pipeline (or without an omnistage identity)
are kept out; rotated certificates are taken up without a restart, by the stage's port and by the
orchestrator's channels."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import ssl

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnistage import tls, tls_grpc
from omnistage.client import AsyncOmniClient
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from orchestrator_service.server import OrchestratorServer

from ..harness import call_stage, header, pipeline_tls, small_lm, start_stage, tls_channel
from ..polling import wait_until

NAMESPACE = "test"
RELOAD_S = 0.05  # the orchestrator looks for rotated files this often here (seconds in production)
STAGE_SERVICE = "/omnistage.v1.StageService/"


LM_LIMITS = {"defaultMaxTokens": 4, "maxTokens": 8}  # short answers


def leaf_without_identity(ca_pem: bytes, ca_key_pem: bytes) -> tuple[bytes, bytes]:
    """A certificate the pipeline's CA signed that names no omnistage identity (a DNS name only): what an
    unrelated workload holding a certificate of the same CA would present."""
    ca = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "intruder")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("intruder.example")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def serial_served(port: int, ca: bytes, server_name: str, client: tls.TlsFiles | None = None) -> int:
    """The serial number of the certificate the gRPC server at `port` presents to a new connection that
    trusts `ca`, checks `server_name` and presents `client`'s leaf (blocking)."""
    ctx = ssl.create_default_context(cadata=ca.decode())
    if client is not None:
        ctx.load_cert_chain(str(client.cert), str(client.key))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_name) as conn:
            return x509.load_der_x509_certificate(conn.getpeercert(binary_form=True)).serial_number


def serial_of(files: tls.TlsFiles) -> int:
    return x509.load_pem_x509_certificate(files.cert.read_bytes()).serial_number


def reissue(ca: tuple[bytes, bytes], files: tls.TlsFiles) -> int:
    """A new leaf for the same identity written over the old one (as a Secret update does); its serial."""
    cert, key = tls.issue(*ca, tls.uri_of(files.cert.read_bytes()))
    tls.write_dir(files.folder, ca[0], cert, key)
    return serial_of(files)


class Rig:
    def __init__(self, pipeline, ca, dirs, stage, orc):
        self.pipeline, self.ca, self.dirs, self.stage, self.orc = pipeline, ca, dirs, stage, orc
        self.stage_identity = tls.identity(NAMESPACE, pipeline.name, tls.stage_role("llm"))

    def caller(self, cert: bytes | None, key: bytes | None, ca: bytes | None = None) -> grpc.aio.Channel:
        return tls_channel(self.stage.port, ca or self.ca[0], cert, key, self.stage_identity)

    def leaf(self, namespace: str, pipeline: str, role: str) -> tuple[bytes, bytes]:
        return tls.issue(*self.ca, tls.identity(namespace, pipeline, role))


@pytest.fixture(scope="module")
async def rig(model_dir, tmp_path_factory):
    pipeline = small_lm(LM_LIMITS)
    ca = tls.new_ca()
    dirs = pipeline_tls(tmp_path_factory.mktemp("tls"), pipeline, NAMESPACE, ca)
    stage = await start_stage(pipeline, "llm", model_dir, tls_dir=str(dirs["llm"].folder))
    orc = OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]}, tls_dir=str(dirs[None].folder),
                             tls_reload_s=RELOAD_S)
    try:
        await orc.start(wait_for_stages=60)
        yield Rig(pipeline, ca, dirs, stage, orc)
    finally:
        await orc.drain()
        orc.close()
        await stage.drain()
        stage.close()


async def generate(orc: OrchestratorServer) -> str:
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        result = await client.generate("Hello there", max_tokens=4, timeout=60)
    assert result.final is not None and result.final.usage.completion_tokens > 0
    return result.text


async def test_a_request_goes_through_orchestrator_and_stage_over_mtls(rig):
    assert await generate(rig.orc)
    replica = rig.orc.router.pools["llm"].replicas[f"127.0.0.1:{rig.stage.port}"]
    assert replica.reachable and not replica.outlier.ejected


async def test_a_plaintext_caller_cannot_reach_the_stage(rig):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rig.stage.port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stage_pb2_grpc.StageServiceStub(ch).GetLoad(stage_pb2.GetLoadRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_caller_without_a_client_certificate_fails_the_handshake(rig):
    async with rig.caller(None, None) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_certificate_from_another_ca_fails_the_handshake(rig):
    other = tls.new_ca()
    # The very identity the stage trusts (its orchestrator), but signed by a CA the stage does not trust.
    cert, key = tls.issue(*other, tls.identity(NAMESPACE, rig.pipeline.name, tls.ORCHESTRATOR_ROLE))
    async with rig.caller(cert, key) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stage_pb2_grpc.StageServiceStub(ch).GetLoad(stage_pb2.GetLoadRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # Nor does a caller that trusts only the other CA accept the stage as server.
    good = rig.dirs[None].read()
    async with rig.caller(good[1], good[2], ca=other[0]) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("caller", ["other pipeline", "other namespace", "no identity"])
async def test_a_valid_certificate_of_someone_else_is_denied_process_release_and_getload(rig, caller):
    if caller == "other pipeline":
        cert, key = rig.leaf(NAMESPACE, "other", tls.ORCHESTRATOR_ROLE)
        name = f"omnistage://{NAMESPACE}/other/orchestrator"
    elif caller == "other namespace":
        cert, key = rig.leaf("elsewhere", rig.pipeline.name, tls.stage_role("llm"))
        name = f"omnistage://elsewhere/{rig.pipeline.name}/stage/llm"
    else:
        cert, key = leaf_without_identity(*rig.ca)
        name = tls_grpc.NO_IDENTITY
    async with rig.caller(cert, key) as ch:
        stub = stage_pb2_grpc.StageServiceStub(ch)
        calls = {"GetLoad": lambda: stub.GetLoad(stage_pb2.GetLoadRequest(), timeout=10),
                 "Release": lambda: stub.Release(stage_pb2.ReleaseRequest(request_id="someone-elses"), timeout=10),
                 "Process": lambda: call_stage(rig.stage.port, header("r-denied"), timeout=10, channel=ch)}
        for method, call in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (method, e.value.details())
            assert e.value.details().startswith(f"{name} may not call {STAGE_SERVICE}{method}")
        # Health answers any holder of a certificate from the pipeline's CA.
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    assert rig.stage.engine.unfinished() == 0


async def test_another_stage_of_the_same_pipeline_may_not_call(rig):
    cert, key = rig.leaf(NAMESPACE, rig.pipeline.name, tls.stage_role("producer"))
    async with rig.caller(cert, key) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stage_pb2_grpc.StageServiceStub(ch).GetLoad(stage_pb2.GetLoadRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert e.value.details().startswith(f"omnistage://{NAMESPACE}/{rig.pipeline.name}/stage/producer may not call")


async def test_the_stage_serves_a_rotated_leaf_to_new_connections_without_restart(rig):
    files, orc_files = rig.dirs["llm"], rig.dirs[None]
    name = tls.peer_name(rig.stage_identity)
    before = serial_of(files)
    assert await asyncio.to_thread(serial_served, rig.stage.port, rig.ca[0], name, orc_files) == before
    after = reissue(rig.ca, files)
    assert after != before
    assert await asyncio.to_thread(serial_served, rig.stage.port, rig.ca[0], name, orc_files) == after
    assert await generate(rig.orc)  # the orchestrator's channel still verifies the stage


async def test_the_orchestrators_channels_present_a_rotated_leaf(rig, tmp_path):
    """A recording StageService (mutual TLS, the same authorization) behind a second orchestrator: the
    serial of the client certificate its GetLoad polls present changes to the rotated leaf's."""
    seen: list[int] = []

    class Recording(stage_pb2_grpc.StageServiceServicer):
        async def GetLoad(self, request, context):
            pem = context.auth_context()["x509_pem_cert"][0]
            seen.append(x509.load_pem_x509_certificate(pem).serial_number)
            return stage_pb2.StageLoad(stage="llm", max_running=1, max_queued=1)

    dirs = pipeline_tls(tmp_path, rig.pipeline, NAMESPACE, rig.ca)
    server = grpc.aio.server(interceptors=[tls_grpc.StageAuthorization.for_stage(
        dirs["llm"], "omnistage.v1.StageService", ["Process", "Release", "GetLoad"])])
    stage_pb2_grpc.add_StageServiceServicer_to_server(Recording(), server)
    port = server.add_secure_port("127.0.0.1:0", tls_grpc.server_credentials(dirs["llm"]))
    await server.start()
    orc = OrchestratorServer(rig.pipeline, {"llm": [f"127.0.0.1:{port}"]}, tls_dir=str(dirs[None].folder),
                             tls_reload_s=RELOAD_S)
    try:
        await orc.start()
        first = serial_of(dirs[None])
        await wait_until(lambda: seen and seen[-1] == first, 30, what="a GetLoad poll with the first leaf")
        rotated = reissue(rig.ca, dirs[None])
        await wait_until(lambda: seen[-1] == rotated, 30, what="a GetLoad poll with the rotated leaf",
                         detail=lambda: seen[-3:])
        assert set(seen) == {first, rotated}
    finally:
        await orc.drain()
        orc.close()
        await server.stop(0)


async def test_the_real_orchestrator_goes_on_after_its_own_leaf_is_rotated(rig):
    channel = rig.orc.router.pools["llm"].replicas[f"127.0.0.1:{rig.stage.port}"].channel
    reissue(rig.ca, rig.dirs[None])
    await wait_until(lambda: rig.orc.router.pools["llm"].replicas[f"127.0.0.1:{rig.stage.port}"].channel
                     is not channel, 30, what="a new channel to the stage")
    assert await generate(rig.orc)


def test_unusable_tls_files_fail_before_anything_binds(tmp_path):
    pipeline = small_lm(LM_LIMITS)
    with pytest.raises(tls.TlsError, match=r"ca\.crt: cannot read"):
        OrchestratorServer(pipeline, {"llm": ["127.0.0.1:1"]}, tls_dir=str(tmp_path))
    with pytest.raises(tls.TlsError, match=r"tls\.crt: cannot read"):
        OrchestratorServer(pipeline, {"llm": ["127.0.0.1:1"]}, client_tls_dir=str(tmp_path))


def https_get(port: int, path: str, ca: bytes) -> tuple[int, int]:
    """(status, serial of the server's certificate) of a GET over HTTPS to 127.0.0.1 trusting `ca` (blocking)."""
    import http.client

    ctx = ssl.create_default_context(cadata=ca.decode())
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
    try:
        conn.request("GET", path)
        status = conn.getresponse().status
        serial = x509.load_der_x509_certificate(conn.sock.getpeercert(binary_form=True)).serial_number
        return status, serial
    finally:
        conn.close()


async def test_client_facing_ports_serve_tls_without_a_client_certificate(rig, tmp_path):
    """The orchestrator's gRPC and HTTP API ports with a client-facing certificate: a client that trusts its
    CA gets through (no client certificate); a plaintext one does not; a rotated certificate is served to
    new connections on both."""
    client_ca = tls.new_ca()
    uri = tls.identity(NAMESPACE, rig.pipeline.name, tls.ORCHESTRATOR_ROLE)  # any name: clients check the IP
    cert, key = tls.issue(*client_ca, uri, ip_addresses=["127.0.0.1"])
    files = tls.write_dir(tmp_path / "client", client_ca[0], cert, key)
    files.ca.unlink()  # the client-facing folder needs no CA
    orc = OrchestratorServer(rig.pipeline, {"llm": [f"127.0.0.1:{rig.stage.port}"]},
                             tls_dir=str(rig.dirs[None].folder), client_tls_dir=str(files.folder), api_port=0,
                             tls_reload_s=RELOAD_S)
    try:
        await orc.start(wait_for_stages=30)
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}", tls_ca=client_ca[0]) as client:
            result = await client.generate("Hello there", max_tokens=4, timeout=60)
        assert result.final is not None
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await plain.generate("Hello", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        status, served = await asyncio.to_thread(https_get, orc.api_port, "/v1/models", client_ca[0])
        assert (status, served) == (200, serial_of(files))

        cert, key = tls.issue(*client_ca, uri, ip_addresses=["127.0.0.1"])
        (files.folder / tls.CERT_FILE).write_bytes(cert)
        (files.folder / tls.KEY_FILE).write_bytes(key)
        rotated = serial_of(files)
        await wait_until(lambda: _serial_is(orc.api_port, client_ca[0], rotated), 30,
                         what="the HTTP API serving the rotated certificate")
        assert await asyncio.to_thread(serial_served, orc.port, client_ca[0], "127.0.0.1") == rotated  # gRPC
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}", tls_ca=client_ca[0]) as client:
            assert (await client.generate("Hello there", max_tokens=4, timeout=60)).final is not None
    finally:
        await orc.drain()
        orc.close()


async def _serial_is(port: int, ca: bytes, serial: int) -> bool:
    return (await asyncio.to_thread(https_get, port, "/v1/models", ca))[1] == serial
