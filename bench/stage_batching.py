"""Stage batching: throughput of each engine at concurrency 1, 4 and 16 against one-at-a-time serving.

Each engine runs as a real stage process (`python -m stage_service`) on loopback; this process is
the client. "serial" is the same stage with scheduler.maxBatch 1 (one request at a time, the
others queued) under the same 16-way load; c1/c4/c16 use maxBatch 16 with that many requests in
flight. vLLM and the transformers AR engine serve the same tiny LM (models/qwen2-tiny); `thinker_vllm`
is the Qwen3-Omni Thinker on vLLM (examples/qwen3-omni-vllm-tiny.yaml: tokens plus the Talker's rows),
against the transformers `thinker` (`thinker_vllm_over_transformers.c1/.c16`).

Against the limit: after each stage, the same model alone (bench/raw_model.py, its own process, one
thread: the library's own batched call on the same inputs, no service) at batch 1, 4 and 16 gives
`<engine>.model_b1/_b4/_b16`, `<engine>.c16_over_model_b16` (the stage at concurrency 16 over the model
at batch 16: what the service costs) and `<engine>.model_b16_over_b1` (the ceiling of batching on this
machine). `thinker_vllm`'s model alone is vLLM with the stage's hidden-state extraction on, so the stage
is held against the engine doing the same work; `model_plain_b<n>` (tokens only) and
`<engine>.model_b16_over_plain_b16` say what the extraction itself costs.
AR engines add `<engine>.engine_b16` (our step code alone) and
`<engine>.engine_b16_over_model_b16`. `ar_transformers_process`, `talker_process` and `vae_process` are those
stages with their model in an engine process of their own (`engineArgs.engine_process: true`), against the
same model alone.

    .venv/bin/python bench/stage_batching.py [--quick] [--device cuda] [--no-model]

Prints a table and writes bench/results/stage_batching.json (with --device cuda: the stage on the first
GPU, engines not installed there skipped, bench/results/gpu/stage_batching.json). With --only, the cases
run replace their figures in that file and the run is listed under `partial_runs`; the rest stay.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
import psutil
import torch
import yaml

# bench/common.py, which also puts the repo on sys.path
from common import (
    add_device_argument,
    engine_available,
    exit_on_sigterm,
    figure,
    merge_results,
    require_device,
    results_name,
    write_results,
)

from omnistage.client import build_request
from omnistage.contract import launch, tensors
from omnistage.v1 import stage_pb2, stage_pb2_grpc

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
    model_args: tuple[str, ...] = ()  # bench/raw_model.py's arguments for the same inputs
    engine_args: dict | None = None   # added to the stage's engineArgs
    model_case: str | None = None     # bench/raw_model.py's case when not this one's name (same model)


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

    same = ("--tokens", str(tokens), "--steps", str(steps), "--chunks", str(chunks), "--frames", "64")
    out = [
        Case("ar_vllm", "llm-tiny", "llm", "tokens/s", lm, count_tokens, model_args=same),
        Case("ar_transformers", "llm-tiny", "llm", "tokens/s", lm, count_tokens, engine="transformers",
             model_args=same),
        Case("ar_transformers_process", "llm-tiny", "llm", "tokens/s", lm, count_tokens, engine="transformers",
             model_args=same, engine_args={"engine_process": True}, model_case="ar_transformers"),
        Case("diffusion", "text-to-image-tiny", "denoise", "steps/s", denoise, lambda out: steps, model_args=same),
        Case("decoder", "qwen3-omni-tiny", "code2wav", "frames/s", code2wav, lambda out: 25 * chunks,
             model_args=same),
    ]
    if not quick:
        thinker_outputs: list[list[stage_pb2.Chunk]] = []  # filled by the thinker case, read by the talker's

        def talker(i):
            return header(i, max_codec_frames=64), thinker_outputs[i % len(thinker_outputs)]

        def count_frames(out):
            return sum(tensor_of(c, "codes").shape[1] for c in out)

        out += [
            Case("thinker", "qwen3-omni-tiny", "thinker", "tokens/s", lm, count_tokens, keep=thinker_outputs,
                 model_args=same),
            # The same Thinker on vLLM (rows out through our KV connector), against the same engine alone with
            # the same extraction on (raw_model's thinker_vllm; its plain vLLM figures beside it).
            Case("thinker_vllm", "qwen3-omni-vllm-tiny", "thinker", "tokens/s", lm, count_tokens, model_args=same),
            Case("talker", "qwen3-omni-tiny", "talker", "frames/s", talker, count_frames, model_args=same),
            Case("talker_process", "qwen3-omni-tiny", "talker", "frames/s", talker, count_frames, model_args=same,
                 engine_args={"engine_process": True}, model_case="talker"),
            Case("vae", "text-to-image-tiny", "vae-decode", "images/s", vae, lambda out: 1, model_args=same),
            Case("vae_process", "text-to-image-tiny", "vae-decode", "images/s", vae, lambda out: 1, model_args=same,
                 engine_args={"engine_process": True}, model_case="vae"),
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
        if case.engine_args:
            dep.setdefault("engineArgs", {}).update(case.engine_args)
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


def cpu_seconds(proc: psutil.Process, children: bool = True) -> float:
    """User + system CPU seconds of a process and, by default, its children (vLLM's engine core is a child)."""
    total = 0.0
    for p in [proc, *(proc.children(recursive=True) if children else ())]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def measure(case: Case, n: int, workdir: Path, device: str = "cpu") -> dict[str, float]:
    """Units/s serial and at each concurrency; at c16 also the CPU cores the stage and this client used."""
    result = {}
    me = psutil.Process()
    for max_batch, label_conc in ((1, [("serial", 16)]), (16, [(f"c{c}", c) for c in CONCURRENCY])):
        stage = StageProcess(case, max_batch, workdir, device)
        try:
            port = stage.wait_ready()
            proc = psutil.Process(stage.proc.pid)
            for label, conc in label_conc:
                cpu0, mine0, t0 = cpu_seconds(proc), cpu_seconds(me, children=False), time.perf_counter()
                result[label] = asyncio.run(throughput(port, case, n, conc))
                wall = time.perf_counter() - t0
                print(f"  {case.name:16s} {label:7s} {result[label]:10.1f} {case.unit}", flush=True)
                if label == "c16":  # both sides of the 2-core machine: the stage's share and the client's
                    result["c16_stage_cpu_cores"] = (cpu_seconds(proc) - cpu0) / wall
                    result["c16_client_cpu_cores"] = (cpu_seconds(me, children=False) - mine0) / wall
        finally:
            stage.stop()
    return result


MODEL_BATCHES = (1, 4, 16)


def model_alone(case: Case, workdir: Path) -> dict[str, float]:
    """The case's model alone at MODEL_BATCHES (bench/raw_model.py in its own process): units/s by batch."""
    log = workdir / f"{case.name}-model.log"
    argv = [sys.executable, str(REPO / "bench" / "raw_model.py"), case.model_case or case.name, *case.model_args,
            "--batches", *map(str, MODEL_BATCHES)]
    with open(log, "w") as err:
        done = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, timeout=1800,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{case.name}: the model alone failed (see {log}):\n{log.read_text()[-2000:]}")
    # the result is the last line (vLLM logs to stdout too)
    r = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
    for k, v in r.items():
        print(f"  {case.name:16s} model {k:9s} {v:10.1f} {case.unit}", flush=True)
    return r


def limit_figures(case: Case, stage: dict[str, float], model: dict[str, float]) -> list[dict]:
    """The stage against its model alone (see the module docstring)."""
    out = [figure(f"{case.name}.model_{k}", v, case.unit) for k, v in model.items()]
    out += [figure(f"{case.name}.c16_over_model_b16", stage["c16"] / model["b16"], "x"),
            figure(f"{case.name}.model_b16_over_b1", model["b16"] / model["b1"], "x")]
    if "plain_b16" in model:  # an engine run alone with and without what the stage needs of it (thinker_vllm)
        out += [figure(f"{case.name}.c16_over_model_plain_b16", stage["c16"] / model["plain_b16"], "x"),
                figure(f"{case.name}.model_b16_over_plain_b16", model["b16"] / model["plain_b16"], "x")]
    if "engine_b16" in model:
        out.append(figure(f"{case.name}.engine_b16_over_model_b16", model["engine_b16"] / model["b16"], "x"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter requests, the four named engines only")
    ap.add_argument("--no-model", action="store_true", help="skip the model-alone comparison")
    ap.add_argument("--only", nargs="+", metavar="ENGINE", help="these cases only (e.g. ar_transformers talker)")
    add_device_argument(ap)
    args = ap.parse_args()
    require_device(args.device)
    exit_on_sigterm()
    n = 32 if args.quick else 64
    load_at_start = os.getloadavg()[0]
    figures, rows, skipped, limits = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases(args.quick):
            if args.only and case.name not in args.only and not (
                    case.keep is not None and {"talker", "talker_process"} & set(args.only)):
                continue
            if not engine_available(case_engine(case)):
                skipped.append(case.name)
                print(f"  {case.name:16s} skipped: engine {case_engine(case)} is not installed here", flush=True)
                continue
            r = measure(case, n, Path(tmp), args.device)
            ratio = r["c16"] / r["serial"]
            rows.append((case.name, case.unit, r["serial"], r["c1"], r["c4"], r["c16"], ratio))
            figures += [figure(f"{case.name}.{k}", v, "cores" if k.endswith("_cores") else case.unit)
                        for k, v in r.items()]
            figures.append(figure(f"{case.name}.c16_over_serial", ratio, "x"))
            if not args.no_model and args.device == "cpu":
                model = model_alone(case, Path(tmp))
                figures += limit_figures(case, r, model)
                limits.append((case.name, r, model))
    by = {f["name"]: f["value"] for f in figures}
    for vllm, transformers, name in (("ar_vllm", "ar_transformers", "vllm_over_transformers"),
                                     ("thinker_vllm", "thinker", "thinker_vllm_over_transformers")):
        if f"{vllm}.c1" in by and f"{transformers}.c1" in by:
            for c in ("c1", "c16"):
                figures.append(figure(f"{name}.{c}", by[f"{vllm}.{c}"] / by[f"{transformers}.{c}"], "x"))
    print(f"\n{'engine':16s} {'unit':9s} {'serial':>9s} {'c1':>9s} {'c4':>9s} {'c16':>9s} {'c16/serial':>11s}")
    for name, unit, *vals, ratio in rows:
        print(f"{name:16s} {unit:9s} " + " ".join(f"{v:9.1f}" for v in vals) + f" {ratio:10.2f}x")
    by = {f["name"]: f["value"] for f in figures}
    for name, what in (("vllm_over_transformers", "same tiny LM"),
                       ("thinker_vllm_over_transformers", "the Qwen3-Omni Thinker, rows included")):
        if f"{name}.c1" in by:
            print(f"\nvLLM over transformers ({what}, tokens/s): c1 {by[name + '.c1']:.2f}x, "
                  f"c16 {by[name + '.c16']:.2f}x")
    if limits:
        print(f"\n{'engine':16s} {'model b1':>9s} {'b4':>9s} {'b16':>9s} {'stage c16':>10s} {'c16/b16':>8s} "
              f"{'b16/b1':>7s} {'ours b16':>9s} {'stage cores':>12s} {'client cores':>13s}")
        for name, r, m in limits:
            ours = f"{m['engine_b16']:9.1f}" if "engine_b16" in m else f"{'':9s}"
            print(f"{name:16s} {m['b1']:9.1f} {m['b4']:9.1f} {m['b16']:9.1f} {r['c16']:10.1f} "
                  f"{r['c16'] / m['b16']:8.2f} {m['b16'] / m['b1']:7.2f} {ours} {r['c16_stage_cpu_cores']:12.2f} "
                  f"{r['c16_client_cpu_cores']:13.2f}")
    settings = {"quick": args.quick, "requests_per_point": n, "load_average_at_start": load_at_start,
                "device": args.device, "skipped": skipped}
    if args.only:  # the other cases' figures stay as the last run left them
        path = merge_results(results_name("stage_batching", args.device), figures, {
            **settings, "only": args.only, "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    else:
        path = write_results(results_name("stage_batching", args.device), figures, {"settings": settings})
    print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
