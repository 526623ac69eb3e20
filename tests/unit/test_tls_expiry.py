"""`omnistage_tls_certificate_expiry_timestamp_seconds`: a leaf's notAfter as its file holds it at each scrape."""

from __future__ import annotations

import math

from cryptography import x509

from omnistage import tls
from omnistage.tls_expiry import CertificateMetrics

EXPIRY = "omnistage_tls_certificate_expiry_timestamp_seconds"


def not_after(cert_pem: bytes) -> float:
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc.timestamp()


def test_the_gauge_follows_the_leaf_in_its_file(tmp_path):
    ca, ca_key = tls.new_ca()
    uri = tls.identity("ns", "p", tls.stage_role("talker"))
    cert, key = tls.issue(ca, ca_key, uri, days=90)
    files = tls.write_dir(tmp_path, ca, cert, key)
    m = CertificateMetrics()
    m.follow("pipeline", files)

    def value() -> float:
        return m.registry.get_sample_value(EXPIRY, {"certificate": "pipeline"})

    assert value() == not_after(cert)
    renewed, key = tls.issue(ca, ca_key, uri, days=10)   # rotated in place, as the operator's Secret update does
    tls.write_dir(tmp_path, ca, renewed, key)
    assert value() == not_after(renewed) < not_after(cert)
    files.cert.unlink()   # mid-rotation: no value rather than an old one
    assert math.isnan(value())
