"""JSON bodies built to cost the orchestrator more memory than their bytes, against a clean body of the same size.

An orchestrator of the Qwen3-Omni tiny example serving its OpenAI API runs in a process of its own (its stages
are not started: a body that passes the door is answered by the request path, 503 or 400); each body is POSTed
to /v1/chat/completions at about the chat body limit, and the process's peak RSS (VmHWM, reset before each
body through /proc/PID/clear_refs) is read after the answer.

`json_amplification.rss_over_body`: the largest peak RSS growth over the body's size among the hostile shapes
(the shape is named in the figure's `shape`; goal <= 3). `json_amplification.clean_rss_over_body`: the same for
a valid body of media parts at their largest (base64 decoded and checked by the request path). Quick: limits of
2 parts of 4 MiB (a chat body of about 11 MiB); full: the example's own (8 parts of 16 MiB, about 170 MiB).

    .venv/bin/python bench/abuse_json.py [--quick]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx
from common import figure, print_table

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "qwen3-omni-tiny.yaml"
QUICK_LIMITS = {"maxParts": 2, "maxPartBytes": 4 << 20}
CHAT = "/v1/chat/completions"


def _pipeline(limits: dict):
    import yaml

    from omnistage.api import parse_pipeline

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["topology"].setdefault("limits", {}).update(limits)
    return parse_pipeline(doc)


def _serve(limits: dict) -> None:
    """The orchestrator process: its API on a free port (printed), stages named at a closed port."""
    import asyncio

    from orchestrator_service.server import OrchestratorServer

    async def main():
        pipeline = _pipeline(limits)
        orc = OrchestratorServer(pipeline, {s.name: ["127.0.0.1:1"] for s in pipeline.stages}, api_port=0)
        await orc.start()
        print(orc.api_port, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    raise KeyError(field)


def shapes(limits) -> dict[str, bytes]:
    """Bodies of about the chat limit: the hostile shapes and the clean one."""
    from orchestrator_service.http_api import body_limits

    bounds = body_limits.chat_bounds(limits)
    size, values = bounds.size, bounds.values

    def padded(head: bytes, tail: bytes) -> bytes:  # filled to the limit with a string of base64-like bytes
        return head + b"A" * (size - len(head) - len(tail) - 64) + tail

    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(os.urandom(limits.max_part_bytes - 64))
                                                   .decode(), "format": "wav"}}
    parts = [part] * limits.max_parts
    user = b'{"role":"user","content":"hi"}'
    return {
        "clean: media parts at their largest": json.dumps({"messages": [{"role": "user", "content": parts}]}).encode(),
        '{"role":1} items': b'{"messages":[' + b'{"role":1},' * (size // 11 - 8) + b'{"role":1}]}',
        "[] items up to the value bound, then a string": padded(
            b'{"messages":[' + user + b'],"x":[' + b"[]," * (values // 2 - 64) + b'[]],"y":"', b'"}'),
        "{} items in an ignored field, then a string": padded(
            b'{"messages":[{"role":"user","content":"hi","x":[' + b"{}," * (values // 2 - 64) + b'{}]}],"y":"',
            b'"}'),
        "one text part past the prompt limit": padded(b'{"messages":[{"role":"user","content":"', b'"}]}'),
        "parts at their largest, then a bad part": json.dumps(
            {"messages": [{"role": "user", "content": parts[:-1] + [{"type": 1}]}]}).encode(),
        "escaped 4-byte characters past the prompt limit": b'{"messages":[{"role":"user","content":"' +
        b"\\ud83d\\ude00" * ((size - 64) // 12) + b'"}]}',
        "escaped characters up to the escape bound, then a string": padded(
            b'{"messages":[{"role":"user","content":"' + b"\\ud83d\\ude00" * (bounds.escapes // 2 - 64) + b'"}],"y":"',
            b'"}'),
        "nesting past the parser's depth": b"[" * (size // 2) + b"]" * (size // 2),
    }


def _peak_growth(limits: dict, body: bytes) -> tuple[int, int, float]:
    """(peak RSS growth, status, seconds) of one body sent to a fresh orchestrator: memory a previous body
    freed is not there to be reused."""
    proc = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps(limits)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        port = int(proc.stdout.readline())
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            client.post(CHAT, json={"messages": [{"role": "user", "content": "warm"}]})  # lazily built objects
            rss = _kib(proc.pid, "VmRSS")
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM from here
            start = time.perf_counter()
            try:
                status = client.post(CHAT, content=body, headers={"content-type": "application/json"}).status_code
            except httpx.TransportError:  # refused before it was read whole: the connection closed under it
                status = 0
            return _kib(proc.pid, "VmHWM") - rss, status, time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(30)


def measure(quick: bool) -> list[dict]:
    limits = QUICK_LIMITS if quick else {}
    rows = {}
    for name, body in shapes(_pipeline(limits).limits).items():
        growth, status, seconds = _peak_growth(limits, body)
        rows[name] = (growth, len(body), status, seconds)
    for name, (growth, size, status, seconds) in rows.items():
        print(f"{name:50s} {size >> 20:5d} MiB  -> {status}  peak RSS +{growth >> 20} MiB ({growth / size:.2f}x) "
              f"{seconds:.1f} s", file=sys.stderr)
    clean_name = next(n for n in rows if n.startswith("clean"))
    hostile = {n: r for n, r in rows.items() if n != clean_name}
    worst = max(hostile, key=lambda n: hostile[n][0] / hostile[n][1])
    return [
        {**figure("json_amplification.rss_over_body", round(hostile[worst][0] / hostile[worst][1], 2), "x"),
         "shape": worst, "body_bytes": hostile[worst][1], "status": hostile[worst][2]},
        {**figure("json_amplification.clean_rss_over_body", round(rows[clean_name][0] / rows[clean_name][1], 2),
                  "x"), "shape": clean_name, "body_bytes": rows[clean_name][1], "status": rows[clean_name][2]},
    ]


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        _serve(json.loads(sys.argv[2]))
        sys.exit(0)
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    print_table("JSON bodies: peak orchestrator RSS growth over body size", measure(ap.parse_args().quick))
