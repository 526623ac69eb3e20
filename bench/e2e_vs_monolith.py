"""Headline benchmark: the staged pipeline against the monolithic model, side by side, same weights.

(a) monolith: transformers' combined `Qwen3OmniMoeForConditionalGeneration.generate`, one request at a
    time, as a user of that library runs it (one process, one torch thread);
(a2) monolith x2: the same monolith as two replica processes (one torch thread each, each serving one
    request at a time from its own queue) behind a round-robin dispatcher, as many processes as the
    staged side has cores, called at concurrency 8 and 32;
(b) staged:   `omnistage serve examples/qwen3-omni-tiny.yaml` (Thinker, Talker, Code2Wav as separate
    processes, one torch thread each, async chunk streaming on) called by a load generator at
    concurrency 1, 8 and 32.
All compute the same thing: the stages are the combined model's own sub-models, greedy decoding, the
same prompts (a fixed, seeded mix of short and long), the same token and codec-frame budgets. The
monolith's audio arrives with its whole result, so its time to first audio packet is its latency
(queueing in front of a replica included).

    .venv/bin/python bench/e2e_vs_monolith.py [--quick] [--device cuda]

With --device cuda every side runs on the first GPU in bfloat16 (the monolith and both of its replicas
moved there, the replicas sharing it; the three stages share it, a third of its memory each) and the
results go to bench/results/gpu/e2e_vs_monolith.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import random
import threading
import time
from concurrent.futures import Future
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the replica processes too

from common import (
    add_device_argument,
    exit_on_sigterm,
    figure,
    on_gpu,
    percentile,
    print_table,
    require_device,
    results_name,
    write_results,
)
from omni_load import prompts, run_level, serve_local

ROOT = Path(__file__).resolve().parent.parent
CODEC_FRAMES = 50  # 4 s of audio per request
READY_TIMEOUT_S = 300  # a replica process loading the model
REQUEST_TIMEOUT_S = 600


def request_order(n: int, seed: int) -> list[tuple[str, int]]:
    """The `n` prompts of `prompts(n, seed)` in a seeded random order, the order both loaded sides take
    them in. `prompts` alternates short and long; in that order a round-robin over two replicas would hand
    every long prompt to one replica and every short one to the other (one queue grows, the other idles)."""
    order = prompts(n, seed)
    random.Random(seed).shuffle(order)
    return order


def load_monolith(model_dir: Path, device: str):
    """The combined model (one torch thread), its tokenizer and the chat template the Thinker stage applies."""
    import torch
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from stage_service.runtime.chat import load_chat_template

    torch.set_num_threads(1)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).eval()
    if device == "cuda":
        model = model.to("cuda", torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer, load_chat_template(model_dir, tokenizer)


def generate_one(loaded, text: str, max_tokens: int, frames: int, device: str) -> tuple[int, float]:
    """One request through the monolith's `generate`: (text tokens out, seconds of audio out)."""
    import torch

    from stage_service.engines.qwen3_omni.steps import SAMPLE_RATE
    from stage_service.runtime.chat import chat_prompt_ids

    model, tokenizer, template = loaded
    ids = torch.tensor([chat_prompt_ids(tokenizer, template, text)], device=device)
    with torch.inference_mode():
        seq, wav = model.generate(input_ids=ids, thinker_max_new_tokens=max_tokens, thinker_eos_token_id=None,
                                  talker_max_new_tokens=frames + 1, talker_do_sample=False)
        wav = wav.cpu()  # the audio reaches its user in host memory (and the GPU's work is done)
    return seq.shape[1] - ids.shape[1], wav.shape[-1] / SAMPLE_RATE


def monolith(prompt_set, frames: int, model_dir: Path, device: str = "cpu") -> dict:
    """The monolith in this process, one request at a time."""
    loaded = load_monolith(model_dir, device)
    generate_one(loaded, *prompts(1, 99)[0], frames, device)  # warm, as the staged side is
    lat, tokens, audio_s = [], 0, 0.0
    t_all = time.perf_counter()
    for text, max_tokens in prompt_set:
        t0 = time.perf_counter()
        n, a = generate_one(loaded, text, max_tokens, frames, device)
        lat.append(time.perf_counter() - t0)
        tokens += n
        audio_s += a
    wall = time.perf_counter() - t_all
    return {"rps": len(prompt_set) / wall, "tok_s": tokens / wall, "ttfp": lat,  # audio arrives with the result
            "rtf": sum(lat) / audio_s, "n": len(prompt_set)}


class RoundRobin:
    """Which replica takes the next request: each in turn, whatever is queued there (as a round-robin
    load balancer in front of monolith servers does). Thread-safe."""

    def __init__(self, replicas: int) -> None:
        if replicas < 1:
            raise ValueError("at least one replica")
        self._turns = itertools.cycle(range(replicas))
        self._lock = threading.Lock()

    def pick(self) -> int:
        with self._lock:
            return next(self._turns)


def replica_main(requests, results, model_dir: str, frames: int, device: str) -> None:
    """A monolith replica process: load the model, say so, then serve its queue one request at a time
    ((id, text, max tokens) in, (id, tokens, audio seconds) out) until None."""
    loaded = load_monolith(Path(model_dir), device)
    generate_one(loaded, *prompts(1, 99)[0], frames, device)  # warm before timing
    results.send("ready")
    while (msg := requests.recv()) is not None:
        rid, text, max_tokens = msg
        results.send((rid, *generate_one(loaded, text, max_tokens, frames, device)))


class MonolithReplicas:
    """`replicas` monolith processes (spawned, each loading the model once before timing) behind one
    round-robin dispatcher; `submit` queues a request on the next replica and returns its Future."""

    def __init__(self, replicas: int, model_dir: Path, frames: int, device: str) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state forked from this one
        self._dispatch = RoundRobin(replicas)
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._senders, self._receivers, self._procs = [], [], []
        for _ in range(replicas):
            req_r, req_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=replica_main, args=(req_r, res_w, str(model_dir), frames, device), daemon=True)
            p.start()
            self._senders.append(req_w)
            self._receivers.append(res_r)
            self._procs.append(p)
        for i, r in enumerate(self._receivers):
            try:
                ready = r.poll(READY_TIMEOUT_S) and r.recv() == "ready"
            except EOFError:  # the replica exited while loading (its traceback is on stderr)
                ready = False
            if not ready:
                self.close()
                raise RuntimeError(f"monolith replica {i} did not load the model "
                                   f"(it exited, or took over {READY_TIMEOUT_S}s)")
        self._readers = [threading.Thread(target=self._read, args=(r,), daemon=True) for r in self._receivers]
        for t in self._readers:
            t.start()

    def _read(self, receiver) -> None:
        while True:
            try:
                rid, tokens, audio_s = receiver.recv()
            except (EOFError, OSError):  # a replica died (or closed): its requests will never answer
                with self._lock:
                    pending, self._pending = list(self._pending.values()), {}
                for fut in pending:
                    if not fut.done():
                        fut.set_exception(RuntimeError("a monolith replica exited"))
                return
            with self._lock:
                fut = self._pending.pop(rid)
            fut.set_result((tokens, audio_s))

    def submit(self, text: str, max_tokens: int) -> Future:
        fut: Future = Future()
        i = self._dispatch.pick()
        with self._lock:  # one sender at a time per pipe (and the id registered before the answer can come)
            rid = next(self._ids)
            self._pending[rid] = fut
            self._senders[i].send((rid, text, max_tokens))
        return fut

    def close(self) -> None:
        for s in self._senders:
            try:
                s.send(None)
            except OSError:
                pass
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> MonolithReplicas:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_replicas_level(replicas: MonolithReplicas, prompt_set, concurrency: int) -> dict:
    """Every prompt through the replicas, `concurrency` at a time (a closed loop, as `run_level` drives
    the staged side): rates, TTFP (= latency), real-time factor."""
    queue = list(prompt_set)
    lat, rtf, tokens = [], [], 0
    lock = threading.Lock()

    def client() -> None:
        nonlocal tokens
        while True:
            with lock:
                if not queue:
                    return
                text, max_tokens = queue.pop()
            t0 = time.perf_counter()
            n, audio_s = replicas.submit(text, max_tokens).result(REQUEST_TIMEOUT_S)
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                rtf.append(dt / audio_s)
                tokens += n

    clients = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    wall = time.perf_counter() - t0
    return {"rps": len(prompt_set) / wall, "tok_s": tokens / wall, "ttfp": lat, "latency": lat,
            "rtf": sum(rtf) / len(rtf), "n": len(prompt_set)}


def monolith_x2(levels: dict[int, int], frames: int, model_dir: Path, seed: int,
                device: str = "cpu") -> dict[int, dict]:
    with MonolithReplicas(2, model_dir, frames, device) as replicas:
        return {c: run_replicas_level(replicas, request_order(n, seed), c) for c, n in levels.items()}


def staged(levels: dict[int, int], frames: int, models: Path, seed: int, device: str = "cpu") -> dict[int, dict]:
    edit = (lambda doc: on_gpu(doc, fraction=0.3, dtype="bfloat16")) if device == "cuda" else None
    with serve_local(models, edit) as endpoint:
        return {c: asyncio.run(run_level(endpoint, request_order(n, seed), frames, c)) for c, n in levels.items()}


def side_figures(prefix: str, c: int | None, r: dict) -> list[dict]:
    at = f"_c{c}" if c is not None else ""
    return [figure(f"{prefix}.rps{at}", r["rps"], "req/s"), figure(f"{prefix}.tok_s{at}", r["tok_s"], "tok/s"),
            figure(f"{prefix}.ttfp_p50{at}_ms", 1e3 * percentile(r["ttfp"], 50), "ms"),
            figure(f"{prefix}.ttfp_p95{at}_ms", 1e3 * percentile(r["ttfp"], 95), "ms"),
            figure(f"{prefix}.rtf{at}", r["rtf"], "ratio")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=str(ROOT / "models"))
    add_device_argument(ap)
    args = ap.parse_args()
    require_device(args.device)
    exit_on_sigterm()
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # every side shares the cores: say how busy they were
    print(f"load average at start (1, 5, 15 min): {load_at_start}", flush=True)
    started = time.perf_counter()
    model_dir = Path(args.models) / "qwen3-omni-tiny"
    frames = CODEC_FRAMES
    n_mono = 6 if args.quick else 16
    levels = {1: 6, 8: 16, 32: 32} if args.quick else {1: 16, 8: 48, 32: 96}
    loaded_levels = {c: n for c, n in levels.items() if c > 1}
    mono = monolith(prompts(n_mono), frames, model_dir, args.device)
    mono2 = monolith_x2(loaded_levels, frames, model_dir, 0, args.device)
    st = staged(levels, frames, Path(args.models), 0, args.device)
    rows = ([("monolith (c1)", mono)] + [(f"monolith x2 c{c}", r) for c, r in mono2.items()]
            + [(f"staged c{c}", r) for c, r in st.items()])
    print(f"\n{'side':<16}{'req/s':>8}{'tok/s':>8}{'TTFP p50':>10}{'TTFP p95':>10}{'RTF':>7}{'n':>5}")
    for name, r in rows:
        print(f"{name:<16}{r['rps']:>8.2f}{r['tok_s']:>8.1f}{1e3 * percentile(r['ttfp'], 50):>9.0f}ms"
              f"{1e3 * percentile(r['ttfp'], 95):>8.0f}ms{r['rtf']:>7.2f}{r['n']:>5}")
    figures = side_figures("monolith", None, mono)
    for c, r in mono2.items():
        figures += side_figures("monolith_x2", c, r)
    for c, r in st.items():
        figures += side_figures("staged", c, r)
    figures += [figure("staged_over_monolith.rps_c8", st[8]["rps"] / mono["rps"], "ratio"),
                figure("staged_over_monolith.rps_c32", st[32]["rps"] / mono["rps"], "ratio"),
                figure("staged_over_monolith.tok_s_c8", st[8]["tok_s"] / mono["tok_s"], "ratio"),
                figure("monolith_over_staged.ttfp_p50_c1",
                       percentile(mono["ttfp"], 50) / percentile(st[1]["ttfp"], 50), "ratio")]
    for c in loaded_levels:  # the fair headline: as many monolith processes as the machine has cores
        figures += [figure(f"staged_over_monolith_x2.rps_c{c}", st[c]["rps"] / mono2[c]["rps"], "ratio"),
                    figure(f"staged_over_monolith_x2.tok_s_c{c}", st[c]["tok_s"] / mono2[c]["tok_s"], "ratio"),
                    figure(f"monolith_x2_over_staged.ttfp_p50_c{c}",
                           percentile(mono2[c]["ttfp"], 50) / percentile(st[c]["ttfp"], 50), "ratio")]
    figures.append(figure("monolith_x2_over_monolith.rps_c8", mono2[8]["rps"] / mono["rps"], "ratio"))
    print_table("figures", figures)
    extra = {"quick": args.quick, "codec_frames": frames, "device": args.device, "monolith_replicas": 2,
             "load_average_at_start": load_at_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
             "runtime_s": round(time.perf_counter() - started, 1)}
    print(f"\nwrote {write_results(results_name('e2e_vs_monolith', args.device), figures, extra)}")


if __name__ == "__main__":
    main()
