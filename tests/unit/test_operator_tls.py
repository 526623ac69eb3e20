"""The pipelines' mTLS on a cluster: which Secret each pod mounts and with which flags, the leaf Secrets the
operator issues with the chart's CA (and when it issues them again), cert-manager Certificates, the client
TLS Secret, and the settings that turn it on (no cluster; real certificates)."""

from __future__ import annotations

import base64
import copy
import datetime as dt

import pytest
import yaml
from cryptography import x509

from omnistage import tls
from omnistage.contract import launch
from omnistage_operator.builders import build_children, build_tls_secret_meta
from omnistage_operator.certificates import (
    CertificateAuthority,
    build_tls_secret,
    ca_from_secret,
    leaves,
    needs_reissue,
    tls_secret_name,
)
from omnistage_operator.config import ConfigError, IssuerRef, ModelVolume, OperatorConfig, from_env
from omnistage_operator.pipeline_object import parse

from ..conftest import EXAMPLES

BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())
BASE["metadata"]["namespace"] = "team-a"
MODELS = ModelVolume("pvc", "omnistage-models", "/models")
CHART = OperatorConfig(model_volume=MODELS, tls_issuer="chart", tls_ca_secret=("omnistage-system", "ca"))
CERT_MANAGER = OperatorConfig(model_volume=MODELS, tls_issuer="certManager",
                              tls_issuer_ref=IssuerRef("ClusterIssuer", "pipelines-ca"))
OFF = OperatorConfig(model_volume=MODELS)
# Every stage pod, in every TLS mode, mounts the pipeline's UCX data-plane key (test_operator_data_plane_key.py).
DATA_PLANE_KEY = {launch.DATA_PLANE_KEY_MOUNT: "qwen3-omni-tiny-data-plane-key"}


def pipeline(edit=None):
    doc = copy.deepcopy(BASE)
    if edit:
        edit(doc)
    return parse(doc)


def pod_of(deployment):
    return deployment["spec"]["template"]["spec"]


def flags(deployment, parser):
    (c,) = pod_of(deployment)["containers"]
    return parser(env={}).parse_args(c["command"][3:])


def mounts(deployment):
    (c,) = pod_of(deployment)["containers"]
    volumes = {v["name"]: v for v in pod_of(deployment)["volumes"]}
    return {m["mountPath"]: volumes[m["name"]].get("secret", {}).get("secretName") for m in c["volumeMounts"]
            if "secret" in volumes[m["name"]]}


@pytest.mark.parametrize("cfg", [CHART, CERT_MANAGER])
def test_every_pod_mounts_its_own_certificate_and_is_told_where(cfg):
    c = build_children(pipeline(), cfg)
    for stage, sc in c.stages.items():
        assert mounts(sc.deployment) == {launch.TLS_MOUNT: f"qwen3-omni-tiny-tls-{stage}", **DATA_PLANE_KEY}
        assert flags(sc.deployment, launch.stage_parser).tls_dir == launch.TLS_MOUNT
    assert mounts(c.orchestrator_deployment) == {launch.TLS_MOUNT: "qwen3-omni-tiny-tls-orchestrator"}
    args = flags(c.orchestrator_deployment, launch.orchestrator_parser)
    assert args.tls_dir == launch.TLS_MOUNT and args.client_tls_dir is None


def test_without_tls_no_secret_is_mounted_and_no_flag_given():
    c = build_children(pipeline(), OFF)
    for d in [sc.deployment for sc in c.stages.values()] + [c.orchestrator_deployment]:
        assert mounts(d) == ({} if d is c.orchestrator_deployment else DATA_PLANE_KEY)   # the UCX key: every mode
        (container,) = pod_of(d)["containers"]
        assert "--tls-dir" not in container["command"] and "--client-tls-dir" not in container["command"]
    assert c.certificates == ()


def test_rotation_changes_no_pod_template():
    """The pods mount the Secret by name: a reissued certificate changes the Secret, never the Deployment."""
    assert build_children(pipeline(), CHART).all() == build_children(pipeline(), CHART).all()


def with_client_tls(secret):
    return lambda d: d["spec"]["deployment"].setdefault("orchestrator", {}).__setitem__(
        "tls", {"secretName": secret})


@pytest.mark.parametrize("cfg", [CHART, OFF])
def test_client_tls_secret_is_mounted_on_the_orchestrator_only(cfg):
    c = build_children(pipeline(with_client_tls("llm-serving-cert")), cfg)
    got = mounts(c.orchestrator_deployment)
    assert got[launch.CLIENT_TLS_MOUNT] == "llm-serving-cert"
    assert flags(c.orchestrator_deployment, launch.orchestrator_parser).client_tls_dir == launch.CLIENT_TLS_MOUNT
    assert all(launch.CLIENT_TLS_MOUNT not in mounts(sc.deployment) for sc in c.stages.values())
    # it rolls the orchestrator (a new flag and volume), nothing else
    before = build_children(pipeline(), cfg)
    assert before.orchestrator_deployment["spec"]["template"] != c.orchestrator_deployment["spec"]["template"]
    assert all(before.stages[s] == c.stages[s] for s in c.stages)


def test_client_tls_secret_name_is_validated():
    from omnistage.api import SpecError
    with pytest.raises(SpecError, match=r"spec.deployment.orchestrator.tls.secretName"):
        pipeline(with_client_tls("Not_A_Name"))


def test_leaves_name_each_unit_with_its_identity():
    got = {unit: (leaf.secret, leaf.uri) for unit, leaf in leaves(pipeline()).items()}
    assert got == {
        "thinker": ("qwen3-omni-tiny-tls-thinker", "omnistage://team-a/qwen3-omni-tiny/stage/thinker"),
        "talker": ("qwen3-omni-tiny-tls-talker", "omnistage://team-a/qwen3-omni-tiny/stage/talker"),
        "code2wav": ("qwen3-omni-tiny-tls-code2wav", "omnistage://team-a/qwen3-omni-tiny/stage/code2wav"),
        "orchestrator": ("qwen3-omni-tiny-tls-orchestrator", "omnistage://team-a/qwen3-omni-tiny/orchestrator"),
    }
    assert tls_secret_name("p", "orchestrator") == "p-tls-orchestrator"


def test_cert_manager_certificates_one_per_unit():
    c = build_children(pipeline(), CERT_MANAGER)
    certs = {cert["metadata"]["name"]: cert for cert in c.certificates}
    assert set(certs) == {leaf.secret for leaf in leaves(pipeline()).values()}
    talker = certs["qwen3-omni-tiny-tls-talker"]
    assert talker["apiVersion"] == "cert-manager.io/v1" and talker["kind"] == "Certificate"
    assert talker["metadata"]["namespace"] == "team-a"
    assert talker["spec"]["secretName"] == "qwen3-omni-tiny-tls-talker"
    assert talker["spec"]["uris"] == ["omnistage://team-a/qwen3-omni-tiny/stage/talker"]
    assert talker["spec"]["dnsNames"] == [tls.peer_name("omnistage://team-a/qwen3-omni-tiny/stage/talker")]
    assert talker["spec"]["issuerRef"] == {"name": "pipelines-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert set(talker["spec"]["usages"]) >= {"server auth", "client auth"}
    assert all(cert in c.all() for cert in c.certificates)   # owned and pruned like every child


# ------------------------------------------------------------------ issuing with the chart's CA

@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority(*tls.new_ca("test pipelines CA"))


def secret_for(unit: str, ca: CertificateAuthority, p=None) -> dict:
    p = p or pipeline()
    leaf = leaves(p)[unit]
    return build_tls_secret(build_tls_secret_meta(p, leaf), leaf, ca)


def decode(secret: dict) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def test_issued_secret_holds_a_leaf_for_the_identity_signed_by_the_ca(ca):
    s = secret_for("talker", ca)
    assert s["type"] == "kubernetes.io/tls" and s["metadata"]["name"] == "qwen3-omni-tiny-tls-talker"
    assert s["metadata"]["namespace"] == "team-a"
    assert s["metadata"]["labels"]["omnistage.io/pipeline"] == "qwen3-omni-tiny"
    files = decode(s)
    assert set(files) == {tls.CA_FILE, tls.CERT_FILE, tls.KEY_FILE}  # the UCX key: the pipeline's own Secret
    assert files[tls.CA_FILE] == ca.cert_pem
    assert tls.uri_of(files[tls.CERT_FILE]) == "omnistage://team-a/qwen3-omni-tiny/stage/talker"
    x509.load_pem_x509_certificate(files[tls.CERT_FILE]).verify_directly_issued_by(
        x509.load_pem_x509_certificate(ca.cert_pem))
    assert not needs_reissue(s, leaves(pipeline())["talker"], ca)


def test_reissue_when_the_ca_changes_the_identity_differs_or_a_key_is_missing(ca):
    leaf = leaves(pipeline())["talker"]
    s = secret_for("talker", ca)
    other_ca = CertificateAuthority(*tls.new_ca("another CA"))
    assert needs_reissue(s, leaf, other_ca)                         # CA replaced
    assert needs_reissue(secret_for("thinker", ca), leaf, ca)       # another unit's certificate
    broken = copy.deepcopy(s)
    del broken["data"][tls.KEY_FILE]
    assert needs_reissue(broken, leaf, ca)
    assert needs_reissue({"data": None}, leaf, ca)


def test_reissue_when_the_leaf_nears_its_end(ca):
    leaf = leaves(pipeline())["talker"]
    cert, key = tls.issue(ca.cert_pem, ca.key_pem, leaf.uri, days=tls.RENEW_BEFORE_DAYS - 1)
    s = secret_for("talker", ca)
    s["data"][tls.CERT_FILE] = base64.b64encode(cert).decode()
    s["data"][tls.KEY_FILE] = base64.b64encode(key).decode()
    assert needs_reissue(s, leaf, ca)


def test_ca_secret_is_read_from_the_tls_layout(ca):
    secret = {"data": {"tls.crt": base64.b64encode(ca.cert_pem).decode(),
                       "tls.key": base64.b64encode(ca.key_pem).decode()}}
    assert ca_from_secret(secret, "ns/ca") == ca
    with pytest.raises(tls.TlsError, match=r"CA Secret ns/ca: no tls.key"):
        ca_from_secret({"data": {"tls.crt": "eA=="}}, "ns/ca")


def test_a_chart_made_rsa_ca_signs_leaves_too():
    """The chart's genCA makes an RSA CA: the operator signs EC leaves with it."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "helm CA")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pkcs1 = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                              serialization.NoEncryption())   # "RSA PRIVATE KEY", as genCA writes it
    ca = CertificateAuthority(cert.public_bytes(serialization.Encoding.PEM), pkcs1)
    s = secret_for("orchestrator", ca)
    assert not needs_reissue(s, leaves(pipeline())["orchestrator"], ca)


# ------------------------------------------------------------------ settings

def test_tls_settings_from_env():
    assert from_env({}).tls_issuer == "off" and not from_env({}).tls_enabled
    cfg = from_env({"OMNISTAGE_TLS_ISSUER": "chart", "OMNISTAGE_TLS_CA_SECRET": "omnistage-system/pipeline-ca"})
    assert cfg.tls_enabled and cfg.tls_ca_secret == ("omnistage-system", "pipeline-ca")
    cfg = from_env({"OMNISTAGE_TLS_ISSUER": "certManager", "OMNISTAGE_TLS_ISSUER_REF": "Issuer/ca/cert-manager.io"})
    assert cfg.tls_issuer_ref == IssuerRef("Issuer", "ca", "cert-manager.io")
    assert from_env({"OMNISTAGE_TLS_ISSUER": "certManager",
                     "OMNISTAGE_TLS_ISSUER_REF": "ClusterIssuer/ca"}).tls_issuer_ref == IssuerRef("ClusterIssuer", "ca")


@pytest.mark.parametrize("env, words", [
    ({"OMNISTAGE_TLS_ISSUER": "vault"}, "OMNISTAGE_TLS_ISSUER='vault'"),
    ({"OMNISTAGE_TLS_ISSUER": "chart"}, "OMNISTAGE_TLS_CA_SECRET=''"),
    ({"OMNISTAGE_TLS_ISSUER": "chart", "OMNISTAGE_TLS_CA_SECRET": "just-a-name"}, "NAMESPACE/NAME"),
    ({"OMNISTAGE_TLS_ISSUER": "certManager"}, "OMNISTAGE_TLS_ISSUER_REF=''"),
    ({"OMNISTAGE_TLS_ISSUER": "certManager", "OMNISTAGE_TLS_ISSUER_REF": "ClusterIssuer/"}, "KIND/NAME"),
    ({"OMNISTAGE_ORCHESTRATOR_CLIENTS_FROM": "{not json"}, "OMNISTAGE_ORCHESTRATOR_CLIENTS_FROM: not JSON"),
    ({"OMNISTAGE_ORCHESTRATOR_CLIENTS_FROM": '[{}]'}, "NetworkPolicy peers"),
    ({"OMNISTAGE_PEERING": "omnistage"}, "needs POD_ID"),
])
def test_bad_tls_and_policy_settings_name_the_variable(env, words):
    with pytest.raises(ConfigError) as err:
        from_env(env)
    assert words in str(err.value)


def test_peering_and_clients_settings_from_env():
    cfg = from_env({"OMNISTAGE_PEERING": "omnistage", "POD_ID": "omnistage-abc", "OMNISTAGE_WATCH_NAMESPACES": "a, b",
                    "OMNISTAGE_ORCHESTRATOR_CLIENTS_FROM": '[{"ipBlock": {"cidr": "10.0.0.0/8"}}]'})
    assert (cfg.peering, cfg.pod_id, cfg.watch_namespaces) == ("omnistage", "omnistage-abc", ("a", "b"))
    assert cfg.orchestrator_clients_from == ({"ipBlock": {"cidr": "10.0.0.0/8"}},)
