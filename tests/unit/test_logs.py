"""Log lines: the format flag (json or text; a bad value refused naming the flag and the choices), the JSON
line's fields, levels that mean something, the access log switch, JSON in the operator's pods, and the
rotation of `omnistage serve`'s log files."""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import warnings

import grpc
import pytest
import yaml

from omnistage import logs
from omnistage.contract import launch
from omnistage.local import cli
from omnistage.local.restarts import LOG_BACKUPS, rotate_log
from omnistage_operator.builders import build_children
from omnistage_operator.config import ModelVolume, OperatorConfig
from omnistage_operator.pipeline_object import parse

from ..conftest import EXAMPLES

PARSERS = [(launch.stage_parser, ["--pipeline", "p.yaml", "--stage", "s"]),
           (launch.orchestrator_parser, ["--pipeline", "p.yaml"])]


def json_line(record_logger: str, message: str, level=logging.INFO, **extra) -> dict:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.formatter("json"))
    log = logging.getLogger(record_logger)
    log.addHandler(handler)
    old, log.propagate = (log.propagate, log.level), False
    log.setLevel(logging.DEBUG)
    try:
        log.log(level, message, extra=extra)
    finally:
        log.removeHandler(handler)
        log.propagate = old[0]
        log.setLevel(old[1])
    (line,) = out.getvalue().splitlines()
    return json.loads(line)


def test_a_json_line_has_time_level_logger_message_and_the_request_fields():
    line = json_line("omnistage.test", "request done", logging.WARNING, request_id="r-1", trace_id="ab" * 16)
    assert {k: line[k] for k in ("level", "logger", "message", "request_id", "trace_id")} == {
        "level": "WARNING", "logger": "omnistage.test", "message": "request done", "request_id": "r-1",
        "trace_id": "ab" * 16}
    assert line["time"].endswith("Z") and "T" in line["time"]   # ISO 8601, UTC


def test_a_json_line_without_request_fields_has_only_its_own():
    # and what a library's record factory adds to every record in the process (vLLM, once imported, adds its
    # process name): the line carries the record as the process made it
    plain = logging.LogRecord("n", logging.INFO, "p", 1, "m", None, None)
    factory = logging.getLogRecordFactory()("n", logging.INFO, "p", 1, "m", None, None)
    added = set(vars(factory)) - set(vars(plain))
    assert set(json_line("omnistage.test", "started")) == {"time", "level", "logger", "message"} | added


@pytest.mark.parametrize("parser, argv", PARSERS)
def test_both_services_take_json_or_text_defaulting_to_text(parser, argv):
    assert parser(env={}).parse_args(argv).log_format == "text"
    assert parser(env={}).parse_args([*argv, "--log-format", "json"]).log_format == "json"
    assert parser(env={logs.ENV_LOG_FORMAT: "json"}).parse_args(argv).log_format == "json"
    assert parser(env={}).parse_args([*argv, "--access-log", "off"]).access_log == "off"


@pytest.mark.parametrize("parser, argv", PARSERS)
@pytest.mark.parametrize("flag, env", [(["--log-format", "xml"], {}), ([], {logs.ENV_LOG_FORMAT: "xml"})])
def test_a_bad_log_format_is_refused_naming_the_flag_and_the_choices(parser, argv, flag, env, capsys):
    with pytest.raises(SystemExit) as e:
        parser(env=env).parse_args([*argv, *flag])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--log-format" in err and "'xml'" in err and "json, text" in err


def test_serve_refuses_a_bad_log_format_the_same_way(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "p.yaml", "--log-format", "yaml"])
    err = capsys.readouterr().err
    assert "--log-format" in err and "'yaml'" in err and "json, text" in err


@pytest.mark.parametrize("status, level", [
    (grpc.StatusCode.OK, logging.INFO),
    (grpc.StatusCode.INVALID_ARGUMENT, logging.INFO),      # the client's own error: nothing to act on
    (grpc.StatusCode.UNAUTHENTICATED, logging.INFO),
    (grpc.StatusCode.ALREADY_EXISTS, logging.INFO),
    (grpc.StatusCode.CANCELLED, logging.INFO),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, logging.WARNING),  # load
    (grpc.StatusCode.UNAVAILABLE, logging.WARNING),
    (grpc.StatusCode.DEADLINE_EXCEEDED, logging.WARNING),
    (grpc.StatusCode.INTERNAL, logging.ERROR),             # the server's fault
    (grpc.StatusCode.UNKNOWN, logging.ERROR),
])
def test_levels_that_mean_something(status, level):
    assert logs.level_for(status) == level


@pytest.fixture
def root_logging():
    """The root logger's handlers and level, and the access logger's switch, put back after the test."""
    root, access = logging.getLogger(), logging.getLogger(logs.ACCESS_LOGGER)
    saved = (list(root.handlers), root.level, access.disabled)
    bars = os.environ.get(logs.ENV_NO_PROGRESS_BARS)
    yield
    logging.captureWarnings(False)
    if bars is None:
        os.environ.pop(logs.ENV_NO_PROGRESS_BARS, None)
    else:
        os.environ[logs.ENV_NO_PROGRESS_BARS] = bars
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])
    access.disabled = saved[2]


def test_the_access_log_switch_turns_the_lines_off_and_on(root_logging):
    access = logging.getLogger(logs.ACCESS_LOGGER)
    logs.configure("INFO", "json", "off")
    assert not access.isEnabledFor(logging.INFO) and not access.isEnabledFor(logging.ERROR)
    logs.configure("INFO", "text", "on")
    assert access.isEnabledFor(logging.INFO)
    assert len(logging.getLogger().handlers) == 1   # configured twice: one handler, never doubled lines


def test_configure_writes_json_lines_when_asked_warnings_included(root_logging, capsys):
    logs.configure("INFO", "json")
    logging.getLogger("omnistage.test").info("hello %s", "there", extra={"request_id": "abc"})
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library's warning", UserWarning, stacklevel=1)
    hello, warned = [json.loads(x) for x in capsys.readouterr().err.strip().splitlines()[-2:]]
    assert (hello["message"], hello["request_id"], hello["level"]) == ("hello there", "abc", "INFO")
    assert (warned["logger"], warned["level"]) == ("py.warnings", "WARNING") and "a library's warning" in warned[
        "message"]
    assert os.environ[logs.ENV_NO_PROGRESS_BARS] == "1"   # the processes it starts draw no progress bars


def test_the_operator_gives_every_service_pod_json_logs_and_a_pipeline_may_ask_for_text():
    doc = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())
    cfg = OperatorConfig(model_volume=ModelVolume("hostPath", "/srv/models", "/models"))
    kids = build_children(parse(copy.deepcopy(doc)), cfg, "policy/v1")
    deployments = [sc.deployment for sc in kids.stages.values()] + [kids.orchestrator_deployment]
    for d in deployments:
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert {e["name"]: e.get("value") for e in c["env"]}[logs.ENV_LOG_FORMAT] == "json"
    doc["spec"]["deployment"]["stages"]["talker"]["env"] = {logs.ENV_LOG_FORMAT: "text"}
    (c,) = build_children(parse(doc), cfg, "policy/v1").stages["talker"].deployment["spec"]["template"]["spec"][
        "containers"]
    names = [e["name"] for e in c["env"]]
    assert names.count(logs.ENV_LOG_FORMAT) == 1
    assert {e["name"]: e.get("value") for e in c["env"]}[logs.ENV_LOG_FORMAT] == "text"


def test_rotation_keeps_the_newest_copies_up_to_its_count(tmp_path):
    log = tmp_path / "orchestrator.log"
    for i in range(5):
        log.write_bytes(f"generation {i}\n".encode() * 100)
        assert rotate_log(log, max_bytes=1000, backups=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "orchestrator.log", "orchestrator.log.1", "orchestrator.log.2", "orchestrator.log.3"]
    assert [(tmp_path / f"orchestrator.log.{n}").read_text().split("\n")[0] for n in (1, 2, 3)] == [
        "generation 4", "generation 3", "generation 2"]
    assert log.stat().st_size == 0


def test_serve_passes_the_log_settings_to_every_process():
    args = cli.build_parser().parse_args(["serve", "p.yaml", "--log-format", "json", "--no-access-log",
                                          "--log-max-bytes", "4096", "--log-backups", "5"])
    assert (args.log_format, args.no_access_log, args.log_max_bytes, args.log_backups) == ("json", True, 4096, 5)
    assert cli.build_parser().parse_args(["serve", "p.yaml"]).log_backups == LOG_BACKUPS
