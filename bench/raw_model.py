"""Each stage's model alone: the library's own batched call at batch 1 and at batch 16, no service.

The limit `bench/stage_batching.py` holds each stage against (`<engine>.c16_over_model_b16`): what the
same weights do on the same inputs when called directly, one torch thread, no gRPC, no scheduler, no
asyncio, no omnistage step code:

- ar_transformers: transformers' `generate` over a left-padded batch (greedy, exactly N new tokens);
- ar_vllm: vLLM's offline `LLM.generate` (greedy, ignore_eos, N tokens each);
- thinker: the Qwen3-Omni Thinker's own `generate`, returning the hidden states the Talker takes;
- thinker_vllm: the same Thinker on vLLM's `LLM.generate` with the stage's hidden-state extraction on
  (rows pushed to a drained sink); `spec_`, `sync_` and `plain_b<n>` take its parts away one by one;
- talker: transformers has no batched Talker generate (the combined model speaks one request at a
  time), so its limit is our own Talker step code driven in a plain loop, the scheduler and service
  left out, fed the Thinker's rows for the same prompts;
- diffusion: the UNet and the pipeline's scheduler in diffusers' own loop (classifier-free guidance:
  two rows per image), every image of the batch at the same timestep;
- decoder: Code2Wav's forward over the chunks the stage sees (25 new frames, 25 of left context after
  the first);
- vae: the VAE's decode.

AR engines also report `engine_b<n>`: our step code alone (the stage's own `DecoderLm`/`Thinker`
stepped in a loop, no scheduler, no service), which splits a stage's shortfall into the step code's part
and the service's part.

Run in its own process per engine by stage_batching.py (so it gets one thread and its own memory):

    .venv/bin/python bench/raw_model.py ENGINE --tokens 64 --steps 10 --chunks 4 --batches 1 16

prints one JSON line {"b1": units/s, "b16": units/s, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MODELS = REPO / "models"


def timed(fn, units: int, repeat: int = 1) -> float:
    """Units per second of `fn` (after one warm-up call), the best of `repeat` calls."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return units / best


def prompts(tokenizer, template, n: int, system: str = "") -> list[list[int]]:
    """The token ids the stage makes of the bench's prompts (stage_batching.header)."""
    from stage_service.runtime.chat import chat_prompt_ids

    return [chat_prompt_ids(tokenizer, template, f"benchmark request {i}", system) if template
            else tokenizer(f"benchmark request {i}")["input_ids"] for i in range(n)]


def left_padded(ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return input_ids, mask


# ------------------------------------------------------------------ AR


def ar_transformers(args) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stage_service.engines.transformers.lm_steps import DecoderLm
    from stage_service.runtime.chat import load_chat_template
    from stage_service.runtime.sampling import SamplingSettings

    root = MODELS / "qwen2-tiny"
    tok = AutoTokenizer.from_pretrained(root)
    template = load_chat_template(root, tok)
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    n = args.tokens
    out = {}
    for b in args.batches:
        ids, mask = left_padded(prompts(tok, template, b), tok.pad_token_id or 0)

        def gen():
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=tok.pad_token_id or 0)
        out[f"b{b}"] = timed(gen, b * n, args.repeat)
    lm = DecoderLm(AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32))
    for b in args.batches:
        out[f"engine_b{b}"] = timed(lambda: step_all(lm, [lm.new_state(p, SamplingSettings(temperature=0.0), n)
                                                          for p in prompts(tok, template, b)]), b * n, args.repeat)
    return out


def step_all(lm, states) -> None:
    """Step `states` together until every one has finished (the stage's step loop, no scheduler)."""
    while states:
        lm.step_batch(states)
        states = [s for s in states if not s.finished]


def ar_vllm(args) -> dict[str, float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from stage_service.runtime.chat import load_chat_template

    root = MODELS / "qwen2-tiny"
    llm = LLM(model=str(root), dtype="float32", max_model_len=512, max_num_seqs=max(args.batches),
              enforce_eager=True, disable_log_stats=True)
    template = load_chat_template(root, llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    out = {}
    for b in args.batches:
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(llm.get_tokenizer(), template, b)]
        out[f"b{b}"] = timed(lambda: llm.generate(batch, params, use_tqdm=False), b * args.tokens, args.repeat)
    return out


def thinker_vllm(args) -> dict[str, float]:
    """The Qwen3-Omni Thinker on vLLM's offline `LLM.generate`, through the text view the stage loads
    (`thinker_text_view`): with the hidden-state extraction the stage runs (`rows_engine_args`: the
    speculative `extract_hidden_states` method, prefix caching and async scheduling off, our KV connector
    pushing each step's rows to a ZMQ sink drained by a thread here), reported as `b<n>` (what the stage
    must do: tokens and rows); then, to split what that costs, the same without our connector (`spec_b<n>`:
    the rows stay in vLLM's cache), without the speculative method either (`sync_b<n>`: prefix caching and
    async scheduling still off) and plain (`plain_b<n>`: tokens only, vLLM's defaults)."""
    import tempfile
    import threading

    import zmq
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from stage_service.engines.vllm.rows import engine_length, rows_engine_args
    from stage_service.engines.vllm.thinker import thinker_family, thinker_text_view
    from stage_service.runtime.chat import load_chat_template

    root = MODELS / "qwen3-omni-tiny"
    config = json.loads((root / "config.json").read_text())
    text = config["thinker_config"]["text_config"]
    layers = sorted({0, thinker_family(config).hidden_layer(config)})
    stage_len = 512  # examples/qwen3-omni-vllm-tiny.yaml's engineArgs.max_model_len
    engine_len, _ = engine_length(stage_len, text.get("max_position_embeddings"))
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="raw-thinker-vllm-") as tmp:
        view = thinker_text_view(root, config, Path(tmp) / "view")
        endpoint = f"ipc://{Path(tmp) / 'rows.sock'}"
        received, stop, bound = [0], threading.Event(), threading.Event()

        def drain():  # the socket lives in this thread only (ZMQ sockets are not thread-safe)
            sink = zmq.Context.instance().socket(zmq.PULL)
            sink.bind(endpoint)
            bound.set()
            while not stop.is_set():
                if sink.poll(100):
                    received[0] += sum(len(f) for f in sink.recv_multipart(copy=False))
            sink.close(linger=0)

        pump = threading.Thread(target=drain, daemon=True)
        pump.start()
        bound.wait(30)
        rows = rows_engine_args(layers, endpoint, engine_len)
        spec = {k: v for k, v in rows.items() if k != "kv_transfer_config"}
        sync = {k: v for k, v in spec.items() if k != "speculative_config"}
        for label, extra in (("", rows), ("spec_", spec), ("sync_", sync), ("plain_", {"max_model_len": engine_len})):
            llm = LLM(model=str(view), tokenizer=str(view), dtype="float32", max_num_seqs=max(args.batches),
                      enforce_eager=True, disable_log_stats=True, **extra)
            template = load_chat_template(root, llm.get_tokenizer())
            for b in args.batches:
                batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(llm.get_tokenizer(), template, b)]
                out[f"{label}b{b}"] = timed(lambda: llm.generate(batch, params, use_tqdm=False), b * args.tokens,
                                            args.repeat)
            llm.llm_engine.engine_core.shutdown()  # its engine-core process ends before the next one starts
        stop.set()
        pump.join(5)
    if not received[0]:
        raise RuntimeError("the rows connector sent nothing: extraction was not on")
    return out


def _qwen3_omni(part: str, cls_name: str, **kwargs):
    import transformers

    from omnistage.checkpoints.shards import ShardedCheckpoint
    from stage_service.engines.qwen3_omni.steps import _config
    from stage_service.runtime.components import load_component

    root = MODELS / "qwen3-omni-tiny"
    combined = _config(root, part)
    return load_component(ShardedCheckpoint(root), f"{part}.", getattr(transformers, cls_name),
                          getattr(combined, f"{part}_config"), torch.float32, combined.model_type, **kwargs), combined


def thinker(args) -> dict[str, float]:
    from transformers import AutoTokenizer

    from stage_service.engines.omni.thinker import OmniThinkerEngine
    from stage_service.engines.qwen3_omni.steps import Thinker
    from stage_service.runtime.chat import load_chat_template
    from stage_service.runtime.sampling import SamplingSettings

    root = MODELS / "qwen3-omni-tiny"
    model, combined = _qwen3_omni("thinker", "Qwen3OmniMoeThinkerForConditionalGeneration")
    model.eval()
    tok = AutoTokenizer.from_pretrained(root)
    system = OmniThinkerEngine.DEFAULT_SYSTEM_PROMPT
    template = load_chat_template(root, tok)
    layer = combined.talker_config.accept_hidden_layer
    n = args.tokens
    out = {}
    for b in args.batches:
        ids, mask = left_padded(prompts(tok, template, b, system), tok.pad_token_id or 0)

        def gen():
            with torch.inference_mode():
                r = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, output_hidden_states=True, return_dict_in_generate=True,
                                   pad_token_id=tok.pad_token_id or 0)
                [h[layer] for h in r.hidden_states]  # the rows the Talker takes, as the combined generate does
        out[f"b{b}"] = timed(gen, b * n, args.repeat)
    th = Thinker(root)
    for b in args.batches:
        out[f"engine_b{b}"] = timed(
            lambda: step_thinker_all(th, [th.new_thinker_state(p, SamplingSettings(temperature=0.0), n, True)
                                          for p in prompts(tok, template, b, system)]), b * n, args.repeat)
    return out


def step_thinker_all(th, states) -> list[list]:
    """The Thinker's steps of `states` to the end; per state its steps (token, embeds and hidden rows)."""
    steps = {id(s): [] for s in states}
    live = list(states)
    while live:
        for st, step in zip(live, th.step_thinker(live)):
            steps[id(st)].append(step)
        live = [s for s in live if not s.finished]
    return [steps[id(s)] for s in states]


def talker(args) -> dict[str, float]:
    from transformers import AutoTokenizer

    from stage_service.engines.omni.talker import END_OF_TEXT
    from stage_service.engines.omni.thinker import OmniThinkerEngine
    from stage_service.engines.qwen3_omni.steps import Talker, Thinker
    from stage_service.runtime.chat import load_chat_template
    from stage_service.runtime.sampling import SamplingSettings

    root = MODELS / "qwen3-omni-tiny"
    tok = AutoTokenizer.from_pretrained(root)
    template = load_chat_template(root, tok)
    th = Thinker(root)
    ids = prompts(tok, template, max(args.batches), OmniThinkerEngine.DEFAULT_SYSTEM_PROMPT)
    fed = []
    for p, steps in zip(ids, step_thinker_all(th, [th.new_thinker_state(p, SamplingSettings(temperature=0.0),
                                                                        args.tokens, True) for p in ids])):
        fed.append((p, torch.cat([s.embeds for s in steps]), torch.cat([s.hidden for s in steps])))
    del th
    tk = Talker(root)
    frames = args.frames

    def states(b):
        out = []
        for p, emb, hid in fed[:b]:
            n = len(p)
            st = tk.new_state(p, emb[:n + 1], hid[:n + 1], SamplingSettings(temperature=0.0,
                                                                             repetition_penalty=1.05), frames)
            st.inbox.extend([emb[n + 1:], END_OF_TEXT])
            out.append(st)
        return out

    def run(b):
        live, made = states(b), 0
        while live:
            made += sum(r.frame is not None for r in tk.step_batch(live))
            live = [s for s in live if not s.finished]
        return made

    out = {}
    for b in args.batches:
        made = run(b)  # frames the states make (eos may end a request before its budget)
        out[f"b{b}"] = timed(lambda: run(b), made, args.repeat)
    return out


# ------------------------------------------------------------------ diffusion and decoders


def diffusion(args) -> dict[str, float]:
    from stage_service.engines.diffusers.layout import PipelineDir

    pipe = PipelineDir(MODELS / "sd-tiny" / "unet")
    unet = pipe.load("unet").eval()
    sched_cls, sched_cfg = pipe.scheduler_class(), pipe.config("scheduler")
    scale = 2 ** (len(pipe.config("vae")["block_out_channels"]) - 1)
    side = 32 // scale  # the bench's 32x32 images
    emb = torch.randn(2, 77, unet.config.cross_attention_dim, generator=torch.Generator().manual_seed(0))
    guidance = 7.5

    def run(b):
        sched = sched_cls.from_config(sched_cfg)
        sched.set_timesteps(args.steps)
        x = torch.randn(b, unet.config.in_channels, side, side, generator=torch.Generator().manual_seed(b))
        x = x * getattr(sched, "init_noise_sigma", 1.0)
        text = torch.cat([emb[:1].expand(b, -1, -1), emb[1:].expand(b, -1, -1)])
        with torch.inference_mode():
            for t in sched.timesteps:
                model_in = sched.scale_model_input(torch.cat([x, x]), t)
                uncond, cond = unet(model_in, t, encoder_hidden_states=text, return_dict=False)[0].chunk(2)
                x = sched.step(uncond + guidance * (cond - uncond), t, x).prev_sample

    return {f"b{b}": timed(lambda: run(b), b * args.steps, args.repeat) for b in args.batches}


def decoder(args) -> dict[str, float]:
    model, _ = _qwen3_omni("code2wav", "Qwen3OmniMoeCode2Wav")
    model.eval()
    groups, new, context = model.config.num_quantizers, 25, 25

    def run(b):
        g = torch.Generator().manual_seed(b)
        codes = torch.randint(0, 2048, (b, groups, new * args.chunks), generator=g)
        with torch.inference_mode():
            for k in range(args.chunks):  # each chunk with the left context before it, as the stage decodes
                model(codes[:, :, max(0, k * new - context):(k + 1) * new])

    return {f"b{b}": timed(lambda: run(b), b * new * args.chunks, args.repeat) for b in args.batches}


def vae(args) -> dict[str, float]:
    from diffusers import AutoencoderKL

    model = AutoencoderKL.from_pretrained(MODELS / "sd-tiny" / "vae", dtype=torch.float32).eval()

    def run(b):
        lat = torch.randn(b, 4, 16, 16, generator=torch.Generator().manual_seed(b))
        with torch.inference_mode():
            model.decode(lat / model.config.scaling_factor)

    return {f"b{b}": timed(lambda: run(b), b, args.repeat * 3) for b in args.batches}


ENGINES = {"ar_transformers": ar_transformers, "ar_vllm": ar_vllm, "thinker": thinker, "thinker_vllm": thinker_vllm,
           "talker": talker, "diffusion": diffusion, "decoder": decoder, "vae": vae}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=sorted(ENGINES))
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request (AR engines)")
    ap.add_argument("--frames", type=int, default=64, help="codec frames per request (talker)")
    ap.add_argument("--steps", type=int, default=10, help="denoise steps per image")
    ap.add_argument("--chunks", type=int, default=4, help="25-frame chunks per request (decoder)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeat", type=int, default=2, help="timed calls per batch size (the best is kept)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(json.dumps(ENGINES[args.engine](args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
