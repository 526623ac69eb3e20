"""Pack one static binary as a one-layer OCI image archive that `ctr images import` reads, named
localhost/omnistage/pause:3.6 (the sandbox image the e2e node's containerd is configured with; it is never
pulled). Deterministic: the same binary gives the same digests.

usage: python3 oci_archive.py BINARY OUT.tar"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile

REF = "localhost/omnistage/pause:3.6"


def _tar(members: dict[str, bytes], modes: dict[str, int]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), modes.get(name, 0o644), 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def archive(binary: bytes) -> bytes:
    layer_digest, layer = _blob(_tar({"pause": binary}, {"pause": 0o755}))
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }, sort_keys=True).encode()
    config_digest, config = _blob(config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest,
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest,
                    "size": len(layer)}],
    }, sort_keys=True).encode()
    manifest_digest, manifest = _blob(manifest)
    index = json.dumps({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
                       "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": REF}}],
    }, sort_keys=True).encode()
    files = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": index}
    for digest, data in ((layer_digest, layer), (config_digest, config), (manifest_digest, manifest)):
        files["blobs/sha256/" + digest.split(":")[1]] = data
    return _tar(files, {})


if __name__ == "__main__":
    src, out = sys.argv[1:3]
    with open(src, "rb") as f:
        data = archive(f.read())
    with open(out, "wb") as f:
        f.write(data)
