"""How a process writes its log lines: the format (`--log-format json|text`), the JSON formatter, and the
access log switch (`--access-log on|off`).

JSON (python-json-logger) is one object a line with `time` (ISO 8601, UTC), `level`, `logger`, `message`,
and every field the call passed in `extra=` (request_id, trace_id, the access lines' fields), so a log
pipeline (Loki, Elasticsearch, Cloud Logging) indexes them without parsing the text. Text is for a terminal:
`time level logger: message`. Pods get JSON (the operator sets OMNISTAGE_LOG_FORMAT=json); a process started
by hand or by `omnistage serve` writes text unless told otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

from pythonjsonlogger.json import JsonFormatter

if TYPE_CHECKING:
    import grpc

LOG_FORMATS = ("json", "text")
DEFAULT_LOG_FORMAT = "text"       # a terminal's; the operator's pod builders ask for json
POD_LOG_FORMAT = "json"           # what the operator sets in every stage and orchestrator container
ENV_LOG_FORMAT = "OMNISTAGE_LOG_FORMAT"
ENV_ACCESS_LOG = "OMNISTAGE_ACCESS_LOG"
ACCESS_LOG_SWITCH = ("on", "off")
ACCESS_LOGGER = "omnistage.access"   # one line per request (orchestrator) and per stage call (stage)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Progress bars: the Hub's variable (transformers and diffusers read it too, at import), and the switches of
# the modules that read it already.
ENV_NO_PROGRESS_BARS = "HF_HUB_DISABLE_PROGRESS_BARS"
PROGRESS_BARS = (("huggingface_hub.utils", "disable_progress_bars"),
                 ("transformers.utils.logging", "disable_progress_bar"),
                 ("diffusers.utils.logging", "disable_progress_bar"))
# The JSON line's own fields, renamed from the LogRecord's attributes; the rest come from `extra=`.
JSON_FIELDS = {"asctime": "time", "levelname": "level", "name": "logger"}
# Levels that mean something for a request's end (access lines at the orchestrator and the stages): its answer
# and the client's own errors (bad input, a wrong key, a request it cancelled) are INFO, nothing to act on;
# load and deadlines (refused for capacity, no ready replica, too slow) are WARNING, a sign of sizing;
# what the server got wrong is ERROR.
# By the gRPC status code's name (this module imports no gRPC: the command-line contract reads it).
LOAD_STATUSES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"})
FAULT_STATUSES = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNIMPLEMENTED"})


def log_format(value: str) -> str:
    """A --log-format value (also the type of the flag and of $OMNISTAGE_LOG_FORMAT), or a clear refusal."""
    name = value.strip().lower()
    if name not in LOG_FORMATS:
        raise argparse.ArgumentTypeError(f"{value!r} is not a log format: use one of {', '.join(LOG_FORMATS)} "
                                         f"(the flag, or ${ENV_LOG_FORMAT})")
    return name


def access_log_switch(value: str) -> str:
    """A --access-log value: on or off."""
    name = value.strip().lower()
    if name not in ACCESS_LOG_SWITCH:
        raise argparse.ArgumentTypeError(f"{value!r} is neither on nor off (the flag, or ${ENV_ACCESS_LOG})")
    return name


class JsonLineFormatter(JsonFormatter):
    """One JSON object a line: time (UTC, ISO 8601 with milliseconds), level, logger, message, then `extra=`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s", rename_fields=JSON_FIELDS,
                         json_ensure_ascii=False)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def level_for(status: "grpc.StatusCode") -> int:
    """The level of a request's (or a stage call's) line that ended with `status` (see LOAD_STATUSES)."""
    if status.name in FAULT_STATUSES:
        return logging.ERROR
    if status.name in LOAD_STATUSES:
        return logging.WARNING
    return logging.INFO


def formatter(fmt: str) -> logging.Formatter:
    """The formatter of a --log-format value."""
    return JsonLineFormatter() if log_format(fmt) == "json" else logging.Formatter(TEXT_FORMAT)


def configure(level: str = "INFO", fmt: str = DEFAULT_LOG_FORMAT, access_log: str = "on") -> None:
    """The process's logging: one handler on stderr in `fmt`, at `level`; the access logger on or off."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):   # a second call (tests) replaces, never doubles, the lines
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.getLogger(ACCESS_LOGGER).disabled = access_log_switch(access_log) == "off"
    if log_format(fmt) == "json":
        quiet_for_json()


def quiet_for_json() -> None:
    """What writes to stderr besides logging, made to go through it or not at all, so that every line is one
    JSON object: Python warnings become log records; the model libraries' progress bars (tqdm, redrawn in place
    with carriage returns) are off, in this process and in the processes it starts."""
    logging.captureWarnings(True)
    os.environ[ENV_NO_PROGRESS_BARS] = "1"
    for module, switch in PROGRESS_BARS:
        if module in sys.modules:   # imported already: it read the variable at import
            getattr(sys.modules[module], switch)()
