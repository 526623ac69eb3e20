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

    .venv/bin/python bench/e2e_vs_monolith.py [--quick] [--device cuda] [--c8-rounds N]

Every run records the machine's vector units (`cpu_flags`) and the CPU cores each process used at c8.
`--c8-rounds N` measures only the c8 point, staged and monolith x2 both up and taken in turn N times, and
merges `staged_over_monolith_x2.rps_c8_alternated` (the median of the rounds' ratios) and each side's CPU
seconds per request into the results file (their ratio: about the req/s ratio with both sides on all of the
cores, however much of them other work takes during the run).

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
import statistics
import threading
import time
from concurrent.futures import Future
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the replica processes too

from common import (
    add_device_argument,
    exit_on_sigterm,
    figure,
    merge_results,
    on_gpu,
    percentile,
    print_table,
    require_device,
    results_name,
    write_results,
)
from omni_load import prompts, run_level, serve_omni

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


# The vector units torch's CPU kernels pick from: the monolith's matmul-heavy `generate` speeds up with them
# far more than the staged side's per-chunk service work, so the headline ratio moves with them.
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16")


def cpu_flags(cpuinfo: str) -> dict[str, bool]:
    """Which of `VECTOR_FLAGS` the first processor of a /proc/cpuinfo text has."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {f: f in flags for f in VECTOR_FLAGS}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds per named process (those gone are left out)."""
    import contextlib

    import psutil

    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
    return out


def cpu_cores(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """Cores each process used over `wall` seconds (one started in between counts from 0)."""
    return {name: round((after[name] - before.get(name, 0.0)) / wall, 2) for name in after}


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

    def pids(self) -> list[int]:
        """The replica processes' ids (for their CPU seconds)."""
        return [p.pid for p in self._procs if p.pid is not None]

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
    the staged side): rates, TTFP (= latency), real-time factor (`rtf` the mean, `rtfs` per request)."""
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
            "rtf": sum(rtf) / len(rtf), "rtfs": rtf, "n": len(prompt_set)}


def with_cpu(pids, run) -> dict:
    """`run()`'s result with the CPU cores each process (`pids()`: name -> pid; this client included) used."""
    pids_then = {"client": os.getpid(), **pids()}
    cpu0, t0 = cpu_seconds(pids_then), time.perf_counter()
    r = run()
    wall = time.perf_counter() - t0
    return {**r, "cpu_cores": cpu_cores(cpu0, cpu_seconds({"client": os.getpid(), **pids()}), wall)}


def replica_pids(replicas: MonolithReplicas) -> dict[str, int]:
    return {f"replica{i}": pid for i, pid in enumerate(replicas.pids())}


def stage_pids(local) -> dict[str, int]:
    return {p.name: p.popen.pid for p in local.all_procs()}


def monolith_x2(levels: dict[int, int], frames: int, model_dir: Path, seed: int,
                device: str = "cpu") -> dict[int, dict]:
    with MonolithReplicas(2, model_dir, frames, device) as replicas:
        return {c: with_cpu(lambda: replica_pids(replicas),
                            lambda: run_replicas_level(replicas, request_order(n, seed), c))
                for c, n in levels.items()}


def staged_edit(device: str):
    return (lambda doc: on_gpu(doc, fraction=0.3, dtype="bfloat16")) if device == "cuda" else None


def staged(levels: dict[int, int], frames: int, models: Path, seed: int, device: str = "cpu") -> dict[int, dict]:
    with serve_omni(models, staged_edit(device)) as local:
        return {c: with_cpu(lambda: stage_pids(local),
                            lambda: asyncio.run(run_level(local.endpoint, request_order(n, seed), frames, c)))
                for c, n in levels.items()}


def alternated_c8(rounds: int, n: int, frames: int, models: Path, seed: int, device: str) -> tuple[list[dict], dict]:
    """The c8 point, staged against monolith x2, both up (each idle while the other is measured) and taken in
    turn, `rounds` times (the first side alternating): per round each side's req/s and its processes' CPU;
    the ratio is the median of the rounds' ratios (a burst of other work on the machine moves one round)."""
    runs: dict[str, list[dict]] = {"staged": [], "monolith_x2": []}
    with serve_omni(models, staged_edit(device)) as local, \
            MonolithReplicas(2, models / "qwen3-omni-tiny", frames, device) as replicas:
        sides = {"staged": (lambda: stage_pids(local),
                            lambda: asyncio.run(run_level(local.endpoint, request_order(n, seed), frames, 8))),
                 "monolith_x2": (lambda: replica_pids(replicas),
                                 lambda: run_replicas_level(replicas, request_order(n, seed), 8))}
        for i in range(rounds):
            for name in (("staged", "monolith_x2") if i % 2 == 0 else ("monolith_x2", "staged")):
                r = with_cpu(*sides[name])
                runs[name].append(r)
                print(f"  round {i + 1} {name:<12} {r['rps']:.2f} req/s  cores {r['cpu_cores']}", flush=True)
    ratios = [a["rps"] / b["rps"] for a, b in zip(runs["staged"], runs["monolith_x2"])]
    figures = [figure("staged_over_monolith_x2.rps_c8_alternated", statistics.median(ratios), "ratio")]
    detail: dict = {"rounds": rounds, "requests": n, "ratios": [round(x, 3) for x in ratios]}
    for name, rs in runs.items():
        rps = statistics.median(r["rps"] for r in rs)
        figures.append(figure(f"{name}.rps_c8_alternated", rps, "req/s"))
        # CPU seconds each request costs, per process: what the ratio is made of where both sides fill the cores
        per_request = {p: statistics.median(r["cpu_cores"].get(p, 0.0) / r["rps"] for r in rs)
                       for p in rs[0]["cpu_cores"]}
        figures.append(figure(f"{name}.cpu_s_per_request_c8", sum(per_request.values()), "core-s"))
        figures.append(figure(f"{name}.cpu_cores_c8", statistics.median(sum(r["cpu_cores"].values()) for r in rs),
                              "cores"))
        detail[name] = {"rps": [round(r["rps"], 3) for r in rs],
                        "cpu_s_per_request": {p: round(v, 3) for p, v in per_request.items()},
                        "cpu_cores": [r["cpu_cores"] for r in rs]}
    # What the ratio would be with both sides on all the cores, whatever else shares them: a loaded machine
    # gives each runnable process about the same share, and the staged side has four to the monolith's two.
    figures.append(figure("monolith_x2_over_staged.cpu_s_per_request_c8",
                          sum(detail["monolith_x2"]["cpu_s_per_request"].values())
                          / sum(detail["staged"]["cpu_s_per_request"].values()), "ratio"))
    return figures, detail


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
    ap.add_argument("--c8-rounds", type=int, default=0, metavar="N",
                    help="only the c8 point, staged and monolith x2 alternated N rounds (merged into the results)")
    add_device_argument(ap)
    args = ap.parse_args()
    require_device(args.device)
    exit_on_sigterm()
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # every side shares the cores: say how busy they were
    print(f"load average at start (1, 5, 15 min): {load_at_start}", flush=True)
    flags = cpu_flags(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
    print(f"vector units: {', '.join(f for f, on in flags.items() if on) or 'none of ' + ', '.join(flags)}", flush=True)
    started = time.perf_counter()
    model_dir = Path(args.models) / "qwen3-omni-tiny"
    frames = CODEC_FRAMES
    if args.c8_rounds:
        n = 16 if args.quick else 48
        figures, detail = alternated_c8(args.c8_rounds, n, frames, Path(args.models), 0, args.device)
        print_table("c8, staged and monolith x2 alternated", figures)
        path = merge_results(results_name("e2e_vs_monolith", args.device), figures, {
            "what": f"c8 alternated, {args.c8_rounds} rounds of {n} requests", "quick": args.quick,
            "cpu_flags": flags, "load_average_at_start": load_at_start,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()], "c8_alternated": detail,
            "runtime_s": round(time.perf_counter() - started, 1),
            "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
        print(f"\nmerged into {path}")
        return
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
             "cpu_flags": flags, "cpu_cores_c8": {"monolith_x2": mono2[8].get("cpu_cores"),
                                                  "staged": st[8].get("cpu_cores")},
             "load_average_at_start": load_at_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
             "runtime_s": round(time.perf_counter() - started, 1)}
    print(f"\nwrote {write_results(results_name('e2e_vs_monolith', args.device), figures, extra)}")


if __name__ == "__main__":
    main()
