"""Stage batching: throughput of each engine at concurrency 1, 4 and 16 against one-at-a-time serving.

Each engine runs as a real stage process (`python -m stage_service`) on loopback; this process is
the client. "serial" is the same stage with scheduler.maxBatch 1 (one request at a time, the
others queued) under the same 16-way load; c1/c4/c16 use maxBatch 16 with that many requests in
flight. vLLM and the transformers AR engine serve the same tiny LM (models/qwen2-tiny).

    .venv/bin/python bench/stage_batching.py [--quick] [--device cuda]

Prints a table and writes bench/results/stage_batching.json (with --device cuda: the stage on the first
GPU, engines not installed there skipped, bench/results/gpu/stage_batching.json).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

# bench/common.py, which also puts the repo on sys.path
from common import (add_device_argument, engine_available, exit_on_sigterm, figure, require_device,  # noqa: E402
                    results_name, write_results)

import grpc  # noqa: E402
import torch  # noqa: E402

from omnistage import launch, tensors  # noqa: E402
from omnistage.client import build_request  # noqa: E402
from omnistage.v1 import stage_pb2, stage_pb2_grpc  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 4, 16)


@dataclass
class Case:
    name: str          # figure prefix
    example: str
    stage: str
    unit: str
    request: Callable[[int], tuple[stage_pb2.StageInput, list[stage_pb2.Chunk]]]
    units: Callable[[list[stage_pb2.Chunk]], int]
    engine: str | None = None  # override the stage's engine
    keep: list | None = None   # outputs to keep (a few), as inputs for a later case


def header(i: int, **params) -> stage_pb2.StageInput:
    p = build_request(**{"prompt": f"benchmark request {i}", **params}).params
    return stage_pb2.StageInput(header=stage_pb2.StageRequestHeader(request_id=f"b{i}-{time.monotonic_ns()}",
                                                                    params=p))


def tensor_of(chunk, name):
    return next(tensors.from_proto(t) for t in chunk.tensors if t.name == name)


def chunk(stage: str, cid: int, end: bool, **named) -> stage_pb2.Chunk:
    return stage_pb2.Chunk(stage=stage, chunk_id=cid, end_of_stream=end,
                           tensors=[tensors.to_proto(k, v) for k, v in named.items()])


def cases(quick: bool) -> list[Case]:
    tokens = 24 if quick else 64
    steps = 5 if quick else 10
    chunks = 2 if quick else 4
    emb = torch.randn(2, 77, 32, generator=torch.Generator().manual_seed(0))

    def lm(i):
        return header(i, max_tokens=tokens, ignore_eos=True), []

    def count_tokens(out):
        return sum(len(tensor_of(c, "token_ids")) for c in out)

    def denoise(i):
        return (header(i, width=32, height=32, num_inference_steps=steps, seed=i),
                [chunk("text-encoder", 0, True, embeddings=emb)])

    def code2wav(i):
        g = torch.Generator().manual_seed(i)
        return header(i), [chunk("talker", k, k == chunks - 1, codes=torch.randint(0, 2048, (4, 25), generator=g))
                           for k in range(chunks)]

    def vae(i):
        lat = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(i))
        return header(i), [chunk("denoise", 0, True, latents=lat)]

    out = [
        Case("ar_vllm", "llm-tiny", "llm", "tokens/s", lm, count_tokens),
        Case("ar_transformers", "llm-tiny", "llm", "tokens/s", lm, count_tokens, engine="transformers"),
        Case("diffusion", "text-to-image-tiny", "denoise", "steps/s", denoise, lambda out: steps),
        Case("decoder", "qwen3-omni-tiny", "code2wav", "frames/s", code2wav, lambda out: 25 * chunks),
    ]
    if not quick:
        thinker_outputs: list[list[stage_pb2.Chunk]] = []  # filled by the thinker case, read by the talker's

        def talker(i):
            return header(i, max_codec_frames=64), thinker_outputs[i % len(thinker_outputs)]

        def count_frames(out):
            return sum(tensor_of(c, "codes").shape[1] for c in out)

        out += [
            Case("thinker", "qwen3-omni-tiny", "thinker", "tokens/s", lm, count_tokens, keep=thinker_outputs),
            Case("talker", "qwen3-omni-tiny", "talker", "frames/s", talker, count_frames),
            Case("vae", "text-to-image-tiny", "vae-decode", "images/s", vae, lambda out: 1),
        ]
    return out


class StageProcess:
    """One stage as its own process, serving on a free loopback port."""

    def __init__(self, case: Case, max_batch: int, workdir: Path, device: str = "cpu"):
        doc = yaml.safe_load((REPO / "examples" / f"{case.example}.yaml").read_text())
        stage = next(s for s in doc["spec"]["topology"]["stages"] if s["name"] == case.stage)
        if case.engine:
            stage["engine"] = case.engine
        dep = doc["spec"]["deployment"]["stages"][case.stage]
        dep["scheduler"] = {"maxBatch": max_batch, "maxQueued": 1024}
        if device == "cuda":
            dep["gpus"] = 1
        if case.engine == "transformers":
            dep.get("engineArgs", {}).pop("max_model_len", None)
        path = workdir / f"{case.name}-{max_batch}.yaml"
        path.write_text(yaml.safe_dump(doc))
        self.ready = workdir / f"{case.name}-{max_batch}.ready"
        self.log = open(workdir / f"{case.name}-{max_batch}.log", "w")
        env = {**os.environ, **launch.service_env(REPO / "models"), "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1"}
        argv = launch.stage_command(path, case.stage, port=0, ready_file=self.ready, log_level="WARNING")
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> int:
        deadline = time.monotonic() + timeout
        while launch.read_ready(self.ready) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stage did not start (see {self.log.name})")
            time.sleep(0.1)
        return launch.read_ready(self.ready).grpc

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def throughput(port: int, case: Case, n: int, concurrency: int) -> float:
    """Units per second for n requests with `concurrency` in flight."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                         options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = stage_pb2_grpc.StageServiceStub(ch)
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> int:
            first, chunks = case.request(i)

            async def msgs():
                yield first
                for c in chunks:
                    yield stage_pb2.StageInput(chunk=c)

            async with gate:
                out = [o.chunk async for o in stub.Process(msgs(), timeout=600)]
            if case.keep is not None and len(case.keep) < 8:
                case.keep.append(out)
            return case.units(out)

        await one(n)  # warm-up
        t0 = time.perf_counter()
        units = sum(await asyncio.gather(*(one(i) for i in range(n))))
        return units / (time.perf_counter() - t0)


def case_engine(case: Case) -> str:
    doc = yaml.safe_load((REPO / "examples" / f"{case.example}.yaml").read_text())
    return case.engine or next(s["engine"] for s in doc["spec"]["topology"]["stages"] if s["name"] == case.stage)


def measure(case: Case, n: int, workdir: Path, device: str = "cpu") -> dict[str, float]:
    result = {}
    for max_batch, label_conc in ((1, [("serial", 16)]), (16, [(f"c{c}", c) for c in CONCURRENCY])):
        stage = StageProcess(case, max_batch, workdir, device)
        try:
            port = stage.wait_ready()
            for label, conc in label_conc:
                result[label] = asyncio.run(throughput(port, case, n, conc))
                print(f"  {case.name:16s} {label:7s} {result[label]:10.1f} {case.unit}", flush=True)
        finally:
            stage.stop()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter requests, the four named engines only")
    add_device_argument(ap)
    args = ap.parse_args()
    require_device(args.device)
    exit_on_sigterm()
    n = 32 if args.quick else 64
    load_at_start = os.getloadavg()[0]
    figures, rows, skipped = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases(args.quick):
            if not engine_available(case_engine(case)):
                skipped.append(case.name)
                print(f"  {case.name:16s} skipped: engine {case_engine(case)} is not installed here", flush=True)
                continue
            r = measure(case, n, Path(tmp), args.device)
            ratio = r["c16"] / r["serial"]
            rows.append((case.name, case.unit, r["serial"], r["c1"], r["c4"], r["c16"], ratio))
            figures += [figure(f"{case.name}.{k}", v, case.unit) for k, v in r.items()]
            figures.append(figure(f"{case.name}.c16_over_serial", ratio, "x"))
    by = {f["name"]: f["value"] for f in figures}
    if "ar_vllm.c1" in by and "ar_transformers.c1" in by:
        for c in ("c1", "c16"):
            figures.append(figure(f"vllm_over_transformers.{c}", by[f"ar_vllm.{c}"] / by[f"ar_transformers.{c}"], "x"))
    print(f"\n{'engine':16s} {'unit':9s} {'serial':>9s} {'c1':>9s} {'c4':>9s} {'c16':>9s} {'c16/serial':>11s}")
    for name, unit, *vals, ratio in rows:
        print(f"{name:16s} {unit:9s} " + " ".join(f"{v:9.1f}" for v in vals) + f" {ratio:10.2f}x")
    if "ar_vllm.c1" in by and "ar_transformers.c1" in by:
        print(f"\nvLLM over transformers (same tiny LM, tokens/s): c1 {by['ar_vllm.c1'] / by['ar_transformers.c1']:.2f}x, "
              f"c16 {by['ar_vllm.c16'] / by['ar_transformers.c16']:.2f}x")
    path = write_results(results_name("stage_batching", args.device), figures, {"settings": {
        "quick": args.quick, "requests_per_point": n, "load_average_at_start": load_at_start, "device": args.device,
        "skipped": skipped}})
    print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
