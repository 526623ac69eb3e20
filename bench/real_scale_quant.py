"""int8 weight-only quantization of a transformers AR stage (`quantization: int8`,
stage_service/runtime/quantize.py) against the same stage in float32, at a realistic width.

The tiny LM (hidden 256) is too small for int8 to show anything: its fixed costs dwarf its weights. So a
Qwen2 causal LM is built here from the tiny LM's config class at Qwen2.5-1.5B's layer width (hidden 1536,
MLP 8960, 12 heads, 2 KV heads) with 2 of its 28 layers, a 32k vocabulary and an untied head (`SIZE`):
about 192M parameters, 0.77 GB in float32, of which the 2 layers and the head (the Linear layers int8
quantizes) are 143M and the input embedding (kept in the dtype) 49M. Random weights (seeded), saved in the
published layout (sharded safetensors with their index, config, the tiny LM's tokenizer) to a temp dir.

    quant.transformers.rss_over_float   RSS growth of loading the stage with quantization int8 (dtype float32)
        over the same in float32, each in a fresh process that builds the engine as the stage service does
        (`create_engine`, `engine.load()`) after importing the runtime (torchao too, in both: transformers
        imports it whenever it is installed), then reads every weight once, as the first request does (a
        float checkpoint loads as a memory map: its pages join the RSS when read);
    quant.transformers.rss_over_bf16    the same with dtype bfloat16: int8 over unquantized;
    quant.transformers.tokens_per_s_over_float   greedy decode of a batch of `BATCH` prompts, int8 tokens/s
        over float32's, both models in one process, stepped by the engine's step code (`DecoderLm`, batch
        invariance on, as the stage runs by default), runs alternated, the median of each;
    quant.transformers.top1_agreement   the fraction of int8's greedy tokens equal to float32's, position by
        position (after a first difference the two continuations part, so this is strict);
    quant.transformers.prompt_top1_agreement   the fraction of prompt positions whose next-token choice
        (argmax) is the same under int8 as under float32, on the same context (teacher-forced);
    quant.transformers.logit_max_abs_drift   the largest |int8 logit - float32 logit| over those positions
        (the float32 logits' own largest magnitude is printed beside it, for scale).
Random weights give nearly flat logits, where a small drift flips the top token far more easily than on
trained weights: the agreement figures are a floor, not what a real checkpoint loses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import figure

ROOT = Path(__file__).resolve().parent.parent
TINY_LM = ROOT / "models" / "qwen2-tiny"
MODEL = "qwen2-1.5b-width"  # the model's directory under the temp model root
# Qwen2.5-1.5B's layer width, 2 of its 28 layers, a 32k vocabulary, an untied head (see the docstring).
SIZE = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 2, "num_attention_heads": 12,
        "num_key_value_heads": 2, "vocab_size": 32000, "max_position_embeddings": 4096,
        "tie_word_embeddings": False}
BATCH, PROMPT_TOKENS = 4, 32
CHILD_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "TRANSFORMERS_VERBOSITY": "error"}
CHILD_TIMEOUT_S = 600

# A fresh interpreter: the runtime imported (the baseline), then one stage's load as the stage service does it.
_LOAD = r"""
import gc, json, sys
import torch, transformers, torchao.quantization
import stage_service.server
from omnistage.api import parse_pipeline
from stage_service.engines.registry import create_engine

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

pipeline = parse_pipeline(json.loads(sys.argv[1]))
engine = create_engine(pipeline, pipeline.stage("llm"), sys.argv[2])
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")   # VmHWM := the current RSS
before = status("VmRSS:")
engine.load()
for t in engine.lm.model.state_dict().values():   # every weight byte read once, as the first request does
    for part in (getattr(t, "qdata", t), getattr(t, "scale", None)):
        if part is not None:
            part.sum()
gc.collect()
print(json.dumps({"growth": status("VmRSS:") - before, "peak_growth": status("VmHWM:") - before}))
"""

# A fresh interpreter: both models, the float32 one and the int8 one, loaded and stepped side by side.
_SIDE_BY_SIDE = r"""
import json, statistics, sys, time
import torch
from transformers import AutoModelForCausalLM
from stage_service.engines.transformers.lm_steps import DecoderLm
from stage_service.runtime.quantize import quantize_weights
from stage_service.runtime.sampling import SamplingSettings

path, batch, prompt_tokens, tokens, repeat = sys.argv[1], *map(int, sys.argv[2:6])
gen = torch.Generator().manual_seed(1)
prompts = torch.randint(4, 500, (batch, prompt_tokens), generator=gen)   # ids the tiny tokenizer knows
as_float = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)      # as CausalLmEngine.load
as_int8 = quantize_weights(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "int8")
with torch.inference_mode():
    lf, lq = as_float(prompts).logits, as_int8(prompts).logits
out = {"logit_drift": (lq - lf).abs().max().item(), "logit_max": lf.abs().max().item(),
       "prompt_top1": (lq.argmax(-1) == lf.argmax(-1)).float().mean().item()}
del lf, lq
lms = {"float32": DecoderLm(as_float), "int8": DecoderLm(as_int8)}

def decode(lm, n):
    states = [lm.new_state(p.tolist(), SamplingSettings(temperature=0.0), n) for p in prompts]
    started, live = time.perf_counter(), states
    while live:
        lm.step_batch(live)
        live = [s for s in live if not s.finished]
    return time.perf_counter() - started, [s.generated for s in states]

for lm in lms.values():
    decode(lm, 2)   # warm-up: first-call allocations and kernel choices
seconds, tokens_of = {k: [] for k in lms}, {}
for _ in range(repeat):
    for name, lm in lms.items():
        s, tokens_of[name] = decode(lm, tokens)
        seconds[name].append(s)
out["tokens_per_s"] = {k: batch * tokens / statistics.median(v) for k, v in seconds.items()}
pairs = [(a, b) for fa, qa in zip(tokens_of["float32"], tokens_of["int8"]) for a, b in zip(fa, qa)]
out["greedy_top1"] = sum(a == b for a, b in pairs) / len(pairs)
print(json.dumps(out))
"""


def _run(code: str, *args: str) -> dict:
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                       timeout=CHILD_TIMEOUT_S)
    if r.returncode != 0:
        raise RuntimeError(f"real_scale_quant: a child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def build_model(root: Path) -> Path:
    """The realistic-width LM (`SIZE`, random weights, seeded) in the published layout under `root`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = root / MODEL
    tiny = json.loads((TINY_LM / "config.json").read_text())
    keep = {k: tiny[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "rms_norm_eps", "rope_parameters")}
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**keep, **SIZE)).eval()
    model.save_pretrained(path, max_shard_size="300MB")   # sharded, with its index, as published
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(TINY_LM / name, path / name)
    return path


def stage_doc(**entry) -> dict:
    """A one-stage pipeline serving the built model on the transformers engine, with these deployment fields."""
    import yaml

    doc = yaml.safe_load((ROOT / "examples" / "llm-tiny.yaml").read_text())
    stage = doc["spec"]["topology"]["stages"][0]
    stage.update(engine="transformers", model=MODEL)
    doc["spec"]["deployment"]["stages"]["llm"].update(engineArgs={}, **entry)
    return doc


def quant_figures(quick: bool) -> list[dict]:
    """The figures (see the module docstring); quick: fewer decoded tokens and one timed run of each."""
    tokens, repeat = (16, 1) if quick else (64, 3)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="real-scale-quant-") as tmp:
        root = Path(tmp)
        path = build_model(root)
        loads = {(dtype, method): _run(_LOAD, json.dumps(stage_doc(dtype=dtype, **({"quantization": method} if method
                                                                                  else {}))), str(root))
                 for dtype in ("float32", "bfloat16") for method in ("", "int8")}
        side = _run(_SIDE_BY_SIDE, str(path), str(BATCH), str(PROMPT_TOKENS), str(tokens), str(repeat))
    mib = {k: v["growth"] / 2**20 for k, v in loads.items()}
    tps = side["tokens_per_s"]
    peak = {k: v["peak_growth"] / 2**20 for k, v in loads.items()}
    print("\n  quant: RSS growth of the load, MiB (its peak): " + ", ".join(
        f"{dtype}{' int8' if method else ''} {mib[dtype, method]:.0f} ({peak[dtype, method]:.0f})"
        for dtype, method in loads))
    print(f"  greedy tokens/s at batch {BATCH}: float32 {tps['float32']:.1f}, int8 {tps['int8']:.1f}; float32 logits' "
          f"largest magnitude {side['logit_max']:.3g}; {time.perf_counter() - started:.0f} s")
    return [figure("quant.transformers.rss_over_float", mib["float32", "int8"] / mib["float32", ""], "x"),
            figure("quant.transformers.rss_over_bf16", mib["bfloat16", "int8"] / mib["bfloat16", ""], "x"),
            figure("quant.transformers.tokens_per_s_over_float", tps["int8"] / tps["float32"], "x"),
            figure("quant.transformers.top1_agreement", side["greedy_top1"], "fraction"),
            figure("quant.transformers.prompt_top1_agreement", side["prompt_top1"], "fraction"),
            figure("quant.transformers.logit_max_abs_drift", side["logit_drift"], "logit")]
