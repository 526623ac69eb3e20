"""Real models at real size: the published layouts mapped, the memory plan against measured peaks, the KV
budget of the transformers AR engines, and the int8 weight path.

    .venv/bin/python bench/real_scale.py [--quick]

Side by side in one run, written to bench/results/real_scale.json:
  hollow.<family>.<component>.unmapped_tensors / .missing_tensors / .mismatched_tensors   the hollow
      layout of the published checkpoint (`omnistage models hollow`: configs and safetensors headers, no
      data) mapped onto each stage's modules on the meta device, as its loader maps it (goal 0 each);
  hollow.<family>.<component>.planned_gib   the memory plan of that stage in the real-size example
      (examples/qwen3-omni-30b-a3b.yaml, qwen2.5-omni-7b.yaml, sd3.5-medium.yaml);
  memory_plan.<family>.<stage>.predicted_over_measured   the plan on the tiny models over the measured
      peak of the stage doing the work the plan sizes (bench/real_scale_memory.py says what is measured);
  kv_budget.*   32 concurrent long requests on a transformers AR stage given KV room for 4: peak held KV
      over the budget, the fraction that completed, tokens/s over the same run unbounded
      (bench/real_scale_kv.py);
  quant.transformers.*   int8 weight-only (torchao) against float32: RSS, tokens/s, output agreement
      (bench/real_scale_quant.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from common import figure, finish, print_table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GIB = float(1 << 30)
# family -> (the real-size example, the model name it points at, {component: the example's stage})
REAL_SIZE = {
    "qwen3_omni": ("qwen3-omni-30b-a3b", "Qwen3-Omni-30B-A3B-Instruct",
                   {"encoder": None, "thinker": "thinker", "talker": "talker", "code2wav": "code2wav"}),
    "qwen2_5_omni": ("qwen2.5-omni-7b", "Qwen2.5-Omni-7B",
                     {"encoder": None, "thinker": "thinker", "talker": "talker", "token2wav": "token2wav"}),
    "sd3": ("sd3.5-medium", "stable-diffusion-3.5-medium",
            {"text_encoder": "text-encoder", "transformer": "denoise", "vae": "vae-decode"}),
}


def hollow_figures(store: Path) -> tuple[list[dict], list[str]]:
    """Map and plan every stage of the three families on their hollow layouts, written under `store`."""
    from omnistage.api import load_pipeline
    from omnistage.checkpoints.hollow import write_hollow
    from omnistage.checkpoints.plan import plan_stage
    from stage_service.engines.mapping import map_stage

    figures, rows = [], []
    for family, (example, model, components) in REAL_SIZE.items():
        write_hollow(family, store / model)
        pipeline = load_pipeline(ROOT / "examples" / f"{example}.yaml")
        for component, stage in components.items():
            maps = map_stage(family, component, store / model)
            key = f"hollow.{family}.{component}"
            counts = {"unmapped": sum(len(m.unmapped) for m in maps), "missing": sum(len(m.missing) for m in maps),
                      "mismatched": sum(len(m.mismatched) for m in maps)}
            figures += [figure(f"{key}.{what}_tensors", n, "tensors") for what, n in counts.items()]
            planned = None
            if stage is not None:
                planned = plan_stage(pipeline, pipeline.stage(stage), store).total_bytes / GIB
                figures.append(figure(f"{key}.planned_gib", planned, "GiB"))
            rows.append(f"  {family:<13} {component:<13} {sum(m.tensors for m in maps):>7} "
                        f"{counts['unmapped']:>9} {counts['missing']:>8} {counts['mismatched']:>11}  "
                        + (f"{planned:>8.2f}" if planned is not None else "       -"))
    return figures, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter runs")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    started = time.perf_counter()
    from real_scale_kv import kv_figures
    from real_scale_memory import memory_figures
    from real_scale_quant import quant_figures

    with tempfile.TemporaryDirectory(prefix="real-scale-") as store:
        hollow, rows = hollow_figures(Path(store))
    print_table("hollow real checkpoints: tensors mapped on the meta device, the real-size examples' plans", hollow)
    print("\n  family        component     tensors  unmapped  missing  mismatched  planned GiB")
    print("\n".join(rows))
    sections = [("memory plan on the tiny models: predicted over measured peak", memory_figures),
                ("KV budget: 32 long requests, KV room for 4", kv_figures),
                ("int8 weight-only (torchao) against float32", quant_figures)]
    figures = list(hollow)
    for title, measure in sections:
        part = measure(args.quick)
        print_table(title, part)
        figures += part
    finish("real_scale", figures, started, {"quick": args.quick})


if __name__ == "__main__":
    main()
