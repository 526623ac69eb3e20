"""The webhook's serving certificate is reloaded in place (webhook_tls.py): kopf's own WebhookServer, serving
on 127.0.0.1, presents the renewed certificate to a new TLS connection once the files change, without the
listening socket closing; a half-written pair keeps the old one."""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from omnistage import tls
from omnistage_operator.webhook_tls import ReloadingWebhookServer, ServingCertificate

from ..polling import wait_until

HOST = "omnistage-webhook.omnistage-system.svc"
IDENTITY = tls.identity("omnistage-system", "webhook", tls.ORCHESTRATOR_ROLE)   # any leaf tls.issue makes


def issue(ca, folder: Path) -> bytes:
    cert, key = tls.issue(ca[0], ca[1], IDENTITY, dns_names=[HOST])
    # As the kubelet does for a Secret volume: new files, then one rename makes them current.
    tmp = folder / ".new"
    tmp.mkdir(exist_ok=True)
    (tmp / "tls.crt").write_bytes(cert)
    (tmp / "tls.key").write_bytes(key)
    for name in ("tls.crt", "tls.key"):
        os.replace(tmp / name, folder / name)
    return cert


async def served_certificate(port: int, ca_pem: bytes) -> bytes:
    """The certificate a new TLS connection to the server sees (verified against the CA, for HOST)."""
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=HOST)
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    await writer.wait_closed()
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


@pytest.fixture
def ca():
    return tls.new_ca("webhook test CA")


async def started(folder):
    """kopf's webhook server on a free port with the certificate in `folder`: (serving, configs, its URL)."""
    serving = ServingCertificate(folder / "tls.crt", folder / "tls.key")
    server = ReloadingWebhookServer(serving=serving, addr="127.0.0.1", host=HOST)

    async def review(request, **_):
        return {}

    configs = server(review)
    return serving, configs, (await configs.__anext__())["url"]  # kopf's site is up; the URL names the port


def test_a_new_connection_sees_the_renewed_certificate(tmp_path, ca):
    first = issue(ca, tmp_path)

    async def scenario():
        serving, configs, url = await started(tmp_path)
        port = urlsplit(url).port
        assert url.startswith(f"https://{HOST}:")
        assert await served_certificate(port, ca[0]) == first
        assert not serving.reload_if_changed()         # nothing changed, nothing loaded

        second = issue(ca, tmp_path)
        assert second != first
        assert serving.reload_if_changed()
        assert await served_certificate(port, ca[0]) == second   # same socket, new chain

        # A certificate without its key (written one after the other): the old chain stays.
        other_cert, _ = tls.issue(ca[0], ca[1], IDENTITY, dns_names=[HOST])
        (tmp_path / "tls.crt").write_bytes(other_cert)
        with pytest.raises(ssl.SSLError):
            serving.reload_if_changed()
        assert await served_certificate(port, ca[0]) == second
        await configs.aclose()

    asyncio.run(scenario())


def test_follow_reloads_on_its_own(tmp_path, ca):
    issue(ca, tmp_path)

    async def scenario():
        serving, configs, url = await started(tmp_path)
        port = urlsplit(url).port
        follower = asyncio.create_task(serving.follow(0.01))
        second = issue(ca, tmp_path)

        async def renewed():
            return await served_certificate(port, ca[0]) == second

        await wait_until(renewed, 10, what="the renewed certificate served")
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await configs.aclose()

    asyncio.run(scenario())


def test_managed_configuration_gets_the_certificate_as_its_ca_bundle(tmp_path, ca):
    cert = issue(ca, tmp_path)
    serving = ServingCertificate(tmp_path / "tls.crt", tmp_path / "tls.key")
    cadata, context = ReloadingWebhookServer(serving=serving)._build_ssl()
    assert cadata == cert and context is serving.context
    assert ReloadingWebhookServer(serving=serving, cadata=ca[0])._build_ssl()[0] == ca[0]


def test_missing_files_fail_at_start(tmp_path):
    with pytest.raises(FileNotFoundError, match="webhook certificate"):
        ServingCertificate(tmp_path / "tls.crt", tmp_path / "tls.key")
