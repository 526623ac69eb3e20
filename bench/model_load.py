"""Loading one component of a published checkpoint: memory, cold start and bytes read, per stage.

    .venv/bin/python bench/model_load.py [--quick]

For every stage of the Qwen3-Omni, Qwen2.5-Omni and SD3 tiny pipelines (each checkpoint in its
published, sharded layout), side by side in one run:
  load.<family>.<component>.rss_over_weights   peak RSS of loading the component's weights over their
      bytes: a fresh process imports the runtime (torch, transformers, diffusers, the engine), then loads
      the stage's model exactly as the stage service does; around every model `from_pretrained` call it
      resets the peak (/proc/self/clear_refs) and takes (peak during the call - RSS before it). The
      whole load's peak (tokenizers, configs and schedulers included) is printed beside it: on tiny
      models those fixed costs dominate (a 152k-entry Qwen tokenizer alone is ~70 MB), on real ones the
      weights do;
  load.<family>.<component>.cold_start_s       a real stage process (`python -m stage_service`) from start
      to SERVING (its ready file written);
  load.<family>.<component>.bytes_read_over_component   bytes the stage read from the shards over the
      component's bytes (where the engine reads through omnistage's shard reader).
  load.marginal_rss_per_weight_byte / load.fixed_rss_per_load_mb   a least-squares line through every
      component's (weight bytes, weight-load peak): the slope is what each further weight byte costs
      (proportional loading: about 1), the intercept the fixed cost of one load, which is what pushes
      the ratio of the smallest tiny components above 1.
Weight bytes come from `omnistage models check`'s plan of the same stage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import figure, print_table, write_results

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ("qwen3-omni-tiny", "qwen2.5-omni-tiny", "sd3-tiny")

# Runs in a fresh interpreter: the runtime first (the baseline), then one stage's load (the peak).
_MEASURE = r"""
import json, os, sys
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch, transformers, diffusers, grpc
import stage_service.server
from omnistage.api import load_pipeline
from stage_service.engines.registry import create_engine
for mod in ("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe",
            "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni",
            "transformers.models.clip.modeling_clip", "diffusers.models.transformers.transformer_sd3",
            "diffusers.models.unets.unet_2d_condition", "diffusers.models.autoencoders.autoencoder_kl"):
    __import__(mod)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

stage_peak = [0]
def reset_peak():
    stage_peak[0] = max(stage_peak[0], status("VmHWM:"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # VmHWM := the current RSS

weight_loads = []   # (peak RSS during one from_pretrained) - (RSS before it)
def measured(owner):
    original = owner.from_pretrained.__func__
    def from_pretrained(cls, *a, **kw):
        reset_peak()
        before = status("VmRSS:")
        out = original(cls, *a, **kw)
        weight_loads.append(status("VmHWM:") - before)
        return out
    owner.from_pretrained = classmethod(from_pretrained)
measured(transformers.PreTrainedModel)
measured(diffusers.ModelMixin)

file, stage, root = sys.argv[1:4]
pipeline = load_pipeline(file)
engine = create_engine(pipeline, pipeline.stage(stage), root)
reset_peak()
stage_peak[0] = base = status("VmRSS:")
engine.load()
reset_peak()
ckpt = getattr(engine, "checkpoint", None)
print(json.dumps({"base": base, "stage_peak": stage_peak[0], "weight_load": sum(weight_loads),
                  "bytes_read": ckpt.stats.bytes if ckpt is not None else None}))
"""


def measure_load(file: Path, stage: str, models: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(file), stage, str(models)], capture_output=True,
                       text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{file.name} {stage}: load failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def cold_start(file: Path, stage: str, models: Path) -> float:
    from omnistage.contract import launch

    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        env = {**os.environ, **launch.service_env(models, same_host=True), "PYTHONPATH": str(ROOT)}
        t0 = time.perf_counter()
        proc = subprocess.Popen(launch.stage_command(file, stage, port=0, model_dir=models, ready_file=ready),
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            while launch.read_ready(ready) is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"{file.name} {stage}: exited {proc.returncode}:\n{proc.stderr.read()[-2000:]}")
                if time.perf_counter() - t0 > 600:
                    raise RuntimeError(f"{file.name} {stage}: not serving after 600 s")
                time.sleep(0.02)
            return time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one cold start per stage instead of three")
    p.add_argument("--models", default=str(ROOT / "models"))
    p.add_argument("--only", action="append", choices=PIPELINES, help="only this pipeline (repeat)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from omnistage.api import load_pipeline
    from omnistage.checkpoints.check import check_pipeline
    from omnistage.tiny_models.build import build_models

    models = Path(args.models).resolve()
    build_models(models, progress=lambda m: None)
    figures, rows = [], []
    for name in args.only or PIPELINES:
        file = ROOT / "examples" / f"{name}.yaml"
        plans, errors = check_pipeline(load_pipeline(file), models)
        if errors:
            raise SystemExit(f"{file}: {errors[0]}")
        for plan in plans:
            family, component = plan.family.split("/")
            m = measure_load(file, plan.stage, models)
            starts = [cold_start(file, plan.stage, models) for _ in range(1 if args.quick else 3)]
            key = f"load.{family}.{component}"
            ratio = m["weight_load"] / plan.weight_bytes
            figures += [figure(f"{key}.rss_over_weights", ratio, "x"),
                        figure(f"{key}.cold_start_s", statistics.median(starts), "s")]
            if m["bytes_read"] is not None:
                figures.append(figure(f"{key}.bytes_read_over_component", m["bytes_read"] / plan.weight_bytes, "x"))
            rows.append({"stage": f"{name}/{plan.stage}", "weights_mb": plan.weight_bytes / 2**20,
                         "weight_load_peak_mb": m["weight_load"] / 2**20,
                         "stage_load_peak_mb": (m["stage_peak"] - m["base"]) / 2**20,
                         "runtime_baseline_mb": m["base"] / 2**20,
                         "bytes_read_mb": None if m["bytes_read"] is None else m["bytes_read"] / 2**20})
    # Across components of every size: RSS per extra weight byte (the slope) and the fixed cost of a
    # load (the intercept): proportional loading means a slope near 1.
    xs, ys = [r["weights_mb"] for r in rows], [r["weight_load_peak_mb"] for r in rows]
    if len(rows) >= 2:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        figures += [figure("load.marginal_rss_per_weight_byte", slope, "x"),
                    figure("load.fixed_rss_per_load_mb", my - slope * mx, "MB")]
    print_table("model load: per stage, each in a fresh process", figures)
    print("\n  stage                         weights MB  weight load MB  whole load MB  runtime MB  read MB")
    for r in rows:
        read = "-" if r["bytes_read_mb"] is None else f"{r['bytes_read_mb']:.2f}"
        print(f"  {r['stage']:<29} {r['weights_mb']:>10.2f} {r['weight_load_peak_mb']:>15.2f} "
              f"{r['stage_load_peak_mb']:>14.2f} {r['runtime_baseline_mb']:>11.1f}  {read}")
    path = write_results("model_load", figures, {"stages": rows, "quick": args.quick})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
