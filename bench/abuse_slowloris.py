"""Slowloris on the HTTP API: the p99 latency of a normal chat completion (the tiny Qwen3-Omni Thinker, text
out, a new connection each) while 1,000 half-open connections are held (each sent
`POST /v1/chat/completions HTTP/1.1` and one header, then nothing), over the same p99 with none, in one run.
Everything in one process on 127.0.0.1: the stage server, the orchestrator and its API, and the clients.

    .venv/bin/python bench/abuse_slowloris.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import figure, percentile, print_table

ROOT = Path(__file__).resolve().parent.parent
HALF_OPEN = 1000
HALF_HEADERS = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
MAX_TOKENS = 4


def thinker_only():
    """The tiny Qwen3-Omni pipeline cut to its Thinker: a chat request is one small stage call."""
    import yaml

    from omnistage.api import parse_pipeline

    doc = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "qwen3-omni-tiny.yaml").read_text()))
    doc["spec"]["topology"].update(stages=doc["spec"]["topology"]["stages"][:1],
                                   outputs=[{"modality": "text", "stage": "thinker"}])
    for stage in ("talker", "code2wav"):
        del doc["spec"]["deployment"]["stages"][stage]
    return parse_pipeline(doc)


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def chat_ms(port: int, model: str) -> float:
    """One chat completion on a new connection, in ms; the answer must be 200."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": MAX_TOKENS, "modalities": ["text"]}).encode()
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
    finally:
        writer.close()
    if status != 200:
        raise RuntimeError(f"a normal chat request got {status}")
    return 1e3 * (time.perf_counter() - started)


async def run(n: int) -> dict:
    from omnistage.contract import launch
    from orchestrator_service.server import OrchestratorServer
    from stage_service.server import StageServer

    pipeline = thinker_only()
    models = os.environ.get(launch.ENV_MODEL_DIR) or ROOT / "models"
    stage = StageServer(pipeline, "thinker", "127.0.0.1", 0, model_root=str(models))
    await stage.start()
    orc = OrchestratorServer(pipeline, {"thinker": [f"127.0.0.1:{stage.port}"]}, api_port=0)
    await orc.start(wait_for_stages=60)
    port, model = orc.api_port, pipeline.name
    held: list[asyncio.StreamWriter] = []
    try:
        for _ in range(5):  # warm
            await chat_ms(port, model)
        baseline = [await chat_ms(port, model) for _ in range(n)]
        readers = []
        for _ in range(HALF_OPEN):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(HALF_HEADERS)
            held.append(writer)
            readers.append(reader)
        await asyncio.gather(*(w.drain() for w in held))
        attacked = [await chat_ms(port, model) for _ in range(n)]
        still_open = sum(not r.at_eof() for r in readers)
        return {"baseline": baseline, "attacked": attacked, "held": still_open}
    finally:
        for w in held:
            w.close()
        await orc.drain()
        await stage.drain()


def measure(quick: bool) -> list[dict]:
    raise_fd_limit(4 * HALF_OPEN)  # both ends of each connection, in this one process
    out = asyncio.run(run(30 if quick else 200))
    base, attacked = percentile(out["baseline"], 99), percentile(out["attacked"], 99)
    return [
        figure("slowloris.p99_ms_over_baseline", round(attacked / base, 3), "x"),
        figure("slowloris.p99_ms_baseline", round(base, 2), "ms"),
        figure("slowloris.p99_ms_half_open", round(attacked, 2), "ms"),
        figure("slowloris.half_open_held", out["held"], "connections"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print_table("slowloris on the HTTP API", measure(args.quick))


if __name__ == "__main__":
    main()
