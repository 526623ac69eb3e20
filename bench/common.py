"""Helpers every benchmark shares: machine description, percentiles, the results file, the table."""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = gpu_description()
    mem = 0
    try:
        mem = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal"))) // 1024
    except (OSError, StopIteration):
        pass
    return {"hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory_mb": mem, "gpu": gpu,
            "python": platform.python_version(), "platform": platform.platform()}


def gpu_description() -> str:
    """The first GPU as "<model>, driver <version>, CUDA <torch's CUDA>" ("" without one)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return ""
        name = torch.cuda.get_device_name(0)
        cuda = torch.version.cuda or "?"
    except Exception:  # noqa: BLE001 - a benchmark without torch still describes the machine
        return ""
    driver = "?"
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        driver = out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else "?"
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return f"{name}, driver {driver}, CUDA {cuda}"


DEVICES = ("cpu", "cuda")


def add_device_argument(ap) -> None:
    ap.add_argument("--device", choices=DEVICES, default="cpu",
                    help="cuda: every stage that can runs on the first GPU (results under bench/results/gpu/)")


def require_device(device: str) -> None:
    """Exit with one line when `device` is cuda and this machine has none."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")


def results_name(name: str, device: str) -> str:
    """Where a benchmark run on `device` writes: bench/results/NAME.json, or gpu/NAME.json on CUDA."""
    return f"gpu/{name}" if device == "cuda" else name


@functools.cache
def engine_available(engine: str) -> bool:
    """Whether a stage engine's library imports here (the GPU check's machine has no vLLM; a library whose
    own dependencies are too old there does not count either). Imported in a child process: vLLM's import
    alone starts threads this process should not carry."""
    import subprocess

    module = {"vllm": "vllm", "diffusers": "diffusers", "transformers": "transformers"}[engine]
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def exit_on_sigterm() -> None:
    """SIGTERM (a `timeout` bound) exits through Python, so `finally` blocks stop the stage processes this
    benchmark started (they run in sessions of their own, out of the signal's reach)."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))


def on_gpu(doc: dict, fraction: float = 0.0, dtype: str | None = None) -> dict:
    """`doc` (a pipeline file) with every stage on one GPU: `gpus: 1`, sharing it with `fraction` each
    (0: the whole GPU) and `dtype` when given. Returns the doc."""
    for sd in doc["spec"]["deployment"]["stages"].values():
        sd["gpus"] = 1
        if fraction:
            sd["gpuMemoryFraction"] = fraction
        if dtype:
            sd["dtype"] = dtype
    return doc


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[min(998, max(0, int(p * 10) - 1))]


def write_results(name: str, figures: list[dict], extra: dict | None = None) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine(), "figures": figures, **(extra or {})}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def merge_results(name: str, figures: list[dict], run: dict) -> Path:
    """A partial run (some cases only) into the results file: its figures replace those of the same name,
    the others stay, and `run` (what ran, when, the load) is listed under `partial_runs`."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return write_results(name, figures, {"partial_runs": [run]})
    doc = json.loads(path.read_text())
    fresh = {f["name"] for f in figures}
    doc["figures"] = [f for f in doc.get("figures", []) if f["name"] not in fresh] + figures
    doc.setdefault("partial_runs", []).append({**run, "machine": machine()})
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def finish(name: str, figures: list[dict], started: float, extra: dict) -> Path:
    """Write the results file with the run's wall time (from `time.perf_counter()` at `started`) and say where."""
    import time

    runtime = time.perf_counter() - started
    path = write_results(name, figures, {**extra, "runtime_s": round(runtime, 1)})
    print(f"\nruntime {runtime:.0f}s; wrote {path}")
    return path


def figure(name: str, value: float, unit: str) -> dict:
    return {"name": name, "value": round(float(value), 4), "unit": unit}


def on_off_figures(prefix: str, on: list[float], off: list[float]) -> list[dict]:
    """Requests/s with a feature on and off, measured in alternating rounds: PREFIX.rps_on, .rps_off,
    .overhead_rps_over_off (all rounds) and its median over round pairs (each round's on over the off just
    before it: a burst of other work on the machine moves one pair, not the median)."""
    return [figure(f"{prefix}.rps_off", sum(off) / len(off), "req/s"),
            figure(f"{prefix}.rps_on", sum(on) / len(on), "req/s"),
            figure(f"{prefix}.overhead_rps_over_off", sum(on) / sum(off), "ratio"),
            figure(f"{prefix}.overhead_rps_over_off_median_round",
                   statistics.median(a / b for a, b in zip(on, off)), "ratio")]


def run_measure(name: str, title: str, measure, extra: dict) -> None:
    """A benchmark's `main`: `--quick`, its `measure(quick)`, the table, bench/results/NAME.json."""
    import argparse

    ap = argparse.ArgumentParser(description=title)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    figures = measure(args.quick)
    print_table(title, figures)
    write_results(name, figures, {"quick": args.quick, **extra})


def print_table(title: str, figures: list[dict]) -> None:
    print(f"\n{title}")
    w = max(len(f["name"]) for f in figures)
    for f in figures:
        print(f"  {f['name']:<{w}}  {f['value']:>12.4g}  {f['unit']}")


async def sse_chunks(http, path: str, body: dict):
    """The JSON chunks of a streamed (SSE) answer to `body` POSTed to `path` over an httpx.AsyncClient; an
    answer other than 200 raises, quoting it."""
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])
