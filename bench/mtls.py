"""What mutual TLS between the orchestrator and the stages costs: the same pipeline served twice, once as
`omnistage serve` runs it (mTLS, a throwaway CA) and once with `--no-tls` (plaintext), side by side.

Both are the llm-tiny example on the transformers engine (one torch thread per process), each a stage
process and an orchestrator process on loopback; the load generator is this process, and its requests to
either orchestrator are plaintext (the client-facing port is not what is measured).

1. `mtls.rps_c8_over_plaintext`: requests/s at concurrency 8 through the mTLS pipeline over the plaintext
   one (all requests over all their time), the same seeded prompts, in short rounds that alternate which
   goes first so a noisy neighbour on the machine hits both alike (goal >= 0.95); also the median of the
   round-by-round ratios, which one disturbed round moves less.
2. `mtls.hop_overhead_p50_ms`: what one orchestrator -> stage hop gains from TLS on a warm connection: this
   process plays the orchestrator (its own certificate, the same channel options as the Router), sends
   `GetLoad` to each stage over a connection already open, alternating call by call, and takes the median
   of the pairwise differences.
3. `mtls.new_connection_overhead_p50_ms`: the same for a new connection (handshake included): what a
   replica added, a rotated certificate or a reconnect costs once.

    .venv/bin/python bench/mtls.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import grpc
import yaml
from common import figure, finish, percentile, print_table

from omnistage import tls, tls_grpc
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from orchestrator_service.routing import CHANNEL_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llm-tiny.yaml"
STAGE = "llm"
MAX_TOKENS = 8
SEED = 7


@contextlib.contextmanager
def served(models: Path, use_tls: bool):
    """`omnistage serve` of llm-tiny on the transformers engine, with or without mTLS; yields the LocalPipeline."""
    from omnistage.api import parse_pipeline
    from omnistage.local.serve import LocalPipeline

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        local = LocalPipeline(path, parse_pipeline(doc), models, progress=lambda m: None, tls=use_tls)
        try:
            local.start()
            yield local
        finally:
            local.stop()


def prompts(n: int, seed: int) -> list[str]:
    words = ["river", "stone", "light", "market", "winter", "garden", "engine", "letter", "cloud", "harbour"]
    return [f"Tell me about the {words[(seed + i) % len(words)]} and the {words[(seed * 3 + i) % len(words)]}"
            for i in range(n)]


async def level(endpoint: str, load: list[str], concurrency: int) -> float:
    """Every prompt through the orchestrator at `endpoint`, `concurrency` at a time: requests/s."""
    from omnistage.client import AsyncOmniClient

    queue = list(load)
    async with AsyncOmniClient(endpoint) as client:
        async def worker():
            while queue:
                result = await client.generate(queue.pop(), max_tokens=MAX_TOKENS, ignore_eos=True, seed=SEED,
                                               timeout=600)
                if result.final is None or result.final.usage.completion_tokens != MAX_TOKENS:
                    raise SystemExit(f"a request ended short: {result.final}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(load) / (time.perf_counter() - t0)


def stage_channel(local, use_tls: bool) -> grpc.aio.Channel:
    """A channel to the stage replica as the orchestrator dials it (its identity, its options)."""
    address = f"{local.host}:{local.stages[0].port}"
    if not use_tls:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    own = tls_grpc.ChannelTls(tls.TlsFiles(local.tls_root / "orchestrator"))
    return grpc.aio.secure_channel(address, own.credentials, options=[*CHANNEL_OPTIONS, *own.options(STAGE)])


async def get_load_s(channel: grpc.aio.Channel) -> float:
    t0 = time.perf_counter()
    await stage_pb2_grpc.StageServiceStub(channel).GetLoad(stage_pb2.GetLoadRequest(), timeout=30)
    return time.perf_counter() - t0


async def hops(secure, plain, n: int, fresh: bool) -> dict[str, list[float]]:
    """`n` GetLoad calls to each stage, alternating; over warm channels, or each on a new channel (`fresh`)."""
    out = {"mtls": [], "plaintext": []}
    warm = {"mtls": stage_channel(secure, True), "plaintext": stage_channel(plain, False)}
    try:
        for ch in warm.values():  # connect both before timing
            await get_load_s(ch)
        for i in range(n):
            order = ("mtls", "plaintext") if i % 2 == 0 else ("plaintext", "mtls")
            for name in order:
                if not fresh:
                    out[name].append(await get_load_s(warm[name]))
                    continue
                ch = stage_channel(secure if name == "mtls" else plain, name == "mtls")
                try:
                    out[name].append(await get_load_s(ch))
                finally:
                    await ch.close()
    finally:
        for ch in warm.values():
            await ch.close()
    return out


async def measure(secure, plain, rounds: int, per_round: int, n_hops: int) -> dict:
    ends = {"mtls": secure.endpoint, "plaintext": plain.endpoint}
    for endpoint in ends.values():  # warm both pipelines (model, caches, connections)
        await level(endpoint, prompts(8, 99), 4)
    rps: dict[str, list[float]] = {"mtls": [], "plaintext": []}
    for r in range(rounds):
        load = prompts(per_round, 100 + r)
        for name in (("mtls", "plaintext") if r % 2 == 0 else ("plaintext", "mtls")):
            rps[name].append(await level(ends[name], load, 8))
    return {"rps": rps, "warm": await hops(secure, plain, n_hops, fresh=False),
            "fresh": await hops(secure, plain, max(20, n_hops // 10), fresh=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=str(ROOT / "models"))
    args = ap.parse_args()
    # Short rounds, many: a neighbour's burst on the shared cores falls on both pipelines alike.
    rounds, per_round, n_hops = (4, 8, 300) if args.quick else (16, 16, 2000)
    started = time.perf_counter()
    with served(Path(args.models), True) as secure, served(Path(args.models), False) as plain:
        out = asyncio.run(measure(secure, plain, rounds, per_round, n_hops))
    # total requests over total time, per mode (each round the same prompts through both)
    rps = {k: len(v) / sum(1 / x for x in v) for k, v in out["rps"].items()}
    ratios = [round(m / p, 3) for m, p in zip(out["rps"]["mtls"], out["rps"]["plaintext"])]
    added = {k: [1e3 * (m - p) for m, p in zip(v["mtls"], v["plaintext"])]
             for k, v in (("warm", out["warm"]), ("fresh", out["fresh"]))}
    figures = [figure("mtls.rps_c8_over_plaintext", rps["mtls"] / rps["plaintext"], "ratio"),
               figure("mtls.hop_overhead_p50_ms", percentile(added["warm"], 50), "ms"),
               figure("mtls.new_connection_overhead_p50_ms", percentile(added["fresh"], 50), "ms"),
               figure("mtls.rps_c8_over_plaintext_median_round", percentile(ratios, 50), "ratio"),
               figure("mtls.rps_c8", rps["mtls"], "req/s"),
               figure("plaintext.rps_c8", rps["plaintext"], "req/s"),
               figure("mtls.hop_p50_ms", 1e3 * percentile(out["warm"]["mtls"], 50), "ms"),
               figure("plaintext.hop_p50_ms", 1e3 * percentile(out["warm"]["plaintext"], 50), "ms"),
               figure("mtls.new_connection_p50_ms", 1e3 * percentile(out["fresh"]["mtls"], 50), "ms"),
               figure("plaintext.new_connection_p50_ms", 1e3 * percentile(out["fresh"]["plaintext"], 50), "ms")]
    print_table("mutual TLS between the orchestrator and the stages against plaintext (--no-tls)", figures)
    print(f"\nmTLS / plaintext req/s at c8, round by round: {ratios}")
    notes = (f"examples/llm-tiny.yaml on the transformers engine, served twice by LocalPipeline (`omnistage "
             f"serve`): with mTLS (throwaway CA, EC P-256 leaves, TLS 1.3) and with --no-tls; {MAX_TOKENS} "
             f"tokens per request, greedy, ignore_eos; rounds alternate which pipeline goes first. Hops: "
             f"GetLoad from this process as the orchestrator, alternating call by call. {os.cpu_count()} CPU "
             "cores shared by both pipelines and the client.")
    extra = {"quick": args.quick, "rps_c8_ratio_by_round": ratios, "hop_calls": len(added["warm"]),
             "new_connections": len(added["fresh"]), "notes": notes}
    finish("mtls", figures, started, extra)


if __name__ == "__main__":
    main()
