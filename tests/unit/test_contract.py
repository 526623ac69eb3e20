"""The process contract (omnistage/contract/launch.py): the command lines a launcher writes are the ones the
services read back, and the environment, model store and ports are spelled in one place."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from omnistage.contract import launch

PY = "/usr/bin/python3"


@pytest.mark.parametrize("flags, argv_tail", [
    ({}, []),
    ({"port": 0, "model_dir": Path("/m"), "ready_file": Path("/tmp/r")},
     ["--port", "0", "--model-dir", "/m", "--ready-file", "/tmp/r"]),
    ({"host": "$(POD_IP)", "port": launch.GRPC_PORT, "http_port": launch.HTTP_PORT},
     ["--host", "$(POD_IP)", "--port", "50051", "--http-port", "8080"]),
    ({"drain_seconds": 30, "log_level": "WARNING"},
     ["--drain-seconds", "30", "--log-level", "WARNING"]),
    ({"http_port": None}, []),   # None: left out, the service's default applies
])
def test_stage_command(flags, argv_tail):
    argv = launch.stage_command("p.yaml", "talker", python=PY, **flags)
    assert argv == [PY, "-m", "stage_service", "--pipeline", "p.yaml", "--stage", "talker", *argv_tail]


@pytest.mark.parametrize("kw, argv_tail", [
    ({}, []),
    ({"stage_endpoints": {"thinker": ["127.0.0.1:1", "127.0.0.1:2"], "talker": ["127.0.0.1:3"]},
      "wait_for_stages": 30},
     ["--stage-endpoint", "thinker=127.0.0.1:1,127.0.0.1:2", "--stage-endpoint", "talker=127.0.0.1:3",
      "--wait-for-stages", "30"]),
    ({"host": "$(POD_IP)", "port": 50051, "discovery": "kubernetes", "namespace": "team-a"},
     ["--host", "$(POD_IP)", "--port", "50051", "--discovery", "kubernetes", "--namespace", "team-a"]),
])
def test_orchestrator_command(kw, argv_tail):
    argv = launch.orchestrator_command("p.yaml", python=PY, **kw)
    assert argv == [PY, "-m", "orchestrator_service", "--pipeline", "p.yaml", *argv_tail]


@pytest.mark.parametrize("build", [launch.stage_command, launch.orchestrator_command])
def test_a_flag_the_service_does_not_take_is_refused_where_the_command_is_built(build):
    args = ("p.yaml", "talker") if build is launch.stage_command else ("p.yaml",)
    with pytest.raises(TypeError, match="no flag bogus"):
        build(*args, bogus=1)


@pytest.mark.parametrize("flags", [
    {},
    {"host": "0.0.0.0", "port": 50051, "http_port": 8080, "model_dir": "/models", "drain_seconds": 12.5,
     "ready_file": "/tmp/r", "log_level": "DEBUG"},
])
def test_stage_parser_reads_back_what_stage_command_writes(flags):
    args = launch.stage_parser(env={}).parse_args(launch.stage_command("p.yaml", "s", **flags)[3:])
    assert (args.pipeline, args.stage) == ("p.yaml", "s")
    for name, value in flags.items():
        assert getattr(args, name) == value


@pytest.mark.parametrize("kw, expected", [
    ({}, {"host": "127.0.0.1", "port": 0, "http_port": None, "stage_endpoint": [], "discovery": "static",
          "namespace": "default", "wait_for_stages": 0.0, "drain_seconds": None, "log_level": "INFO"}),
    ({"stage_endpoints": {"a": ["h:1", "h:2"]}, "wait_for_stages": 30, "drain_seconds": 5},
     {"stage_endpoint": ["a=h:1,h:2"], "wait_for_stages": 30.0, "drain_seconds": 5.0}),
    ({"discovery": "kubernetes", "namespace": "ns"}, {"discovery": "kubernetes", "namespace": "ns"}),
])
def test_orchestrator_parser_reads_back_what_orchestrator_command_writes(kw, expected):
    args = launch.orchestrator_parser(env={}).parse_args(launch.orchestrator_command("p.yaml", **kw)[3:])
    assert args.pipeline == "p.yaml"
    assert {name: getattr(args, name) for name in expected} == expected


@pytest.mark.parametrize("parser, env, name, value", [
    (launch.stage_parser, {}, "host", launch.DEFAULT_HOST),
    (launch.stage_parser, {launch.ENV_HOST: "0.0.0.0"}, "host", "0.0.0.0"),
    (launch.orchestrator_parser, {launch.ENV_HOST: "10.0.0.1"}, "host", "10.0.0.1"),
    (launch.orchestrator_parser, {launch.ENV_POD_NAMESPACE: "team-a"}, "namespace", "team-a"),
    (launch.orchestrator_parser, {launch.ENV_POD_NAMESPACE: ""}, "namespace", launch.DEFAULT_NAMESPACE),
])
def test_defaults_from_the_environment(parser, env, name, value):
    argv = ["--pipeline", "p.yaml"] + (["--stage", "s"] if parser is launch.stage_parser else [])
    assert getattr(parser(env=env).parse_args(argv), name) == value


@pytest.mark.parametrize("kw, expected", [
    ({}, {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}),
    ({"model_dir": Path("/models")}, {launch.ENV_MODEL_DIR: "/models"}),
    ({"same_host": True}, {launch.ENV_SAME_HOST: "1"}),
])
def test_service_env(kw, expected):
    env = launch.service_env(**kw)
    assert expected.items() <= env.items()
    assert (launch.ENV_MODEL_DIR in env) == ("model_dir" in kw)
    assert (launch.ENV_SAME_HOST in env) == ("same_host" in kw)


@pytest.mark.parametrize("model, component, root, env, expected", [
    ("qwen3-omni-tiny", "talker", "/m", {}, "/m/qwen3-omni-tiny"),      # combined checkpoint: the root
    ("qwen2-tiny", None, None, {launch.ENV_MODEL_DIR: "/store"}, "/store/qwen2-tiny"),
    ("qwen2-tiny", None, "/given", {launch.ENV_MODEL_DIR: "/store"}, "/given/qwen2-tiny"),   # flag beats env
    ("qwen2-tiny", None, None, {}, "models/qwen2-tiny"),
])
def test_model_dir(model, component, root, env, expected):
    stage = SimpleNamespace(model=model, component=component)
    assert launch.model_dir(stage, root, env) == Path(expected)


def test_model_dir_of_a_diffusers_component(tmp_path):
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "model_index.json").write_text("{}")
    stage = SimpleNamespace(model=str(tmp_path / "sd"), component="vae")
    assert launch.model_dir(stage, "/elsewhere", {}) == tmp_path / "sd" / "vae"


@pytest.mark.parametrize("kw, argv_tail", [
    ({"api_port": 0}, ["--api-port", "0"]),
    ({"api_port": launch.API_PORT, "api_key": ["k1", "k2"]}, ["--api-port", "8000", "--api-key", "k1",
                                                             "--api-key", "k2"]),
])
def test_orchestrator_api_flags_round_trip(kw, argv_tail):
    argv = launch.orchestrator_command("p.yaml", python=PY, **kw)
    assert argv[5:] == argv_tail
    args = launch.orchestrator_parser(env={}).parse_args(argv[3:])
    assert (args.api_port, args.api_key) == (kw["api_port"], kw.get("api_key", []))


@pytest.mark.parametrize("env, argv, keys", [
    ({}, [], []),                                                       # no keys: the API takes any client
    ({launch.ENV_API_KEYS: "a,b"}, [], ["a", "b"]),
    ({launch.ENV_API_KEYS: " a , ,b,"}, [], ["a", "b"]),                  # blanks and spaces dropped
    ({launch.ENV_API_KEYS: ""}, [], []),
    ({launch.ENV_API_KEYS: "a,b"}, ["--api-key", "c"], ["c"]),          # flags replace the environment's keys
    ({}, ["--api-key", "c", "--api-key", "d"], ["c", "d"]),
])
def test_api_keys_from_the_environment_or_the_flags(env, argv, keys):
    args = launch.orchestrator_parser(env=env).parse_args(["--pipeline", "p.yaml", *argv])
    assert args.api_key == keys
    assert args.api_port is None   # not given: no API


def test_environment_keys_are_not_shared_between_parses():
    parser = launch.orchestrator_parser(env={launch.ENV_API_KEYS: "a"})
    parser.parse_args(["--pipeline", "p.yaml", "--api-key", "b"])
    assert parser.parse_args(["--pipeline", "p.yaml"]).api_key == ["a"]


@pytest.mark.parametrize("ports, text", [
    (launch.ReadyPorts(43211), "grpc 43211\n"),
    (launch.ReadyPorts(43211, 43212), "grpc 43211\nhttp 43212\n"),
    (launch.ReadyPorts(43211, 43212, 43213), "grpc 43211\nhttp 43212\napi 43213\n"),
    (launch.ReadyPorts(43211, api=8000), "grpc 43211\napi 8000\n"),
])
def test_ready_file_round_trip(tmp_path, ports, text):
    path = tmp_path / "orchestrator.ready"
    launch.write_ready(path, ports)
    assert path.read_text() == text
    assert launch.read_ready(path) == ports
    assert [p.name for p in tmp_path.iterdir()] == ["orchestrator.ready"]   # no temporary file left


@pytest.mark.parametrize("text", [
    None,                        # not written yet
    "",
    "grpc 43211",                # the last line's newline not yet written
    "grpc 43211\nhttp 432",
    "grpc\n",
    "grpc 43x\n",
    "http 43212\n",              # no gRPC port
    "43211\n",                   # the old one-number format
])
def test_an_incomplete_ready_file_reads_as_not_ready(tmp_path, text):
    path = tmp_path / "ready"
    if text is not None:
        path.write_text(text)
    assert launch.read_ready(path) is None


def test_a_ready_file_may_name_ports_this_reader_does_not_know(tmp_path):
    (tmp_path / "ready").write_text("grpc 1\nbogus 2\napi 3\n")
    assert launch.read_ready(tmp_path / "ready") == launch.ReadyPorts(1, None, 3)


@pytest.mark.parametrize("host, port, path, url", [
    ("127.0.0.1", 8000, launch.API_PATH, "http://127.0.0.1:8000/v1"),
    ("::1", 9, "", "http://[::1]:9"),
])
def test_http_url(host, port, path, url):
    assert launch.http_url(host, port, path) == url


def test_the_stage_command_line_has_no_test_switch():
    """Fault injection is a test's switch, set in the environment (stage_service.runtime.faults), not part of
    the production command line."""
    with pytest.raises(TypeError, match="no flag inject_step_failure"):
        launch.stage_command("p.yaml", "s", inject_step_failure=3)
    with pytest.raises(SystemExit):
        launch.stage_parser(env={}).parse_args(["--pipeline", "p.yaml", "--stage", "s", "--inject-step-failure", "3"])
