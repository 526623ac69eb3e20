"""The sandbox image the real e2e node's containerd runs for every pod (e2e/cluster/pause/oci_archive.py): an
OCI image layout in a tar that `ctr images import` reads, every blob named by its own digest, the reference
containerd is configured with, and the same bytes for the same binary."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("oci_archive", ROOT / "e2e" / "cluster" / "pause" / "oci_archive.py")
oci_archive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oci_archive)

BINARY = b"\x7fELF" + bytes(range(256)) * 8


def files(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}


def blob(fs: dict[str, bytes], digest: str) -> bytes:
    algo, hexdigest = digest.split(":")
    data = fs[f"blobs/{algo}/{hexdigest}"]
    assert hashlib.sha256(data).hexdigest() == hexdigest, f"blob {digest} does not hash to its name"
    return data


def test_the_archive_is_an_image_layout_containerd_names_as_configured():
    fs = files(oci_archive.archive(BINARY))
    assert json.loads(fs["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    (entry,) = json.loads(fs["index.json"])["manifests"]
    # node-up.sh's containerd config names this sandbox image; it is never pulled
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == "localhost/omnistage/pause:3.6"
    manifest = json.loads(blob(fs, entry["digest"]))
    assert entry["size"] == len(blob(fs, entry["digest"]))
    config = json.loads(blob(fs, manifest["config"]["digest"]))
    assert config["config"]["Entrypoint"] == ["/pause"] and config["os"] == "linux"
    (layer,) = manifest["layers"]
    assert config["rootfs"]["diff_ids"] == [layer["digest"]]        # an uncompressed layer: its own diff id
    with tarfile.open(fileobj=io.BytesIO(blob(fs, layer["digest"]))) as t:
        (member,) = t.getmembers()
        assert (member.name, member.mode, t.extractfile(member).read()) == ("pause", 0o755, BINARY)


def test_the_same_binary_gives_the_same_bytes():
    assert oci_archive.archive(BINARY) == oci_archive.archive(BINARY)
    assert oci_archive.archive(BINARY) != oci_archive.archive(BINARY + b"\0")
