"""Identities and certificates for mutual TLS between the orchestrator and the stages.

Every process of a pipeline holds one leaf certificate, in the Kubernetes TLS Secret layout (also what
cert-manager writes): `ca.crt` (the CA that signs the pipeline's peers), `tls.crt` and `tls.key`. Its
identity is the one URI subject alternative name, `identity(namespace, pipeline, role)`:
`omnistage://NAMESPACE/PIPELINE/orchestrator` or `omnistage://NAMESPACE/PIPELINE/stage/STAGE`. A stage
checks the caller's identity, not its address, before it serves `Process`, `Release` or `GetLoad`.

Here: making a CA and issuing leaves (the operator, from the CA Secret the chart creates; `omnistage serve`,
from a throwaway CA made at start), parsing identities, and the file layout. Pure apart from `write_dir`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The Kubernetes TLS Secret layout (cert-manager's too): one folder, three files.
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
# The file of the pipeline's UCX data-plane key (hex), which a stage reads where its --data-plane-key flag
# says: `omnistage serve` writes it beside each stage's certificate; on a cluster it is the one entry of the
# pipeline's key Secret (operator/omnistage_operator/data_plane_key.py). omnistage/connector/ucx_auth.py.
DATA_PLANE_KEY_FILE = "ucx.key"
# A shorter key is refused: 128 bits is the least HMAC-SHA256 should be keyed with (those made here are 256).
MIN_DATA_PLANE_KEY_BYTES = 16
_DATA_PLANE_LABEL = b"omnistage ucx data plane v1\0"

SCHEME = "omnistage"
ORCHESTRATOR_ROLE = "orchestrator"
STAGE_ROLE_PREFIX = "stage/"

LEAF_DAYS = 90          # leaves are renewed by whoever issued them (the operator) well before this
CA_DAYS = 3650
RENEW_BEFORE_DAYS = 30  # the operator reissues a leaf with less than this left


class TlsError(ValueError):
    """A certificate, key or identity that cannot be used, naming what is wrong."""


def stage_role(stage: str) -> str:
    return STAGE_ROLE_PREFIX + stage


def identity(namespace: str, pipeline: str, role: str) -> str:
    """The URI SAN of a pipeline's process: role is "orchestrator" or stage_role(name)."""
    for what, value in (("namespace", namespace), ("pipeline", pipeline)):
        if not value or "/" in value:
            raise TlsError(f"{what} {value!r}: must be non-empty and contain no '/'")
    if role != ORCHESTRATOR_ROLE and not (role.startswith(STAGE_ROLE_PREFIX) and len(role) > len(STAGE_ROLE_PREFIX)
                                          and "/" not in role[len(STAGE_ROLE_PREFIX):]):
        raise TlsError(f"role {role!r}: must be {ORCHESTRATOR_ROLE!r} or 'stage/NAME'")
    return f"{SCHEME}://{namespace}/{pipeline}/{role}"


def peer_name(uri: str) -> str:
    """The DNS name every leaf for identity `uri` carries and every caller checks the server against (gRPC's
    ssl_target_name_override): replicas are dialed by pod IP, unknown when the leaf is issued, so the name,
    not the address, says which peer it must be. E.g. llm.stage.p.default.omnistage.internal."""
    ident = parse_identity(uri)
    if ident is None:
        raise TlsError(f"identity {uri!r}: not an omnistage identity")
    who = ident.role.replace("/", ".") if ident.role == ORCHESTRATOR_ROLE else \
        f"{ident.role[len(STAGE_ROLE_PREFIX):]}.stage"
    return f"{who}.{ident.pipeline}.{ident.namespace}.{SCHEME}.internal"


@dataclass(frozen=True)
class Identity:
    namespace: str
    pipeline: str
    role: str

    @property
    def uri(self) -> str:
        return identity(self.namespace, self.pipeline, self.role)


def parse_identity(uri: str) -> Identity | None:
    """The Identity an omnistage URI SAN names, or None for anything else."""
    prefix = f"{SCHEME}://"
    if not uri.startswith(prefix):
        return None
    parts = uri[len(prefix):].split("/")
    if len(parts) == 3 and parts[2] == ORCHESTRATOR_ROLE:
        ns, pipeline, role = parts
    elif len(parts) == 4 and parts[2] + "/" == STAGE_ROLE_PREFIX and parts[3]:
        ns, pipeline, role = parts[0], parts[1], stage_role(parts[3])
    else:
        return None
    if not ns or not pipeline:
        return None
    return Identity(ns, pipeline, role)


# ------------------------------------------------------------------ issuing
def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_ca(common_name: str = "omnistage CA", days: int = CA_DAYS) -> tuple[bytes, bytes]:
    """A self-signed CA: (certificate PEM, key PEM). EC P-256: small, and fast to handshake."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _load_ca(ca_cert_pem: bytes, ca_key_pem: bytes):
    try:
        cert = x509.load_pem_x509_certificate(ca_cert_pem)
        key = serialization.load_pem_private_key(ca_key_pem, password=None)
    except ValueError as e:
        raise TlsError(f"CA certificate or key: not PEM ({e})") from None
    if cert.public_key().public_numbers() != key.public_key().public_numbers():
        raise TlsError("CA certificate and key do not match")
    return cert, key


def issue(ca_cert_pem: bytes, ca_key_pem: bytes, uri: str, dns_names: Iterable[str] = (),
          ip_addresses: Iterable[str] = (), days: int = LEAF_DAYS) -> tuple[bytes, bytes]:
    """A leaf for identity `uri`, good as server and as client: (certificate PEM, key PEM). It always carries
    peer_name(uri); `dns_names` and `ip_addresses` are further names a caller may check it by."""
    if parse_identity(uri) is None:
        raise TlsError(f"identity {uri!r}: not an omnistage identity (see tls.identity)")
    ca_cert, ca_key = _load_ca(ca_cert_pem, ca_key_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri), x509.DNSName(peer_name(uri))]
    sans += [x509.DNSName(n) for n in dns_names]
    try:
        sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    except ValueError as e:
        raise TlsError(f"ip_addresses: {e}") from None
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, uri[:64])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def uri_of(cert_pem: bytes) -> str | None:
    """The omnistage identity a certificate carries, or None."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    uris = [u for u in sans.get_values_for_type(x509.UniformResourceIdentifier) if parse_identity(u)]
    return uris[0] if len(uris) == 1 else None


def needs_renewal(cert_pem: bytes, ca_cert_pem: bytes, now: _dt.datetime | None = None,
                  renew_before_days: int = RENEW_BEFORE_DAYS) -> bool:
    """True when a leaf is unreadable, near its end, or not signed by (the subject of) this CA."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        ca = x509.load_pem_x509_certificate(ca_cert_pem)
    except ValueError:
        return True
    now = now or _now()
    if cert.not_valid_after_utc - now < _dt.timedelta(days=renew_before_days):
        return True
    try:
        cert.verify_directly_issued_by(ca)
    except Exception:  # noqa: BLE001 - whatever fails verification (signature, key type, names) means: reissue
        return True
    return False


def https(url: str) -> str:
    """The https:// form of an http:// URL: where a port serves TLS (the client-facing API with a certificate)."""
    return "https://" + url.removeprefix("http://")


# ------------------------------------------------------------------ files
@dataclass(frozen=True)
class TlsFiles:
    """A folder in the TLS Secret layout."""
    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / CA_FILE

    @property
    def cert(self) -> Path:
        return self.folder / CERT_FILE

    @property
    def key(self) -> Path:
        return self.folder / KEY_FILE

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) PEM bytes; TlsError naming the file that is missing."""
        out = []
        for p in (self.ca, self.cert, self.key):
            try:
                out.append(p.read_bytes())
            except OSError as e:
                raise TlsError(f"{p}: cannot read ({e.strerror or e})") from None
        return out[0], out[1], out[2]

    def read_leaf(self) -> tuple[bytes, bytes]:
        """(cert, key) PEM bytes alone, for a server-side-only TLS folder (no ca.crt): the client-facing one."""
        out = []
        for p in (self.cert, self.key):
            try:
                out.append(p.read_bytes())
            except OSError as e:
                raise TlsError(f"{p}: cannot read ({e.strerror or e})") from None
        return out[0], out[1]

    def stamp(self) -> tuple:
        """Changes whenever any of the files does (mtime and size; a Secret update swaps a symlink)."""
        out = []
        for p in (self.ca, self.cert, self.key):
            try:
                st = p.stat()
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)


def write_dir(folder: Path | str, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> TlsFiles:
    """Write a TLS folder (the key readable by its owner only)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(folder)
    files.ca.write_bytes(ca_pem)
    files.cert.write_bytes(cert_pem)
    fd = os.open(files.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    return files


def data_plane_key(ca_key_pem: bytes, namespace: str, pipeline: str) -> bytes:
    """The UCX data-plane key of one pipeline, derived from its CA's private key (`omnistage serve`, from its
    throwaway CA; the operator makes a random one instead): the same for every stage of the pipeline; a stage's
    key reveals neither the CA key nor the key of another pipeline."""
    secret = hashlib.sha256(ca_key_pem).digest()
    return hmac.new(secret, _DATA_PLANE_LABEL + f"{namespace}\0{pipeline}".encode(), hashlib.sha256).digest()


def parse_data_plane_key(text: str, where: str) -> bytes:
    """A data-plane key from its file's text (hex, surrounding space ignored); a TlsError naming `where` when
    it is not hex or too short. The one reading of a key: the stage's, and the operator's check of its Secret."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise TlsError(f"{where}: the UCX data-plane key is not hex") from None
    if len(key) < MIN_DATA_PLANE_KEY_BYTES:
        raise TlsError(f"{where}: the UCX data-plane key is {len(key)} bytes; at least {MIN_DATA_PLANE_KEY_BYTES} "
                       "expected")
    return key


def write_pipeline_dirs(root: Path | str, ca_pem: bytes, ca_key_pem: bytes, namespace: str, pipeline: str,
                        stages: Iterable[str]) -> dict[str | None, TlsFiles]:
    """A leaf for a pipeline's orchestrator (key None, folder `orchestrator`) and for each stage (folder
    `stage-NAME`), each in its own TLS folder under `root`; a stage's also holds the data-plane key."""
    roles = {None: ORCHESTRATOR_ROLE, **{name: stage_role(name) for name in stages}}
    out = {}
    for who, role in roles.items():
        cert, key = issue(ca_pem, ca_key_pem, identity(namespace, pipeline, role))
        out[who] = write_dir(Path(root) / (f"stage-{who}" if who else "orchestrator"), ca_pem, cert, key)
        if who is not None:
            fd = os.open(out[who].folder / DATA_PLANE_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(data_plane_key(ca_key_pem, namespace, pipeline).hex())
    return out
