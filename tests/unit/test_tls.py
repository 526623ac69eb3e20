"""Identities, issuing and reading certificates (omnistage/tls.py), and who a stage serves
(omnistage/tls_grpc.py's StageAuthorization.refusal): pure, no server."""

from __future__ import annotations

import datetime as dt
import os
import stat

import pytest
from cryptography import x509

from omnistage import tls
from omnistage.tls_grpc import NO_IDENTITY, StageAuthorization, client_credentials

NS, PIPELINE = "team-a", "omni"
STAGE_METHODS = ["/omnistage.v1.StageService/Process", "/omnistage.v1.StageService/Release",
                 "/omnistage.v1.StageService/GetLoad"]


@pytest.fixture(scope="module")
def ca():
    return tls.new_ca()


def test_identities_and_their_peer_names():
    orc = tls.identity(NS, PIPELINE, tls.ORCHESTRATOR_ROLE)
    thinker = tls.identity(NS, PIPELINE, tls.stage_role("thinker"))
    assert orc == "omnistage://team-a/omni/orchestrator"
    assert thinker == "omnistage://team-a/omni/stage/thinker"
    assert tls.parse_identity(orc) == tls.Identity(NS, PIPELINE, "orchestrator")
    assert tls.parse_identity(thinker) == tls.Identity(NS, PIPELINE, "stage/thinker")
    assert tls.parse_identity(thinker).uri == thinker
    assert tls.peer_name(orc) == "orchestrator.omni.team-a.omnistage.internal"
    assert tls.peer_name(thinker) == "thinker.stage.omni.team-a.omnistage.internal"


@pytest.mark.parametrize("uri", ["spiffe://team-a/omni/orchestrator", "omnistage://team-a/omni",
                                 "omnistage://team-a/omni/stage/", "omnistage://team-a/omni/stage/a/b",
                                 "omnistage:///omni/orchestrator", "omnistage://team-a//orchestrator",
                                 "omnistage://team-a/omni/admin", ""])
def test_anything_else_is_no_identity(uri):
    assert tls.parse_identity(uri) is None


@pytest.mark.parametrize("args, message", [
    (("", PIPELINE, "orchestrator"), "namespace ''"),
    ((NS, "a/b", "orchestrator"), "pipeline 'a/b'"),
    ((NS, PIPELINE, "admin"), "role 'admin'"),
    ((NS, PIPELINE, "stage/"), "role 'stage/'"),
    ((NS, PIPELINE, "stage/a/b"), "role 'stage/a/b'"),
])
def test_bad_identity_parts_are_named(args, message):
    with pytest.raises(tls.TlsError, match=message):
        tls.identity(*args)


def test_peer_name_of_a_foreign_uri_says_so():
    with pytest.raises(tls.TlsError, match="'https://x': not an omnistage identity"):
        tls.peer_name("https://x")


def test_issued_leaf_carries_its_identity_and_peer_name_and_is_signed_by_the_ca(ca):
    uri = tls.identity(NS, PIPELINE, tls.stage_role("llm"))
    cert_pem, key_pem = tls.issue(*ca, uri, dns_names=["llm.example"], ip_addresses=["10.0.0.7"])
    cert = x509.load_pem_x509_certificate(cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [uri]
    assert sans.get_values_for_type(x509.DNSName) == [tls.peer_name(uri), "llm.example"]
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca[0]))
    assert tls.uri_of(cert_pem) == uri
    assert b"PRIVATE KEY" in key_pem
    assert not tls.needs_renewal(cert_pem, ca[0])


def test_renewal_when_near_the_end_unreadable_or_from_another_ca(ca):
    uri = tls.identity(NS, PIPELINE, tls.ORCHESTRATOR_ROLE)
    cert, _ = tls.issue(*ca, uri, days=10)
    assert tls.needs_renewal(cert, ca[0])  # 10 days left, renewed 30 before
    fresh, _ = tls.issue(*ca, uri)
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=tls.LEAF_DAYS - tls.RENEW_BEFORE_DAYS + 1)
    assert tls.needs_renewal(fresh, ca[0], now=later) and not tls.needs_renewal(fresh, ca[0])
    other_ca = tls.new_ca()
    assert tls.needs_renewal(fresh, other_ca[0])
    assert tls.needs_renewal(b"not a certificate", ca[0])


@pytest.mark.parametrize("bad, message", [
    ("uri", "identity 'https://x': not an omnistage identity"),
    ("key", "CA certificate and key do not match"),
    ("pem", "CA certificate or key: not PEM"),
    ("ip", "ip_addresses: "),
])
def test_bad_issue_input_names_the_problem(ca, bad, message):
    uri = tls.identity(NS, PIPELINE, tls.ORCHESTRATOR_ROLE)
    args = {"ca_cert_pem": ca[0], "ca_key_pem": ca[1], "uri": uri}
    if bad == "uri":
        args["uri"] = "https://x"
    elif bad == "key":
        args["ca_key_pem"] = tls.new_ca()[1]
    elif bad == "pem":
        args["ca_cert_pem"] = b"garbage"
    else:
        args["ip_addresses"] = ["not-an-ip"]
    with pytest.raises(tls.TlsError, match=message):
        tls.issue(**args)


def test_uri_of_is_none_without_exactly_one_omnistage_uri(ca):
    assert tls.uri_of(ca[0]) is None  # a CA: no SAN at all
    assert tls.uri_of(b"garbage") is None


def test_folder_layout_private_key_and_stamp(ca, tmp_path):
    uri = tls.identity(NS, PIPELINE, tls.stage_role("llm"))
    cert, key = tls.issue(*ca, uri)
    files = tls.write_dir(tmp_path / "tls", ca[0], cert, key)
    assert sorted(p.name for p in files.folder.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert stat.S_IMODE(os.stat(files.key).st_mode) == 0o600
    assert files.read() == (ca[0], cert, key) and files.read_leaf() == (cert, key)
    before = files.stamp()
    assert files.stamp() == before
    cert2, key2 = tls.issue(*ca, uri)
    tls.write_dir(files.folder, ca[0], cert2, key2)
    assert files.stamp() != before


def test_a_missing_file_is_named(tmp_path):
    files = tls.TlsFiles(tmp_path)
    with pytest.raises(tls.TlsError, match=r"ca\.crt: cannot read"):
        files.read()
    with pytest.raises(tls.TlsError, match=r"tls\.crt: cannot read"):
        files.read_leaf()
    assert files.stamp() == (None, None, None)


def test_https_form_of_a_url():
    assert tls.https("http://127.0.0.1:8000/v1") == "https://127.0.0.1:8000/v1"


# ----------------------------------------------------------------- who a stage serves
def who(role: str, ns: str = NS, pipeline: str = PIPELINE) -> tls.Identity:
    return tls.Identity(ns, pipeline, role)


@pytest.mark.parametrize("caller, allowed", [
    (who("orchestrator"), True),
    (who("stage/thinker"), False),          # a stage of the same pipeline: stages never call each other
    (who("stage/llm"), False),
    (who("orchestrator", pipeline="other"), False),
    (who("stage/thinker", ns="team-b"), False),
    (None, False),                           # a certificate of the CA without an omnistage identity
])
def test_stage_serves_only_its_own_pipeline(caller, allowed):
    auth = StageAuthorization(tls.identity(NS, PIPELINE, tls.stage_role("llm")), STAGE_METHODS)
    for method in STAGE_METHODS:
        why = auth.refusal(caller, method)
        if allowed:
            assert why is None
        else:
            assert why.startswith(f"{caller.uri if caller else NO_IDENTITY} may not call {method}")
    assert auth.refusal(caller, "/grpc.health.v1.Health/Check") is None  # any holder of a CA certificate


def test_authorization_needs_an_omnistage_identity_of_its_own(tmp_path, ca):
    with pytest.raises(tls.TlsError, match="not an omnistage identity"):
        StageAuthorization("https://x", STAGE_METHODS)
    files = tls.write_dir(tmp_path, ca[0], ca[0], ca[1])  # the CA as leaf: no URI SAN
    with pytest.raises(tls.TlsError, match=r"tls\.crt: carries no omnistage identity"):
        StageAuthorization.for_stage(files, "omnistage.v1.StageService", ["Process"])


def test_client_ca_errors_name_the_file(tmp_path):
    with pytest.raises(tls.TlsError, match="missing.pem: cannot read the CA certificate"):
        client_credentials(tmp_path / "missing.pem")
    (tmp_path / "x.pem").write_text("hello")
    with pytest.raises(tls.TlsError, match="x.pem: not a PEM certificate"):
        client_credentials(tmp_path / "x.pem")
