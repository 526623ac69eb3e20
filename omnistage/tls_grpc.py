"""gRPC over the pipeline's certificates (omnistage/tls.py): server and channel credentials that follow the
files as they are rotated, and the stage's check of who calls it.

- Between the pipeline's processes (mutual TLS): a server requires a client certificate from the CA in its
  ca.crt; a channel presents the process's own leaf and checks the server by the DNS name every leaf for
  the expected identity carries (`tls.peer_name`), since replicas are dialed by IP.
- Client-facing (server-side TLS only): the orchestrator's gRPC port with a tls.crt and tls.key, no client
  certificate asked for.
- Rotation: server credentials are grpc's dynamic ones: each new connection's handshake asks a fetcher,
  which re-reads the folder when its stamp changed. A channel's credentials are fixed when it is made, so
  its owner makes a new channel when `ChannelTls.refresh()` says the files changed (see Router.renew_channels).
- Authorization: `StageAuthorization`, a server interceptor. The handshake has already proven the caller
  holds a leaf of the pipeline's CA; the interceptor lets `Process`, `Release` and `GetLoad` through only
  when that leaf names the orchestrator or a stage of the stage's own namespace and pipeline.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from pathlib import Path
from typing import Awaitable, Callable, Iterable

import grpc

from omnistage import tls

log = logging.getLogger("omnistage.tls")

# The auth-context keys grpc (1.60 onwards) fills from the peer's verified certificate: `peer_uri` holds its
# URI SANs alone; `x509_subject_alternative_name` every SAN (the fallback where peer_uri is absent).
AUTH_URI_KEY = "peer_uri"
AUTH_SAN_KEY = "x509_subject_alternative_name"
TARGET_NAME_OVERRIDE = "grpc.ssl_target_name_override"
RELOAD_INTERVAL_S = 5.0  # how often a process looks whether its certificate files were rotated
NO_IDENTITY = "no omnistage identity"


# ------------------------------------------------------------------ servers
def server_credentials(files: tls.TlsFiles, require_client_cert: bool = True) -> grpc.ServerCredentials:
    """Credentials for a server port that re-read `files` when they change, without a restart: the next
    handshake serves the new leaf (and trusts the new ca.crt). With `require_client_cert` (mutual TLS)
    a caller must present a leaf signed by ca.crt; without it (client-facing) only tls.crt and tls.key
    are needed and ca.crt is not read."""
    read = files.read if require_client_cert else (lambda: (None, *files.read_leaf()))
    lock = threading.Lock()  # the fetcher runs on grpc's threads, one handshake each
    state = {"stamp": files.stamp()}

    def config() -> grpc.ServerCertificateConfiguration:
        ca, cert, key = read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        with lock:
            stamp = files.stamp()
            if stamp == state["stamp"]:
                return None  # unchanged: grpc keeps the configuration it has
            try:
                new = config()
            except tls.TlsError as e:  # mid-rotation (a file missing for a moment): keep serving the old one
                log.warning("TLS files in %s not reloaded: %s", files.folder, e)
                return None
            state["stamp"] = stamp
            log.info("TLS files in %s reloaded", files.folder)
            return new

    return grpc.dynamic_ssl_server_credentials(config(), fetch, require_client_authentication=require_client_cert)


class StageAuthorization(grpc.aio.ServerInterceptor):
    """Serves the guarded methods only to the pipeline's own peers: the caller's certificate must name the
    orchestrator or a stage of the same namespace and pipeline as `own` (the stage's own identity). Anything
    else gets PERMISSION_DENIED naming the caller's identity and the method. Other methods (health,
    reflection) pass: the handshake already required a certificate from the pipeline's CA."""

    def __init__(self, own: str, guarded: Iterable[str]):
        me = tls.parse_identity(own)
        if me is None:
            raise tls.TlsError(f"identity {own!r}: not an omnistage identity")
        self.own = me
        self.guarded = frozenset(guarded)
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    @classmethod
    def for_stage(cls, files: tls.TlsFiles, service: str, methods: Iterable[str]) -> "StageAuthorization":
        """From the stage's own tls.crt; `methods` of gRPC `service` are the guarded ones."""
        _, cert, _ = files.read()
        own = tls.uri_of(cert)
        if own is None:
            raise tls.TlsError(f"{files.cert}: carries no omnistage identity (one URI SAN, see tls.identity)")
        return cls(own, [f"/{service}/{m}" for m in methods])

    def refusal(self, caller: tls.Identity | None, method: str) -> str | None:
        """Why `caller` may not call `method`, or None when it may."""
        if method not in self.guarded:
            return None
        # Only the orchestrator calls a stage over gRPC (stages hand each other tensors over the data plane):
        # a stage of the pipeline, even one running untrusted model code, may not send work to or Release
        # requests on another.
        if caller is not None and caller.namespace == self.own.namespace and caller.pipeline == self.own.pipeline \
                and caller.role == tls.ORCHESTRATOR_ROLE:
            return None
        who = caller.uri if caller is not None else NO_IDENTITY
        return f"{who} may not call {method}: only the orchestrator of {self.own.namespace}/{self.own.pipeline} may"

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method not in self.guarded:
            return handler
        guarded = self._handlers.get(details.method)
        if guarded is None:  # once per method: its handler is the same for every call
            method = details.method
            guarded = self._handlers[method] = _guarded(
                handler, lambda context: self.refusal(caller_identity(context), method))
        return guarded


def caller_identity(context) -> tls.Identity | None:
    """The omnistage identity of the verified certificate the caller presented, or None (no certificate,
    none or several omnistage URIs)."""
    auth = context.auth_context() or {}
    values = auth.get(AUTH_URI_KEY) or auth.get(AUTH_SAN_KEY) or []
    found = {i for i in (tls.parse_identity(v.decode(errors="replace")) for v in values) if i is not None}
    return found.pop() if len(found) == 1 else None


def _guarded(handler: grpc.RpcMethodHandler, refusal: Callable[[object], str | None]) -> grpc.RpcMethodHandler:
    """The same method handler, refusing (PERMISSION_DENIED) before the servicer runs when `refusal` says so."""
    streaming_in = handler.request_streaming
    inner = (handler.stream_stream or handler.stream_unary) if streaming_in else \
        (handler.unary_unary or handler.unary_stream)

    async def refuse(request, context) -> None:
        why = refusal(context)
        if why is None:
            return
        if streaming_in:
            # Read the first message before refusing: a status sent while the client is still writing
            # reaches some clients as INTERNAL instead (as StageServicer.Process notes).
            await anext(aiter(request), None)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    if inspect.isasyncgenfunction(inner):
        async def behaviour(request, context):
            await refuse(request, context)
            async for out in inner(request, context):
                yield out
    else:
        async def behaviour(request, context):
            await refuse(request, context)
            return await inner(request, context)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(streaming_in, handler.response_streaming)](
        behaviour, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)


# ------------------------------------------------------------------ channels
class ChannelTls:
    """What a process needs to dial the pipeline's peers over mutual TLS: its own leaf as client certificate,
    the CA to check them by, and the name each peer must prove (`options(stage)`). `refresh()` re-reads the
    files after a rotation; channels made before it keep the old certificate until their owner replaces them."""

    def __init__(self, files: tls.TlsFiles):
        self.files = files
        self._stamp = None
        self.refresh()

    def refresh(self) -> bool:
        """Re-read the files when they changed since last time; True when they did (and were read whole)."""
        stamp = self.files.stamp()
        if stamp == self._stamp:
            return False
        ca, cert, key = self.files.read()
        own = tls.parse_identity(tls.uri_of(cert) or "")
        if own is None:
            raise tls.TlsError(f"{self.files.cert}: carries no omnistage identity (one URI SAN, see tls.identity)")
        self.own = own
        self.credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        self._stamp = stamp
        return True

    def stage_identity(self, stage: str) -> str:
        """The identity a replica of `stage` of this process's own pipeline must prove."""
        return tls.identity(self.own.namespace, self.own.pipeline, tls.stage_role(stage))

    def options(self, stage: str) -> list[tuple[str, str]]:
        """Channel options that make the handshake check the server is a replica of `stage`."""
        return target_options(self.stage_identity(stage))


def target_options(server_identity: str) -> list[tuple[str, str]]:
    """The channel option that makes the handshake check the server's certificate names `server_identity`."""
    return [(TARGET_NAME_OVERRIDE, tls.peer_name(server_identity))]


def client_credentials(ca: str | Path | bytes) -> grpc.ChannelCredentials:
    """Server-side TLS for a client of the orchestrator: `ca` (a PEM file, or its bytes) signs its certificate."""
    if isinstance(ca, (bytes, bytearray)):
        pem = bytes(ca)
    else:
        try:
            pem = Path(ca).read_bytes()
        except OSError as e:
            raise tls.TlsError(f"{ca}: cannot read the CA certificate ({e.strerror or e})") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise tls.TlsError(f"{ca if not isinstance(ca, (bytes, bytearray)) else 'tls_ca'}: not a PEM certificate")
    return grpc.ssl_channel_credentials(root_certificates=pem)


async def watch(refresh: Callable[[], None], interval: float = RELOAD_INTERVAL_S) -> None:
    """Call `refresh` every `interval` seconds until cancelled; a failure is logged, the watch goes on (a
    rotation caught half-written is read whole next time)."""
    while True:
        await asyncio.sleep(interval)
        try:
            refresh()
        except tls.TlsError as e:
            log.warning("TLS files not reloaded: %s", e)
