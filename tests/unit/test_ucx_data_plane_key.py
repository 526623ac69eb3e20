"""The UCX data-plane key: derived from the pipeline CA's key and written beside each stage's certificate by
`omnistage serve` (on a cluster: a random key in a Secret of each pipeline, test_operator_data_plane_key.py);
read back by the stage from the file its --data-plane-key flag names; MACs bind a reply to its request; which
stores a stage runs without a key (no cluster)."""

from __future__ import annotations

import copy
import os
import shutil
import stat

import pytest
import yaml

from omnistage import tls
from omnistage.connector.ucx_auth import MAC_BYTES, Authenticator, read_key
from omnistage.contract import launch
from omnistage_operator.builders import build_tls_secret_meta
from omnistage_operator.certificates import CertificateAuthority, build_tls_secret, leaves, needs_reissue
from omnistage_operator.pipeline_object import parse
from omnistage_operator.vocabulary import ORCHESTRATOR
from stage_service.data_plane import DataPlane, unkeyed_transports

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
        assert read_key(path) == expected
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not (dirs[None].folder / tls.DATA_PLANE_KEY_FILE).exists()  # the orchestrator has no UCX
    assert read_key(None) is None


@pytest.mark.parametrize("text, error", [("zz", "not hex"), ("ab" * 16 + "\n", None), ("ab" * 4, "at least 16")])
def test_a_key_file_is_hex_of_at_least_16_bytes(tmp_path, text, error):
    path = tmp_path / tls.DATA_PLANE_KEY_FILE
    path.write_text(text)
    if error is None:
        assert read_key(path) == bytes.fromhex("ab" * 16)
    else:
        with pytest.raises(ValueError, match=error):
            read_key(path)


def test_a_named_key_file_that_is_missing_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path / 'nothing'}: no UCX data-plane key"):
        read_key(tmp_path / "nothing")


def test_a_stage_reads_the_key_from_the_file_its_flag_names(tmp_path):
    """One way in: the flag (or its variable), never a file found beside the certificate."""
    path = tmp_path / "key"
    path.write_text("cd" * 32)
    p = example("qwen3-omni-tiny")
    argv = launch.stage_command("p.yaml", "talker", data_plane_key=path)
    assert launch.stage_parser(env={}).parse_args(argv[3:]).data_plane_key == str(path)
    args = launch.stage_parser(env={launch.ENV_DATA_PLANE_KEY: str(path)}).parse_args(["--pipeline", "p.yaml",
                                                                                       "--stage", "talker"])
    assert args.data_plane_key == str(path)
    assert DataPlane(p, p.stage("talker"), env={}, key_file=str(path)).ucx_key == bytes.fromhex("cd" * 32)
    assert DataPlane(p, p.stage("talker"), env={}).ucx_key is None


def test_the_chart_issuers_leaf_secrets_carry_no_data_plane_key(ca):
    """The key reaches a stage one way on a cluster, the pipeline's key Secret: not in its certificate's."""
    doc = copy.deepcopy(BASE)
    doc["metadata"]["namespace"] = "team-a"
    p = parse(doc)
    units = leaves(p)
    for unit, leaf in units.items():
        secret = build_tls_secret(build_tls_secret_meta(p, leaf), leaf, ca)
        assert tls.DATA_PLANE_KEY_FILE not in secret["data"], unit
        assert not needs_reissue(secret, leaf, ca)
    assert ORCHESTRATOR in units


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


def test_serve_names_each_stages_key_and_passes_on_none_from_its_environment(tmp_path, monkeypatch):
    from omnistage.local.serve import LocalPipeline

    monkeypatch.setenv(launch.ENV_DATA_PLANE_KEY, str(tmp_path / "someone-elses.key"))
    p = example("qwen3-omni-tiny")
    served = LocalPipeline(tmp_path / "p.yaml", p, tmp_path / "models", log_dir=tmp_path / "logs")
    assert launch.ENV_DATA_PLANE_KEY not in served.env()   # serve decides: its own key, or none (--no-tls)
    served._tls_dirs = served._issue_certificates()
    assert served.tls_root is not None
    try:
        argv = served._stage_proc("talker", "talker-0", "stage talker[0]").argv
        key_file = launch.stage_parser(env={}).parse_args(argv[argv.index("--pipeline"):]).data_plane_key
        assert read_key(key_file) == read_key(served._tls_dirs["thinker"] / tls.DATA_PLANE_KEY_FILE)  # one per pipeline
        assert "--data-plane-key" not in served._orchestrator_proc(0, 0, None).argv
    finally:
        shutil.rmtree(served.tls_root)
    served._tls_dirs = {}   # --no-tls: no key (UCX on loopback only, unauthenticated)
    assert "--data-plane-key" not in served._stage_proc("talker", "talker-0", "stage talker[0]").argv
