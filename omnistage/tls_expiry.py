"""When the TLS certificates a process serves with expire, as a Prometheus gauge read from their files at each
scrape (a rotated certificate shows at once): the chart's OmnistageCertificateExpiresSoon alert reads it."""

from __future__ import annotations

import math

from cryptography import x509
from prometheus_client import CollectorRegistry, Gauge

from omnistage.tls import TlsFiles


class CertificateMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.expiry = Gauge("omnistage_tls_certificate_expiry_timestamp_seconds", "When a TLS certificate the "
                            "process serves with expires (its notAfter, Unix time), by certificate (pipeline: the "
                            "mutual TLS leaf; client: the orchestrator's client-facing one)", ["certificate"],
                            registry=self.registry)

    def follow(self, certificate: str, files: TlsFiles) -> None:
        """Report `files`' leaf under `certificate`, as its file holds it when scraped."""
        self.expiry.labels(certificate).set_function(lambda: not_after(files))


def not_after(files: TlsFiles) -> float:
    try:
        return x509.load_pem_x509_certificate(files.cert.read_bytes()).not_valid_after_utc.timestamp()
    except (OSError, ValueError):  # mid-rotation: the file missing or half-written for a moment
        return math.nan
