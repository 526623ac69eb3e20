"""Each pipeline's UCX data-plane key on a cluster: one Secret per pipeline, `<pipeline>-data-plane-key`, whose
one entry (`ucx.key`, hex) every stage pod mounts read-only at launch.DATA_PLANE_KEY_MOUNT and names with its
--data-plane-key flag, in every TLS mode (chart, certManager, off); the orchestrator moves no tensors and gets
none. The stages authenticate every UCX request and reply with it (omnistage/connector/ucx_auth.py).

The key is random, made by the reconcile when the Secret is missing and kept as long as it exists and holds a
usable key: deleting the Secret is how it is rotated (docs/security.md). It is never logged. Pure apart from
`new_key`: the reconcile calls that, the builder takes the key it made.
"""

from __future__ import annotations

import base64
import secrets

from omnistage import tls

SECRET_TYPE = "Opaque"
# 256 bits: the HMAC-SHA256 the data plane signs with takes no more (a longer key is hashed down).
KEY_BYTES = 32


def data_plane_key_secret_name(pipeline: str) -> str:
    """`<pipeline>-data-plane-key`: no stage's object name ends so (those are `<pipeline>-<stage>` and
    `<pipeline>-tls-<unit>`) unless a stage is named `data-plane-key`, and a Secret is never one of those."""
    return f"{pipeline}-data-plane-key"


def new_key() -> str:
    """A fresh key, as the hex text of its file."""
    return secrets.token_hex(KEY_BYTES)


def build_data_plane_key_secret(meta: dict, key_hex: str) -> dict:
    """The key Secret for `meta` (the builders' metadata: name, namespace, labels) holding `key_hex`."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": SECRET_TYPE,
            "data": {tls.DATA_PLANE_KEY_FILE: base64.b64encode(key_hex.encode("ascii")).decode("ascii")}}


def holds_usable_key(live: dict) -> bool:
    """Whether a live key Secret holds a key a stage accepts (read as a stage reads it)."""
    text = (live.get("data") or {}).get(tls.DATA_PLANE_KEY_FILE)
    if not text:
        return False
    try:
        tls.parse_data_plane_key(base64.b64decode(text).decode("ascii"), "the key Secret")
    except (ValueError, UnicodeDecodeError):   # binascii.Error and TlsError are ValueErrors
        return False
    return True
