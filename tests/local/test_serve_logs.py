"""`omnistage serve --log-format json` as a user runs it, with API keys: every process's log file is JSON lines,
the orchestrator writes an access line per request on both doors naming the key by its name, the key itself
is in no file, and a log file past `--log-max-bytes` is rotated, keeping `--log-backups` copies."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from ..harness import small_lm, write_pipeline
from ..polling import wait_until_sync
from .test_cli_serve import Served, generate

KEY = "serve-logs-secret-key"
WRONG_KEY = "serve-logs-wrong-key"
MAX_BYTES, BACKUPS = 4096, 40   # small enough that a few requests roll the orchestrator's log over
REQUESTS = 6                     # per door


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-logs")
    keys = tmp / "keys.txt"
    keys.write_text(f"{KEY}\n")
    path = write_pipeline(small_lm({"defaultMaxTokens": 4, "maxTokens": 16}), tmp / "llm-logs.yaml")
    s = Served(path, model_dir, tmp, "--log-format", "json", "--api-key-file", str(keys),
               "--log-max-bytes", str(MAX_BYTES), "--log-backups", str(BACKUPS))
    s.log_dir = tmp / f"logs-{path.stem}"
    yield s
    if s.proc.poll() is None:
        s.stop()


def post_chat(api: str, key: str) -> int:
    body = json.dumps({"model": "llm-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{api}/chat/completions", body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def log_lines(log_dir) -> dict[str, list[str]]:
    """Every process's log lines, its rotated copies included, by file name."""
    return {p.name: p.read_text().splitlines() for p in sorted(log_dir.glob("*.log*"))}


def test_json_access_lines_on_both_doors_no_key_anywhere_and_rotation(served):
    api = served.wait_for(r"OpenAI API: (http://127\.0\.0\.1:\d+/v1)\n", 5)
    for _ in range(REQUESTS):
        r = generate(served.endpoint, "--api-key", KEY, "--prompt", "Hello", "--max-tokens", "3")
        assert r.returncode == 0, r.stderr
        assert post_chat(api, KEY) == 200
    assert post_chat(api, WRONG_KEY) == 401
    rolled = served.log_dir / "orchestrator.log.1"
    wait_until_sync(rolled.exists, 30, 0.1, what="the orchestrator's log rotated")
    assert served.stop() == 0

    files = log_lines(served.log_dir)
    assert rolled.stat().st_size > MAX_BYTES   # copied once past its bound
    assert not (served.log_dir / f"orchestrator.log.{BACKUPS + 1}").exists()
    lines = [json.loads(text) for name, texts in files.items() for text in texts if text.strip()]
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    access = [x for x in lines if x["logger"] == "omnistage.access" and "door" in x]
    ok = [x for x in access if x["status"] == "OK"]
    assert {x["door"] for x in ok} == {"grpc", "http"} and {x["api_key"] for x in ok} == {"key-0"}
    assert all(x["tokens_out"] == 3 and x["level"] == "INFO" for x in ok)
    assert [(x["door"], x["api_key"]) for x in access if x["status"] == "UNAUTHENTICATED"] == [("http", None)]
    stage_calls = [x for x in lines if x["logger"] == "omnistage.access" and x.get("stage") == "llm"]
    assert stage_calls and all(x["outcome"] == "finished" for x in stage_calls)
    everything = "\n".join("\n".join(texts) for texts in files.values()) + served.output()
    assert KEY not in everything and WRONG_KEY not in everything
