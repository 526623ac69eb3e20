"""The UCX data plane's authentication: a per-pipeline secret key, and the HMAC-SHA256 that every
request and every reply header carries.

A request's MAC covers all of it (operation, reply tag, fragment size, tensor size, key); a reply
header's MAC covers the header and the MAC of the request it answers, so a reply is bound to one
request: a forged or replayed header is discarded. The payload itself is not MACed (it may be GBs in
device memory); it travels on random 64-bit tags that only the authenticated producer was told.

The key comes with the mTLS material: `omnistage serve` and the operator (chart issuer) write it as
`ucx.key` beside a stage's `tls.key`, derived from the pipeline CA's private key, the namespace and the
pipeline (omnistage.tls.data_plane_key). Without a key the data plane runs unauthenticated, which the
UCX store allows only on loopback (ucx.py).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from omnistage.tls import DATA_PLANE_KEY_FILE

MAC_BYTES = hashlib.sha256().digest_size
MIN_KEY_BYTES = 16
_NO_MAC = bytes(MAC_BYTES)


def read_key(tls_dir: str | Path | None) -> bytes | None:
    """The key in a TLS folder, or None when there is no folder or no key in it."""
    if not tls_dir:
        return None
    path = Path(tls_dir) / DATA_PLANE_KEY_FILE
    if not path.is_file():
        return None
    try:
        key = bytes.fromhex(path.read_text().strip())
    except ValueError:
        raise ValueError(f"{path}: the UCX data-plane key is not hex") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{path}: the UCX data-plane key is {len(key)} bytes; at least {MIN_KEY_BYTES} expected")
    return key


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
