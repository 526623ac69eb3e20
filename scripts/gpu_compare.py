"""Serve every example whose engines are installed twice, on the CPU and with every stage on the GPU, and
check one request each: the same text tokens (greedy, fixed seed), audio within a tolerance (the same codec
codes make the same waveform up to float rounding; other codes make another one), images within a tolerance.

The GPU side runs in float32 with TF32 off (NVIDIA_TF32_OVERRIDE=0), so that it computes what the CPU does;
every stage asks for one GPU and shares the first one (a fraction of its memory each).

    python scripts/gpu_compare.py [--examples a,b] [--gpu-device cuda|cpu] [--models models]

`--gpu-device cpu` runs the second side with `gpus: 1, device: cpu` (a dry run of this script where there is
no GPU: the comparison must then be exact; nothing is written). Prints a table and writes
bench/results/gpu/examples.json.
"""

from __future__ import annotations

import argparse
import copy
import io
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from common import engine_available, figure, on_gpu, print_table, write_results  # noqa: E402

# One request per example: greedy text (and speech) or a seeded image.
SPEECH = {"prompt": "Tell me about the harbour at night.", "max_tokens": 12, "temperature": 0.0, "seed": 7,
          "max_codec_frames": 24}
HEARD = {"language": "en", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}  # with heard_clip()
IMAGE = {"prompt": "a lighthouse on a cliff", "width": 32, "height": 32, "num_inference_steps": 4, "seed": 7}
AUDIO_TOLERANCE = 64        # int16 units (0.2 % of full scale): rounding, not another codec code
IMAGE_TOLERANCE = 4.0       # mean absolute difference of 8-bit pixel values
UNITS = {"tokens_equal": "bool", "tokens": "tokens", "first_differing_token": "index", "failed": "bool",
         "gpu_seconds": "s", "cpu_seconds": "s", "ok": "bool",
         "audio_samples_equal_length": "bool", "audio_max_abs_diff": "int16", "image_mean_abs_diff": "levels"}


LIVE: dict = {}  # pipelines being served (by id: a LocalPipeline is not hashable), stopped on SIGTERM


def stop_all_and_exit(*_) -> None:
    """A bound's SIGTERM: stop every pipeline still served (their processes run in sessions of their own)."""
    for local in list(LIVE.values()):
        local.stop(grace=5)
    os._exit(124)


def request_for(doc: dict) -> dict:
    from omnistage.api import accepted_inputs, parse_pipeline

    modalities = {o["modality"] for o in doc["spec"]["topology"].get("outputs", [])}
    if "image" in modalities:
        return IMAGE
    if "text" not in accepted_inputs(parse_pipeline(doc)):  # speech recognition: a seeded clip to transcribe
        return {**HEARD, "parts": [heard_clip()]}
    return SPEECH


def heard_clip():
    """Two seconds of seeded noise at 16 kHz as a WAV audio part (float samples: decoded exactly on both sides)."""
    import soundfile

    from omnistage.v1 import common_pb2

    buf = io.BytesIO()
    samples = (0.2 * np.random.default_rng(7).standard_normal(32000)).astype(np.float32)
    soundfile.write(buf, samples, 16000, format="WAV", subtype="FLOAT")
    return common_pb2.ContentPart(audio=common_pb2.AudioPart(data=buf.getvalue()))


def serve_and_ask(doc: dict, models: Path) -> dict:
    from omnistage.api import parse_pipeline
    from omnistage.client import OmniClient
    from omnistage.local.serve import LocalPipeline

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        local = LocalPipeline(path, parse_pipeline(doc), models, progress=lambda m: None)
        LIVE[id(local)] = local
        try:
            endpoint = local.start()
            t0 = time.perf_counter()
            with OmniClient(endpoint) as client:
                r = client.generate(timeout=120, **request_for(doc))
            return {"tokens": list(r.token_ids), "text": r.text, "pcm": bytes(r.pcm),
                    "images": [im.png for im in r.images], "seconds": time.perf_counter() - t0}
        finally:
            local.stop()
            LIVE.pop(id(local), None)


def pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)


def compare(cpu: dict, gpu: dict) -> dict:
    """What differs between the two answers, as numbers; `ok` when within the tolerances."""
    out = {"tokens_equal": float(cpu["tokens"] == gpu["tokens"]),
           "tokens": len(cpu["tokens"]), "gpu_seconds": gpu["seconds"], "cpu_seconds": cpu["seconds"]}
    if cpu["tokens"] != gpu["tokens"]:  # where they part (a near-tie on random weights, or a real difference)
        out["first_differing_token"] = next((i for i, (a, b) in enumerate(zip(cpu["tokens"], gpu["tokens"]))
                                             if a != b), min(len(cpu["tokens"]), len(gpu["tokens"])))
    ok = bool(out["tokens_equal"])
    if cpu["pcm"] or gpu["pcm"]:
        a, b = (np.frombuffer(x, dtype="<i2").astype(np.int64) for x in (cpu["pcm"], gpu["pcm"]))
        out["audio_samples_equal_length"] = float(len(a) == len(b))
        out["audio_max_abs_diff"] = float(np.abs(a - b).max()) if len(a) == len(b) and len(a) else float("inf")
        ok = ok and out["audio_max_abs_diff"] <= AUDIO_TOLERANCE
    if cpu["images"] or gpu["images"]:
        same = len(cpu["images"]) == len(gpu["images"]) and all(
            pixels(x).shape == pixels(y).shape for x, y in zip(cpu["images"], gpu["images"]))
        out["image_mean_abs_diff"] = (max(float(np.abs(pixels(x) - pixels(y)).mean())
                                          for x, y in zip(cpu["images"], gpu["images"])) if same else float("inf"))
        ok = ok and out["image_mean_abs_diff"] <= IMAGE_TOLERANCE
    out["ok"] = float(ok)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", default="", help="comma-separated example names (default: every tiny example)")
    ap.add_argument("--gpu-device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--models", default=str(ROOT / "models"))
    ap.add_argument("--parallel", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 4)),
                    help="examples served at once (default: a quarter of the cores, at most 4)")
    args = ap.parse_args()
    tiny = sorted(p.stem for p in (ROOT / "examples").glob("*-tiny.yaml"))  # the real-size ones need their weights
    names = args.examples.split(",") if args.examples else tiny
    if args.gpu_device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA device here: use --gpu-device cpu for a dry run")
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"   # float32 matmuls and convolutions as the CPU computes them
    signal.signal(signal.SIGTERM, stop_all_and_exit)
    skipped, runnable = {}, []
    for name in names:
        doc = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
        missing = sorted({s["engine"] for s in doc["spec"]["topology"]["stages"]} - {
            e for e in ("vllm", "transformers", "diffusers") if engine_available(e)})
        if missing:
            skipped[name] = f"engine {', '.join(missing)} not available"
            print(f"{name}: skipped ({skipped[name]})", flush=True)
        else:
            runnable.append((name, doc))
    results: dict[str, dict] = {}
    extra = {"skipped": skipped, "tolerances": {"audio_max_abs_diff": AUDIO_TOLERANCE,
                                                "image_mean_abs_diff": IMAGE_TOLERANCE}}

    def one(name: str, doc: dict) -> None:
        try:
            cpu = serve_and_ask(doc, Path(args.models))
            gpu = serve_and_ask(placed(doc, args.gpu_device), Path(args.models))
            result = compare(cpu, gpu)
        except Exception as e:  # noqa: BLE001 - one example's failure is reported, the others still run
            result = {"ok": 0.0, "failed": 1.0}
            extra.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
        results[name] = result
        print(f"{name}: {'ok' if result['ok'] else 'DIFFERS' if 'failed' not in result else 'FAILED'} "
              f"{result} {extra.get('errors', {}).get(name, '')}", flush=True)
        figures = [figure(f"{n}.{k}", v, UNITS[k]) for n, r in sorted(results.items()) for k, v in r.items()]
        if args.gpu_device == "cuda":  # after every example: a bound reached later keeps what was measured
            write_results("gpu/examples", figures, extra)

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        for f in [pool.submit(one, name, doc) for name, doc in runnable]:
            f.result()
    figures = [figure(f"{n}.{k}", v, UNITS[k]) for n, r in sorted(results.items()) for k, v in r.items()]
    if figures:
        print_table(f"CPU against {args.gpu_device} (float32, greedy, seed {SPEECH['seed']})", figures)
    if args.gpu_device == "cuda":
        print(f"wrote {ROOT / 'bench' / 'results' / 'gpu' / 'examples.json'}")
    return 0 if results and all(r["ok"] for r in results.values()) else 1


def placed(doc: dict, device: str) -> dict:
    """The example with every stage on one shared GPU in float32 (`device: cpu` too for the dry run)."""
    n = len(doc["spec"]["deployment"]["stages"])
    out = on_gpu(copy.deepcopy(doc), fraction=round(0.9 / n, 2) if device == "cuda" else 0.0, dtype="float32")
    if device == "cpu":
        for sd in out["spec"]["deployment"]["stages"].values():
            sd["device"] = "cpu"
    return out


if __name__ == "__main__":
    sys.exit(main())
