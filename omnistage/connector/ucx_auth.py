"""The UCX data plane's authentication: a per-pipeline secret key, and the HMAC-SHA256 that every
request and every reply header carries.

A request's MAC covers all of it (operation, reply tag, fragment size, tensor size, key); a reply
header's MAC covers the header and the MAC of the request it answers, so a reply is bound to one
request: a forged or replayed header is discarded. The payload itself is not MACed (it may be GBs in
device memory); it travels on random 64-bit tags that only the authenticated producer was told.

A stage reads the key from the file its --data-plane-key flag names. `omnistage serve` writes it as
`ucx.key` beside each stage's `tls.key`, derived from its throwaway CA's private key, the namespace and the
pipeline (omnistage.tls.data_plane_key); on a cluster the operator keeps a random key in a Secret of each
pipeline and mounts it into every stage pod, whatever the TLS issuer. Without a key the data plane runs
unauthenticated, which the UCX store allows only on loopback (ucx.py).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from omnistage.tls import TlsError, parse_data_plane_key

MAC_BYTES = hashlib.sha256().digest_size
_NO_MAC = bytes(MAC_BYTES)


def read_key(path: str | Path | None) -> bytes | None:
    """The key in the file `path` names, or None when none is named; a TlsError naming the file when it is
    missing, unreadable, not hex or too short: a stage told to use a key never runs without it."""
    if not path:
        return None
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TlsError(f"{path}: no UCX data-plane key ({e.strerror})") from None
    return parse_data_plane_key(text, str(path))


class Authenticator:
    """Signs and checks requests and reply headers with one key; with none, signs with zeros and
    accepts anything (unauthenticated: loopback only)."""

    def __init__(self, key: bytes | None):
        self.key = key

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def _mac(self, *parts: bytes) -> bytes:
        if self.key is None:
            return _NO_MAC
        mac = hmac.new(self.key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def request_mac(self, body: bytes) -> bytes:
        return self._mac(b"request\0", body)

    def reply_mac(self, request_mac: bytes, header: bytes) -> bytes:
        return self._mac(b"reply\0", request_mac, header)

    def verify(self, expected: bytes, got: bytes) -> bool:
        return self.key is None or hmac.compare_digest(expected, got)
