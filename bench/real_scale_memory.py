"""Peak memory of a stage doing the work its memory plan sizes, on the tiny models, against the plan.

For each stage it can drive (`CASES`), a FRESH process (`python bench/real_scale_memory.py --child ...`;
stages never share a heap) builds the stage's engine as the stage server does (`create_engine`,
`device.apply`, `engine.load()`; in-process, not `engine_process`), then calls its synchronous step
function directly with the batch the plan sizes: for an AR stage `scheduler.maxBatch` sequences of random
prompt ids, all joining in the first step (one packed prefill of every prompt, the largest step the
engine runs), each with prompt + max_tokens = the plan's context (`engineArgs.max_model_len`, set to
`context` in the pipeline the plan reads too), greedy and ignoring EOS so every sequence reaches it; Qwen3-Omni's Talker
likewise, its prompt rows and text rows random Thinker rows (`_talker_steps`); for Qwen3-Omni's Code2Wav the
largest step its scheduler runs (`_audio_chunk_steps`); Qwen2.5-Omni's Talker as Qwen3-Omni's, its Token2Wav
at the steady window of as many chunks as a step takes (`_speech_chunk_steps`); the diffusers stages at
maxBatch requests of the example's default image side and guidance (`_prompt_steps`, `_denoise_steps`,
`_latents_steps`; SD's UNet and VAE too, without --quick). The plan is `plan_stage` of that same pipeline.
A diffusers stage's tokenizers, and every component class its pipeline names, are loaded before the
baseline, as a transformers stage's tokenizer is (`_tokenizers_loaded_before`).

What is measured (CPU only): the bytes in use by the C allocator, glibc `mallinfo2()`'s `uordblks` (in use
in every arena) + `hblkhd` (in mmapped chunks), minus the same reading taken right before `engine.load()`,
plus the engine's weights that are views of a mapped safetensors file (`mapped_weights_bytes`: a float32
shard loaded in float32 is not copied, so malloc never sees it). It is read after the load, after every
torch operator (`sampling_every_op`) and after every step; the peak is the largest reading. That covers
every torch CPU tensor (torch's CPU allocator is malloc): weights, KV caches, activations, logits, the
math library's buffers; and whatever else the load and the steps malloc: Python objects over 512 bytes,
configs, the processor's feature extractor.
What is not: Python's small objects (pymalloc's arenas are mmapped outside malloc); the tokenizer (loaded
before the baseline and handed to the engine, `_tokenizers_loaded_before`: a 152k-entry Qwen tokenizer's
heap is tens of MB, more than the tiny weights, and lives in host memory beside any GPU); memory a torch
operator frees before it returns (its internal workspace); the process's runtime (interpreter, libraries);
memory malloc keeps after a free (fragmentation, the top of the heap): the reading is what the stage's
objects hold, not the process's RSS. `MALLOC_ARENA_MAX` and `MALLOC_MMAP_THRESHOLD_` are left alone: they
move freed memory, not memory in use, and runs agree within 0.1 MB with or without them.

    memory_plan.<family>.<stage>.predicted_over_measured   the plan's total over the measured peak
    memory_plan.<family>.<stage>.measured_mib / .predicted_mib
    memory_plan.<family>.<stage>.kv_held_over_planned      the KV the engine's caches held at most (spare
        room included) over the plan's KV
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml
from common import figure, print_table

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MIB = float(1 << 20)
QUICK_CONTEXT, FULL_CONTEXT = 256, 512  # engineArgs.max_model_len, for the run and the plan
MAX_TOKENS = 8  # generated per sequence: the prompt fills the rest of the context (its prefill is the peak)
CHILD_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "TRANSFORMERS_VERBOSITY": "error"}
CHILD_TIMEOUT_S = 600


def _transformers_engine(stage: str) -> Callable[[dict], None]:
    def edit(doc: dict) -> None:
        next(s for s in doc["spec"]["topology"]["stages"] if s["name"] == stage)["engine"] = "transformers"
    return edit


@dataclass(frozen=True)
class Case:
    family: str    # as the family registry names it
    example: str   # examples/<example>.yaml
    stage: str
    drive: str = "ar"  # which of DRIVERS runs the stage's work
    edit: Callable[[dict], None] | None = None  # beyond the context: what makes the example drivable here
    full_only: bool = False  # a second model of a kind already measured: run without --quick only


CASES = (
    Case("causal_lm", "llm-tiny", "llm", edit=_transformers_engine("llm")),  # vLLM in the example
    Case("qwen3_omni", "qwen3-omni-tiny", "thinker"),
    Case("qwen2_5_omni", "qwen2.5-omni-tiny", "thinker"),
    Case("qwen3_omni", "qwen3-omni-tiny", "talker", drive="talker"),
    Case("qwen3_omni", "qwen3-omni-tiny", "code2wav", drive="audio_chunks"),
    Case("qwen2_5_omni", "qwen2.5-omni-tiny", "talker", drive="talker"),
    Case("qwen2_5_omni", "qwen2.5-omni-tiny", "token2wav", drive="speech_chunks"),
    Case("sd3", "sd3-tiny", "text-encoder", drive="prompts"),
    Case("sd3", "sd3-tiny", "denoise", drive="denoise"),
    Case("sd3", "sd3-tiny", "vae-decode", drive="latents"),
    Case("sd", "text-to-image-tiny", "denoise", drive="denoise", full_only=True),  # a UNet: the estimate, not modelled
    Case("sd", "text-to-image-tiny", "vae-decode", drive="latents", full_only=True),  # checks sd3's VAE factor
)


def case_pipeline(case: Case, context: int):
    """The example with the case's edit, the stage in-process and its context set to `context`."""
    from omnistage.api import parse_pipeline

    doc = yaml.safe_load((EXAMPLES / f"{case.example}.yaml").read_text())
    if case.edit:
        case.edit(doc)
    args = doc["spec"]["deployment"]["stages"][case.stage].setdefault("engineArgs", {})
    if next(s for s in doc["spec"]["topology"]["stages"] if s["name"] == case.stage)["kind"] == "ar":
        args["max_model_len"] = context
    args["engine_process"] = False
    return parse_pipeline(doc)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


class HeapMeter:
    """Bytes in use by glibc malloc (`uordblks + hblkhd`), and the largest reading taken."""

    def __init__(self) -> None:
        self._mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
        self._mallinfo2.restype = _Mallinfo2
        self.peak = 0

    def reading(self) -> int:
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def sample(self) -> None:
        self.peak = max(self.peak, self.reading())


def sampling_every_op(meter: HeapMeter):
    """A torch dispatch mode that reads `meter` after every torch operator returns (its output and inputs
    alive). Module ends alone (a forward hook) miss transients inside a forward: the MoE experts'
    down-projection weights gathered while the gate-up ones are still held (+32 MB on the Qwen3-Omni tiny
    Thinker), or a gated MLP's four [tokens, intermediate] tensors alive at its product."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class EveryOp(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            meter.sample()
            return out

    return EveryOp()


def _models_of(engine, depth: int = 4) -> list:
    """The torch modules an engine holds: reached through its attributes (and lists, tuples, dicts of
    them), `depth` levels down. Not `gc.get_objects()`: probing every object imports lazy modules, which
    would malloc in the middle of the measurement."""
    import torch

    found, seen, level = [], set(), [engine]
    for _ in range(depth):
        nxt = []
        for obj in level:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.nn.Module):
                found.append(obj)
            elif isinstance(obj, (list, tuple)):
                nxt += obj
            elif isinstance(obj, dict):
                nxt += obj.values()
            elif hasattr(obj, "__dict__") and not isinstance(obj, type):
                nxt += vars(obj).values()
        level = nxt
    return found


def mapped_weights_bytes(engine) -> int:
    """Bytes of the engine's parameters and buffers whose storage is a view of a mapped file (a safetensors
    shard loaded in its stored dtype is not copied): malloc does not see them."""
    files = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) > 5 and fields[5].startswith("/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                files.append((start, end))
    storages = {}
    for model in _models_of(engine):
        for t in (*model.parameters(), *model.buffers()):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(n for ptr, n in storages.items() if any(a <= ptr < b for a, b in files))


def _tokenizers_loaded_before(model_dir: Path) -> None:
    """Load the stage's tokenizers before the baseline reading and hand the engine those instances when it
    asks for them: their heap is the tokenizer's, not the stage's work, so it stays out of the measurement.
    A diffusers component folder: its pipeline's `tokenizer*` components (none but the text encoder's
    stage reads them); else the checkpoint's own tokenizer."""
    from stage_service.engines.diffusers.layout import MODEL_INDEX, PipelineDir

    if (model_dir.parent / MODEL_INDEX).is_file():
        pipe = PipelineDir(model_dir)
        loaded: dict = {}
        original = PipelineDir.load

        def cached_component(self, component, *args, **kwargs):
            if not component.startswith("tokenizer"):
                return original(self, component, *args, **kwargs)
            if (self.root, component) not in loaded:
                loaded[self.root, component] = original(self, component, *args, **kwargs)
            return loaded[self.root, component]

        PipelineDir.load = cached_component
        for component in pipe.index:
            if pipe.has(component):  # the classes imported before the baseline too: imports are not the stage's
                pipe.component_class(component)
                if component.startswith("tokenizer"):
                    pipe.load(component)
        return
    from transformers import AutoTokenizer

    loaded = {}
    original_tokenizer = AutoTokenizer.from_pretrained.__func__

    def cached(cls, path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in loaded:
            loaded[key] = original_tokenizer(cls, path, *args, **kwargs)
        return loaded[key]

    AutoTokenizer.from_pretrained = classmethod(cached)
    AutoTokenizer.from_pretrained(model_dir)


def _ar_steps(engine, pipeline, batch: int, context: int):
    """AR: `batch` sequences of prompt + MAX_TOKENS = `context` tokens, all joining in the first step, stepped
    until every one finishes; yields after each step the KV bytes the sequences hold."""
    from omnistage.contract.params import RequestParams

    rng = random.Random(0)
    prompt = context - MAX_TOKENS
    stop = getattr(engine, "stop_ids", frozenset())
    params = RequestParams(prompt="", prompt_token_ids=(), seed=0, max_tokens=MAX_TOKENS, temperature=None,
                           top_p=None, top_k=None, ignore_eos=True, max_codec_frames=0, speaker="", width=0,
                           height=0, num_inference_steps=0, guidance_scale=0.0, negative_prompt="")
    ids = [[t for t in (rng.randrange(engine.vocab) for _ in range(2 * prompt)) if t not in stop][:prompt]
           for _ in range(batch)]
    yield from _step_until_done(engine, [engine.new_state(x, params) for x in ids])


def _step_until_done(engine, states: list):
    """Step `states` together until every one finishes; yields after each step the bytes they hold."""
    from stage_service.runtime.errors import RequestFailed

    live = list(states)
    while live:
        failed = [r for r in engine.step(live) if isinstance(r, RequestFailed)]
        if failed:
            raise RuntimeError(f"{engine.stage.name}: a step failed: {failed[0]}")
        yield sum(st.held_bytes() for st in states)
        for st in live:
            if st.finished:
                st.release()  # as the scheduler does when a state finishes
        live = [st for st in live if not st.finished]


def _audio_chunk_steps(engine, pipeline, batch: int, context: int):
    """Codec frames to audio (Qwen3-Omni's Code2Wav): the largest step the scheduler lets it run: as many
    chunks (the upstream stage's chunkSize of random codes after LEFT_CONTEXT frames of history) as both
    maxBatch and the engine's frames per step allow, in one forward; yields once (no KV: 0)."""
    import torch

    c2w = engine.c2w
    chunk = pipeline.stage(engine.stage.inputs[0].source).chunk_size
    frames = c2w.LEFT_CONTEXT + chunk
    bound = engine.max_step_cost() or frames * batch
    gen = torch.Generator().manual_seed(0)
    states = [c2w.chunk_state(*(torch.randint(engine.codebook, (c2w.groups, n), generator=gen)
                                for n in (c2w.LEFT_CONTEXT, chunk)))
              for _ in range(max(1, min(batch, bound // frames)))]
    engine.step(states)
    yield 0


def _talker_steps(engine, pipeline, batch: int, context: int):
    """An omni Talker: `batch` requests joining in one step, each prefilling a Thinker prompt whose user turn
    fills the context but for the Talker's own prompt rows and MAX_TOKENS frames (random Thinker rows,
    MAX_TOKENS more text rows, then the end of the text), stepped until every one finishes; yields after
    each step the KV bytes the requests hold. Qwen3-Omni's Talker reads the chat turns of its prompt
    (`im_start`); Qwen2.5-Omni's takes any ids."""
    import torch

    from stage_service.engines.omni.inbox import END_OF_TEXT
    from stage_service.runtime.sampling import SamplingSettings

    talker = engine.talker
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    chat = hasattr(talker, "im_start")
    user = context - MAX_TOKENS - talker.prompt_rows_beyond_ids
    config = talker.model.config
    width = getattr(config, "thinker_hidden_size", None) or config.embedding_size
    avoid = {*talker.multimodal_ids.tolist(), *((talker.im_start,) if chat else ())}
    speaker = "ethan" if "ethan" in talker.speakers else next(iter(talker.speakers))
    states = []
    for _ in range(batch):
        turn = [t for t in (rng.randrange(2 * user) for _ in range(2 * user)) if t not in avoid]
        ids = ([talker.im_start, talker.user_id, *turn[:user - 2], talker.im_start, talker.assistant_id, turn[0]]
               if chat else turn[:user + 1])
        rows = [0.02 * torch.randn(len(ids) + 1 + MAX_TOKENS, width, generator=gen, dtype=engine.dtype)
                for _ in range(2)]  # Thinker embeds and hidden: the prompt's, the first token's, then text rows
        n = len(ids)
        st = talker.new_state(ids, rows[0][:n + 1], rows[1][:n + 1],
                              SamplingSettings(repetition_penalty=engine.REPETITION_PENALTY), MAX_TOKENS, speaker)
        st.inbox.extend([engine.spoken_rows(rows[0][n + 1:], rows[1][n + 1:]), END_OF_TEXT])
        states.append(st)
    yield from _step_until_done(engine, states)


def _speech_chunk_steps(engine, pipeline, batch: int, context: int):
    """Codec tokens to audio (Qwen2.5-Omni's Token2Wav): requests whose tokens arrive chunkSize (the Talker's)
    at a time, as many as both maxBatch and the engine's tokens per step allow at the steady window (earlier
    blocks + the chunk + later blocks), each round's chunks in one step; the third round is the steady
    window, the largest a stream keeping up makes. Yields after each round (no KV: 0)."""
    import torch

    t2w = engine.t2w
    chunk = pipeline.stage(engine.stage.inputs[0].source).chunk_size
    window = t2w.left + chunk + t2w.right
    bound = engine.max_step_cost() or window * batch
    gen = torch.Generator().manual_seed(0)
    voice = t2w.voice(next(iter(t2w.speakers)))
    streams = [t2w.stream(voice, seed) for seed in range(max(1, min(batch, bound // window)))]
    for _ in range(3):
        for s in streams:
            s.add(torch.randint(t2w.codebook - 1, (chunk,), generator=gen))
        work = [s.next_chunk() for s in streams]
        for s, w, (mel, _) in zip(streams, work, engine.step(work)):
            s.done(w, mel)
        yield 0


def _default_request(engine, pipeline):
    """A StageRequest with the pipeline's default parameters (as the orchestrator fills a request that sets
    none): the default image side, steps and guidance."""
    from omnistage.contract.params import resolve
    from omnistage.v1 import common_pb2
    from stage_service.runtime.base import StageRequest

    return StageRequest("r", resolve(common_pb2.GenerationParams(prompt="a photo of a cat"), pipeline.limits))


def _prompt_steps(engine, pipeline, batch: int, context: int):
    """Diffusers text encoders: maxBatch requests, each [negative, prompt] under the default guidance, in one
    step; yields once (no KV: 0)."""
    from stage_service.engines.diffusers.engines import PromptState

    p = _default_request(engine, pipeline).params
    prompts = [p.text] if p.guidance_scale <= 1.0 else [p.negative_prompt, p.text]
    engine.step([PromptState(list(prompts)) for _ in range(batch)])
    yield 0


def _denoise_steps(engine, pipeline, batch: int, context: int):
    """The denoise loop: maxBatch images at the default side (random text rows of the shapes the text stage
    hands on, two under the default guidance), two steps of the whole batch (every step is the same size);
    yields after each step the bytes the images hold."""
    import torch

    from omnistage.checkpoints.plan import CLIP_TOKENS
    from stage_service.engines.diffusers.text import SD3_T5_TOKENS

    req = _default_request(engine, pipeline)
    rows = 1 if req.params.guidance_scale <= 1.0 else 2
    gen = torch.Generator().manual_seed(0)
    tokens = CLIP_TOKENS + (SD3_T5_TOKENS if len(engine.call.text) > 1 else 0)  # CLIP's, then T5's rows (SD3)
    states = []
    for _ in range(batch):
        text = {ti.kwarg: torch.randn((rows, tokens, engine.config[ti.width]) if ti.per_token
                                      else (rows, engine.config[ti.width]), generator=gen).to(engine.dtype)
                for ti in engine.call.text}
        states.append(engine.new_state(req, text))
    for _ in range(2):
        engine.step(states)
        yield sum(st.held_bytes() for st in states)


def _latents_steps(engine, pipeline, batch: int, context: int):
    """The VAE decode: maxBatch latents of the default image side in one step, their PNGs encoded (the
    encoder thread finished before the reading); yields once."""
    import asyncio

    import torch

    from stage_service.engines.diffusers.engines import LatentsState

    p = _default_request(engine, pipeline).params
    scale = 2 ** (len(engine.vae.config.block_out_channels) - 1)
    gen = torch.Generator().manual_seed(0)
    engine.loop = asyncio.new_event_loop()  # never run: the PNG futures are settled on it and dropped
    states = [LatentsState(torch.randn(1, engine.latent_channels, p.height // scale, p.width // scale,
                                       generator=gen).to(engine.dtype)) for _ in range(batch)]
    engine.step(states)
    engine.encoder.shutdown(wait=True)
    yield 0


DRIVERS = {"ar": _ar_steps, "audio_chunks": _audio_chunk_steps, "talker": _talker_steps,
           "speech_chunks": _speech_chunk_steps, "prompts": _prompt_steps, "denoise": _denoise_steps,
           "latents": _latents_steps}


def measure_in_this_process(case: Case, context: int, models: Path) -> dict:
    """The stage's bytes after loading and its peak doing the work (see the module docstring), over the
    baseline taken before the load; meant for a process of its own."""
    from stage_service.engines.registry import create_engine
    from stage_service.runtime import device

    pipeline = case_pipeline(case, context)
    stage = pipeline.stage(case.stage)
    batch = pipeline.deployment.stages[case.stage].scheduler.max_batch
    engine = create_engine(pipeline, stage, models)
    _tokenizers_loaded_before(engine.model_dir)
    meter = HeapMeter()
    device.apply(engine.placement)
    baseline = meter.reading()
    engine.load()  # as StageServer.start does (engine.start: device.apply, then load on the worker thread)
    mapped = mapped_weights_bytes(engine)
    baseline -= mapped  # the mapped weights count in every reading from here on
    loaded = meter.reading() - baseline
    meter.sample()
    steps = kv_held = 0
    with sampling_every_op(meter):
        for held in DRIVERS[case.drive](engine, pipeline, batch, context):
            meter.sample()
            steps += 1
            kv_held = max(kv_held, held)
    return {"loaded_bytes": loaded, "mapped_weights_bytes": mapped, "peak_bytes": meter.peak - baseline,
            "kv_held_bytes": kv_held, "steps": steps, "batch": batch}


def measure(case: Case, context: int, models: Path | None = None) -> dict:
    """`measure_in_this_process` in a fresh process (so stages never share a heap)."""
    from omnistage.contract.launch import model_root

    argv = [sys.executable, __file__, "--child", case.family, case.stage, str(context),
            "--models", str(models or model_root())]
    out = subprocess.run(argv, cwd=ROOT, env={**os.environ, **CHILD_ENV}, capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"{case.family}.{case.stage}: the measuring process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_figures(quick: bool, models: Path | None = None) -> list[dict]:
    """Per case: the plan's total over the measured peak, both in MiB, and the KV held over the plan's."""
    from omnistage.checkpoints.plan import plan_stage
    from omnistage.contract.launch import model_root

    models = models or model_root()
    context = QUICK_CONTEXT if quick else FULL_CONTEXT
    figures = []
    for case in (c for c in CASES if not (quick and c.full_only)):
        pipeline = case_pipeline(case, context)
        plan = plan_stage(pipeline, pipeline.stage(case.stage), models)
        got = measure(case, context, models)
        name = f"memory_plan.{case.family}.{case.stage}"
        figures += [figure(f"{name}.predicted_over_measured", plan.total_bytes / got["peak_bytes"], "ratio"),
                    figure(f"{name}.measured_mib", got["peak_bytes"] / MIB, "MiB"),
                    figure(f"{name}.predicted_mib", plan.total_bytes / MIB, "MiB")]
        if plan.kv_bytes:
            figures.append(figure(f"{name}.kv_held_over_planned", got["kv_held_bytes"] / plan.kv_bytes, "ratio"))
    return figures


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=3, metavar=("FAMILY", "STAGE", "CONTEXT"),
                    help="measure one stage in this process and print its JSON (what `measure` runs)")
    ap.add_argument("--models", type=Path, help="the tiny models' root (default: the stage services' own)")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.child:
        from omnistage.contract.launch import model_root

        family, stage, context = a.child
        case = next(c for c in CASES if (c.family, c.stage) == (family, stage))
        print(json.dumps(measure_in_this_process(case, int(context), a.models or model_root())))
    else:
        print_table("memory plan vs measured peak", memory_figures(a.quick, a.models))
