"""Helpers every benchmark shares: machine description, percentiles, the results file, the table."""

from __future__ import annotations

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
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    except Exception:  # noqa: BLE001 - a benchmark without torch still describes the machine
        gpu = ""
    mem = 0
    try:
        mem = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal"))) // 1024
    except (OSError, StopIteration):
        pass
    return {"hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory_mb": mem, "gpu": gpu,
            "python": platform.python_version(), "platform": platform.platform()}


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[min(998, max(0, int(p * 10) - 1))]


def write_results(name: str, figures: list[dict], extra: dict | None = None) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    doc = {"machine": machine(), "figures": figures, **(extra or {})}
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


def print_table(title: str, figures: list[dict]) -> None:
    print(f"\n{title}")
    w = max(len(f["name"]) for f in figures)
    for f in figures:
        print(f"  {f['name']:<{w}}  {f['value']:>12.4g}  {f['unit']}")
