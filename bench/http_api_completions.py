"""`/v1/completions` against the gRPC door for the same work: what the completions layer costs a request.

One `omnistage serve` of the plain LM example (examples/llm-tiny.yaml on the transformers engine, one torch
thread per process), warmed; the same requests go through both doors of the same orchestrator:
  gRPC: `Orchestrator.Generate` with the prompt as written (`raw_prompt`), text out, a server stream;
  HTTP: `POST /v1/completions` (not streamed, as eval tools call it), by a thin httpx client (not the openai
        SDK, so that the client's own cost does not weigh on the server's cores).
Each request: a seeded prompt, greedy, `ignore_eos`, a fixed token budget; both doors give the same tokens (checked
first), so the work behind them is identical. Requests/s at concurrency 8 in rounds alternating the doors, so
that a noisy neighbour on the machine hits both alike:

`completions.rps_c8` (HTTP over gRPC, goal >= 0.9), `completions.http_rps_c8`, `completions.grpc_rps_c8`.

    .venv/bin/python bench/http_api_completions.py [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import http_api
import yaml
from common import figure, run_measure
from http_api import SEED, level, total_rps
from omni_load import prompts

ROOT = Path(__file__).resolve().parent.parent
LM = ROOT / "examples" / "llm-tiny.yaml"
MAX_TOKENS = 16  # llm-tiny's defaultMaxTokens (and OpenAI's completions default)
CONCURRENCY = 8


class Doors(http_api.Doors):
    """One completion, through either door: returns (seconds, text, completion tokens)."""

    async def via_grpc(self, prompt: str, max_tokens: int) -> tuple[float, str, int]:
        t0, text, tokens = asyncio.get_running_loop().time(), [], 0
        async for ev in self.grpc.stream(prompt, raw_prompt=True, max_tokens=max_tokens, ignore_eos=True, seed=SEED,
                                         outputs=["text"], timeout=600):
            if ev.WhichOneof("event") == "text":
                text.append(ev.text.text)
                tokens += len(ev.text.token_ids)
        return asyncio.get_running_loop().time() - t0, "".join(text), tokens

    async def via_http(self, prompt: str, max_tokens: int) -> tuple[float, str, int]:
        t0 = asyncio.get_running_loop().time()
        r = await self.http.post("/completions", json={"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                                       "ignore_eos": True, "seed": SEED})
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        body = r.json()
        return asyncio.get_running_loop().time() - t0, body["choices"][0]["text"], body["usage"]["completion_tokens"]


@contextlib.contextmanager
def serve_lm(models: Path):
    """`omnistage serve` of llm-tiny on the transformers engine, with its OpenAI API; yields the LocalPipeline."""
    from omnistage.api import parse_pipeline
    from omnistage.local.serve import LocalPipeline

    doc = yaml.safe_load(LM.read_text())
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    doc["spec"]["deployment"]["stages"]["llm"]["engineArgs"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        local = LocalPipeline(path, parse_pipeline(doc), models, progress=lambda m: None, api_port=0)
        try:
            local.start()
            yield local
        finally:
            local.stop()


async def compare(endpoint: str, api_url: str, model: str, rounds: int, per_round: int) -> dict:
    doors = Doors(endpoint, api_url, model)
    try:
        probe = prompts(1, 5)[0][0]
        g, h = await doors.via_grpc(probe, MAX_TOKENS), await doors.via_http(probe, MAX_TOKENS)
        if (g[1], g[2]) != (h[1], h[2]):
            raise SystemExit(f"the doors disagree: gRPC {g[2]} tokens {g[1]!r}, HTTP {h[2]} tokens {h[1]!r}")
        work = [(p, MAX_TOKENS) for p, _ in prompts(2 * CONCURRENCY, 99)]
        for call in (doors.via_grpc, doors.via_http):  # warm both paths
            await level(call, work, CONCURRENCY)
        rps: dict[str, list[dict]] = {"grpc": [], "http": []}
        for r in range(rounds):
            load = [(p, MAX_TOKENS) for p, _ in prompts(per_round, 100 + r)]
            order = (("grpc", doors.via_grpc), ("http", doors.via_http))
            for name, call in (order if r % 2 == 0 else order[::-1]):
                rps[name].append(await level(call, load, CONCURRENCY))
        return rps
    finally:
        await doors.close()


def measure(quick: bool) -> list[dict]:
    rounds, per_round = (6, 16) if quick else (16, 48)  # short rounds: a burst of other work hits both doors
    with serve_lm(ROOT / "models") as local:
        rps = asyncio.run(compare(local.endpoint, local.api_url, local.pipeline.name, rounds, per_round))
    http, grpc = total_rps(rps["http"]), total_rps(rps["grpc"])
    return [figure("completions.rps_c8", http / grpc, "ratio"),
            figure("completions.http_rps_c8", http, "req/s"),
            figure("completions.grpc_rps_c8", grpc, "req/s")]


if __name__ == "__main__":
    run_measure("http_api_completions", "/v1/completions against gRPC Generate, same orchestrator, same requests",
                measure, {"notes": f"examples/llm-tiny.yaml on transformers via `omnistage serve`; greedy, "
                                   f"ignore_eos, {MAX_TOKENS} tokens, raw prompts; concurrency {CONCURRENCY}; "
                                   f"{os.cpu_count()} CPU cores shared by the stage, the orchestrator and the "
                                   "client; rounds alternate doors."})
