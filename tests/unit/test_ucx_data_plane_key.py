"""The UCX data-plane key: derived from the pipeline CA's key, written beside each stage's certificate
(`omnistage serve`) and into each stage's leaf Secret (the operator's chart issuer), read back by the
stage; MACs bind a reply to its request; which stores a stage runs without a key (no cluster)."""

from __future__ import annotations

import base64
import copy
import os
import stat

import pytest
import yaml

from omnistage import tls
from omnistage.connector.ucx_auth import MAC_BYTES, Authenticator, read_key
from omnistage_operator.builders import build_tls_secret_meta
from omnistage_operator.certificates import CertificateAuthority, build_tls_secret, leaves, needs_reissue
from omnistage_operator.pipeline_object import parse
from omnistage_operator.vocabulary import ORCHESTRATOR
from stage_service.data_plane import unkeyed_transports

from ..conftest import EXAMPLES
from ..harness import example

BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority(*tls.new_ca("test pipelines CA"))


def test_the_key_is_one_per_pipeline_and_namespace(ca):
    key = tls.data_plane_key(ca.key_pem, "team-a", "omni")
    assert len(key) == 32 and key == tls.data_plane_key(ca.key_pem, "team-a", "omni")
    others = {tls.data_plane_key(ca.key_pem, "team-b", "omni"), tls.data_plane_key(ca.key_pem, "team-a", "omni2"),
              tls.data_plane_key(tls.new_ca("another CA")[1], "team-a", "omni")}
    assert key not in others and len(others) == 3


def test_serve_writes_the_key_beside_each_stage_certificate_only(tmp_path, ca):
    dirs = tls.write_pipeline_dirs(tmp_path, ca.cert_pem, ca.key_pem, "local", "omni", ["thinker", "talker"])
    expected = tls.data_plane_key(ca.key_pem, "local", "omni")
    for stage in ("thinker", "talker"):
        path = dirs[stage].folder / tls.DATA_PLANE_KEY_FILE
        assert read_key(dirs[stage].folder) == expected
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_key(dirs[None].folder) is None  # the orchestrator has no UCX
    assert read_key(None) is None


@pytest.mark.parametrize("text, error", [("zz", "not hex"), ("ab" * 16 + "\n", None), ("ab" * 4, "at least 16")])
def test_a_key_file_is_hex_of_at_least_16_bytes(tmp_path, text, error):
    (tmp_path / tls.DATA_PLANE_KEY_FILE).write_text(text)
    if error is None:
        assert read_key(tmp_path) == bytes.fromhex("ab" * 16)
    else:
        with pytest.raises(ValueError, match=error):
            read_key(tmp_path)


def test_the_operator_puts_the_key_in_stage_secrets_and_reissues_those_without(ca):
    doc = copy.deepcopy(BASE)
    doc["metadata"]["namespace"] = "team-a"
    p = parse(doc)
    units = leaves(p)
    stage = next(u for u in units if u != ORCHESTRATOR)
    secret = build_tls_secret(build_tls_secret_meta(p, units[stage]), units[stage], ca)
    key = bytes.fromhex(base64.b64decode(secret["data"][tls.DATA_PLANE_KEY_FILE]).decode())
    assert key == tls.data_plane_key(ca.key_pem, "team-a", p.name)
    orchestrator = build_tls_secret(build_tls_secret_meta(p, units[ORCHESTRATOR]), units[ORCHESTRATOR], ca)
    assert tls.DATA_PLANE_KEY_FILE not in orchestrator["data"]
    assert not needs_reissue(secret, units[stage], ca)
    without = copy.deepcopy(secret)
    del without["data"][tls.DATA_PLANE_KEY_FILE]
    assert needs_reissue(without, units[stage], ca)  # issued before the key existed: issued again


def test_a_reply_mac_binds_the_header_to_its_request():
    auth, stranger = Authenticator(b"k" * 32), Authenticator(b"w" * 32)
    request = auth.request_mac(b"request body")
    mac = auth.reply_mac(request, b"header")
    assert len(mac) == MAC_BYTES
    assert auth.verify(auth.reply_mac(request, b"header"), mac)
    assert not auth.verify(auth.reply_mac(auth.request_mac(b"another request"), b"header"), mac)
    assert not auth.verify(auth.reply_mac(request, b"another header"), mac)
    assert not auth.verify(mac, stranger.reply_mac(stranger.request_mac(b"request body"), b"header"))
    assert Authenticator(None).verify(b"\0" * MAC_BYTES, b"anything")  # unauthenticated: loopback only


@pytest.mark.parametrize("transports, keyed, host, named, expected", [
    (("shm", "ucx"), False, "127.0.0.1", False, ("shm", "ucx")),   # serve --no-tls: loopback, unauthenticated
    (("ucx",), False, "10.0.0.7", False, ()),                        # a cluster without a key: auto leaves UCX out
    (("ucx",), False, "10.0.0.7", True, ("ucx",)),                   # named: its store refuses to start, saying why
    (("ucx",), True, "10.0.0.7", False, ("ucx",)),
])
def test_which_stores_a_stage_runs_without_a_key(transports, keyed, host, named, expected):
    def edit(doc):
        for s in doc["spec"]["topology"]["stages"]:
            for e in s.get("inputs", []):
                e["transport"] = "ucx" if named else "auto"
    p = example("qwen3-omni-tiny", edit)
    assert unkeyed_transports(p, p.stage("talker"), transports, keyed, host, {}) == expected
