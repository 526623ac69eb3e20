"""The pipelines' mTLS certificates on a cluster: which Secret each pod of a pipeline mounts, what identity
it carries, and the objects that put a certificate there. Pure: builders and decisions, no API calls.

Two issuers (the chart's `tls.issuer`):
- `chart`: the operator signs every leaf itself with the CA in the Secret the chart keeps
  (`build_tls_secret`), and reissues one when `tls.needs_renewal` says so (near its end, or the CA changed);
- `certManager`: the operator asks cert-manager for each leaf (`build_certificate`); cert-manager writes the
  same Secret and renews it.
Either way a pod mounts `<pipeline>-tls-<role>` (ca.crt, tls.crt, tls.key) at launch.TLS_MOUNT; the
kubelet refreshes a mounted Secret in place and the processes reload the files, so no pod template
changes on rotation and nothing rolls.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from omnistage import tls
from omnistage.api import Pipeline

from .config import IssuerRef
from .vocabulary import COMPONENT_ORCHESTRATOR, COMPONENT_STAGE, ORCHESTRATOR

SECRET_TYPE = "kubernetes.io/tls"
CERT_MANAGER_API = "cert-manager.io/v1"
# A Secret's `data` keys: the TLS Secret layout tls.py reads.
_FILES = (tls.CA_FILE, tls.CERT_FILE, tls.KEY_FILE)


@dataclass(frozen=True)
class Leaf:
    """One pod role's certificate: the Secret its pods mount and the identity the certificate names."""
    secret: str
    uri: str
    component: str
    stage: str | None = None

    @property
    def dns_name(self) -> str:
        return tls.peer_name(self.uri)


def tls_secret_name(pipeline: str, unit: str) -> str:
    """`<pipeline>-tls-orchestrator` or `<pipeline>-tls-<stage>`."""
    return f"{pipeline}-tls-{unit}"


def leaves(p: Pipeline) -> dict[str, Leaf]:
    """Every certificate a pipeline needs, by unit (each stage, and "orchestrator")."""
    out = {s.name: Leaf(tls_secret_name(p.name, s.name), tls.identity(p.namespace, p.name, tls.stage_role(s.name)),
                        COMPONENT_STAGE, s.name) for s in p.stages}
    out[ORCHESTRATOR] = Leaf(tls_secret_name(p.name, ORCHESTRATOR),
                             tls.identity(p.namespace, p.name, tls.ORCHESTRATOR_ROLE), COMPONENT_ORCHESTRATOR)
    return out


@dataclass(frozen=True)
class CertificateAuthority:
    """The CA the chart keeps: certificate and key PEM, read from its Secret."""
    cert_pem: bytes
    key_pem: bytes


def ca_from_secret(secret: dict, where: str) -> CertificateAuthority:
    """The CA in a kubernetes.io/tls Secret (tls.crt, tls.key); a clear error naming what is missing."""
    data = secret.get("data") or {}
    missing = [k for k in (tls.CERT_FILE, tls.KEY_FILE) if not data.get(k)]
    if missing:
        raise tls.TlsError(f"CA Secret {where}: no {' or '.join(missing)} in its data")
    return CertificateAuthority(_b64d(data[tls.CERT_FILE]), _b64d(data[tls.KEY_FILE]))


def build_tls_secret(meta: dict, leaf: Leaf, ca: CertificateAuthority) -> dict:
    """A freshly issued leaf for `leaf.uri`, as the Secret its pods mount. `meta` is the Secret's metadata
    (name, namespace, labels) from the builders."""
    cert, key = tls.issue(ca.cert_pem, ca.key_pem, leaf.uri)
    data = {tls.CA_FILE: _b64e(ca.cert_pem), tls.CERT_FILE: _b64e(cert), tls.KEY_FILE: _b64e(key)}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": SECRET_TYPE, "data": data}


def needs_reissue(live: dict, leaf: Leaf, ca: CertificateAuthority) -> bool:
    """True when a live leaf Secret must be issued again: a key missing, a certificate near its end or not
    signed by this CA, another identity, or a CA bundle that is not this CA (the CA was replaced)."""
    data = live.get("data") or {}
    if any(not data.get(k) for k in _FILES):
        return True
    cert = _b64d(data[tls.CERT_FILE])
    return (_b64d(data[tls.CA_FILE]) != ca.cert_pem or tls.uri_of(cert) != leaf.uri
            or tls.needs_renewal(cert, ca.cert_pem))


def build_certificate(meta: dict, leaf: Leaf, issuer: IssuerRef) -> dict:
    """A cert-manager Certificate for `leaf`: it writes the same Secret (with ca.crt, which cert-manager's
    CA issuer fills) and renews it (cert-manager's default: at two thirds of the lifetime)."""
    return {"apiVersion": CERT_MANAGER_API, "kind": "Certificate", "metadata": meta,
            "spec": {"secretName": leaf.secret, "uris": [leaf.uri], "dnsNames": [leaf.dns_name],
                     "duration": f"{tls.LEAF_DAYS * 24}h", "renewBefore": f"{tls.RENEW_BEFORE_DAYS * 24}h",
                     "usages": ["server auth", "client auth", "digital signature", "key encipherment"],
                     "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
                     "issuerRef": {"name": issuer.name, "kind": issuer.kind, "group": issuer.group}}}


def _b64e(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _b64d(text: str) -> bytes:
    return base64.b64decode(text)
