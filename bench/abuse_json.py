"""JSON bodies built to cost the orchestrator more memory than their bytes, against a clean body of the same size.

An orchestrator of the Qwen3-Omni tiny example serving its OpenAI API runs in a process of its own (its stages
are not started: a body that passes the door is answered by the request path, 503 or 400); each body is POSTed
to /v1/chat/completions at about the chat body limit, and the peak RSS (VmHWM, reset before each body through
/proc/PID/clear_refs) is read after the answer; the process's body parsers (processes of its own that parse large
bodies) count with it: the largest sum of their RSS, sampled every 2 ms, or any one's own peak plus the others'.

`json_amplification.rss_over_body`: the largest peak RSS growth over the body's size among the hostile shapes
(the shape is named in the figure's `shape`; goal <= 3). `json_amplification.clean_rss_over_body`: the same for
a valid body of media parts at their largest (base64 decoded and checked by the request path). Quick: limits of
2 parts of 4 MiB (a chat body of about 11 MiB); full: the example's own (8 parts of 16 MiB, about 170 MiB).

Each figure's `sum_of_peaks_over_body` adds each process's own peak instead: an upper bound (their peaks may
come at different times).

`json_parse.loop_stall_ms`: the longest gap between the ticks of a 1 ms ticker on the event loop while a valid
chat body at the example's limit (170 MiB of media parts) is parsed and translated in a body parser, as the API
does with large bodies (median of a few bodies); `baseline_ms` the same body parsed on a thread (the path before:
the parser and base64 decoding hold Python's lock), `idle_ms` the ticker alone (goal: under 50).

    .venv/bin/python bench/abuse_json.py [--quick]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx
from common import figure, print_table

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "qwen3-omni-tiny.yaml"
QUICK_LIMITS = {"maxParts": 2, "maxPartBytes": 4 << 20}
CHAT = "/v1/chat/completions"
SAMPLE_S = 0.002  # how often the processes' RSS is summed while a body is answered
TICK_S = 0.001  # the loop-stall probe's tick
STALL_RUNS, STALL_RUNS_QUICK = 7, 3  # bodies parsed each way (the figure is their median)


def _pipeline(limits: dict):
    import yaml

    from omnistage.api import parse_pipeline

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["topology"].setdefault("limits", {}).update(limits)
    return parse_pipeline(doc)


def _serve(limits: dict) -> None:
    """The orchestrator process: its API on a free port (printed), stages named at a closed port."""
    import asyncio

    from orchestrator_service.server import OrchestratorServer

    async def main():
        pipeline = _pipeline(limits)
        orc = OrchestratorServer(pipeline, {s.name: ["127.0.0.1:1"] for s in pipeline.stages}, api_port=0)
        await orc.start()
        workers = orc.api.parse_workers
        while len(workers.pids()) < workers.workers:  # the body parsers, started with the API
            await asyncio.sleep(0.1)
        print(json.dumps([orc.api_port, workers.pids()]), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    raise KeyError(field)


class _SummedPeak:
    """The largest sum of the processes' RSS, sampled every SAMPLE_S while in the `with` (`most`); and the sum
    of each one's own peak (`bound`: more than they held at once when their peaks were at different times)."""

    def __init__(self, pids: list[int]):
        import threading

        self.pids, self.most, self.bound, self._done = pids, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(SAMPLE_S):
            self.most = max(self.most, sum(_kib(pid, "VmRSS") for pid in self.pids))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.bound = sum(_kib(pid, "VmHWM") for pid in self.pids)
        self.most = max(self.most, *(_kib(pid, "VmHWM") for pid in self.pids))  # a peak between two samples


def shapes(limits) -> dict[str, bytes]:
    """Bodies of about the chat limit: the hostile shapes and the clean one."""
    from orchestrator_service.http_api import body_limits

    bounds = body_limits.chat_bounds(limits)
    size, values = bounds.size, bounds.values

    def padded(head: bytes, tail: bytes) -> bytes:  # filled to the limit with a string of base64-like bytes
        return head + b"A" * (size - len(head) - len(tail) - 64) + tail

    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(os.urandom(limits.max_part_bytes - 64))
                                                   .decode(), "format": "wav"}}
    parts = [part] * limits.max_parts
    user = b'{"role":"user","content":"hi"}'
    return {
        "clean: media parts at their largest": json.dumps({"messages": [{"role": "user", "content": parts}]}).encode(),
        '{"role":1} items': b'{"messages":[' + b'{"role":1},' * (size // 11 - 8) + b'{"role":1}]}',
        "[] items up to the value bound, then a string": padded(
            b'{"messages":[' + user + b'],"x":[' + b"[]," * (values // 2 - 64) + b'[]],"y":"', b'"}'),
        "{} items in an ignored field, then a string": padded(
            b'{"messages":[{"role":"user","content":"hi","x":[' + b"{}," * (values // 2 - 64) + b'{}]}],"y":"',
            b'"}'),
        "one text part past the prompt limit": padded(b'{"messages":[{"role":"user","content":"', b'"}]}'),
        "parts at their largest, then a bad part": json.dumps(
            {"messages": [{"role": "user", "content": parts[:-1] + [{"type": 1}]}]}).encode(),
        "escaped 4-byte characters past the prompt limit": b'{"messages":[{"role":"user","content":"' +
        b"\\ud83d\\ude00" * ((size - 64) // 12) + b'"}]}',
        "escaped characters up to the escape bound, then a string": padded(
            b'{"messages":[{"role":"user","content":"' + b"\\ud83d\\ude00" * (bounds.escapes // 2 - 64) + b'"}],"y":"',
            b'"}'),
        "nesting past the parser's depth": b"[" * (size // 2) + b"]" * (size // 2),
    }


def _peak_growth(limits: dict, body: bytes) -> tuple[int, int, float, int]:
    """(peak RSS growth, status, seconds, growth of the sum of each process's own peak) of one body sent to a
    fresh orchestrator: memory a previous body
    freed is not there to be reused."""
    proc = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps(limits)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        port, parsers = json.loads(proc.stdout.readline())
        pids = [proc.pid, *parsers]  # the orchestrator and its body parsers: memory of one pod
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            client.post(CHAT, json={"messages": [{"role": "user", "content": "warm"}]})  # lazily built objects
            rss = sum(_kib(pid, "VmRSS") for pid in pids)
            for pid in pids:
                Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM from here
            start = time.perf_counter()
            with _SummedPeak(pids) as peak:
                try:
                    status = client.post(CHAT, content=body, headers={"content-type": "application/json"}).status_code
                except httpx.TransportError:  # refused before it was read whole: the connection closed under it
                    status = 0
            return peak.most - rss, status, time.perf_counter() - start, peak.bound - rss
    finally:
        proc.terminate()
        proc.wait(30)


def _longest_gaps(parse, runs: int) -> list[float]:
    """The longest gap (ms) between the ticks of a 1 ms ticker on the event loop while `parse()` (a coroutine)
    runs, for each of `runs` parses."""
    import asyncio

    async def one() -> float:
        done, longest = False, 0.0

        async def ticker():
            nonlocal longest
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(TICK_S)
                now = time.perf_counter()
                longest, last = max(longest, now - last), now

        ticks = asyncio.create_task(ticker())
        await asyncio.sleep(TICK_S * 10)
        await parse()
        done = True
        await ticks
        return longest * 1e3

    async def all_runs() -> list[float]:
        return [await one() for _ in range(runs)]

    return asyncio.run(all_runs())


def loop_stall(runs: int) -> dict:
    """Each figure's `sum_of_peaks_over_body` adds each process's own peak instead: an upper bound (their peaks may
come at different times).

`json_parse.loop_stall_ms`: the event loop's longest stall while a chat body at the example's limit (every
    media part at its largest) is parsed and translated as the API does (in a parser process), against the same
    body parsed on a thread (the path before) and against the ticker alone; the median over `runs` of each."""
    import asyncio
    import io
    import statistics

    from orchestrator_service.http_api import parse_workers, routes, translate
    from orchestrator_service.http_api.schemas import ChatCompletionRequest, bounded

    pipeline = _pipeline({})
    body = shapes(pipeline.limits)["clean: media parts at their largest"]
    model = bounded(pipeline.limits)[ChatCompletionRequest]
    workers = parse_workers.ParseWorkers(pipeline, 1, parse_workers.address_space_for(len(body)))
    workers.start()
    try:
        while not workers.pids():  # started ahead, as the API does
            time.sleep(0.1)

        async def in_worker():
            await workers.parse(io.BytesIO(body), ChatCompletionRequest, translate.chat)

        async def on_thread():
            await asyncio.to_thread(routes._parse, io.BytesIO(body), model, translate.chat, pipeline)

        async def idle():
            await asyncio.sleep(1.0)

        worker_ms, thread_ms, idle_ms = [], [], []
        for _ in range(runs):  # interleaved: a busy machine weighs on both alike
            worker_ms += _longest_gaps(in_worker, 1)
            thread_ms += _longest_gaps(on_thread, 1)
            idle_ms += _longest_gaps(idle, 1)
    finally:
        workers.close()
    print(f"loop stall while a {len(body) >> 20} MiB body is parsed: in a parser process {worker_ms} ms, on a thread "
          f"{thread_ms} ms, ticker alone {idle_ms} ms", file=sys.stderr)
    return {**figure("json_parse.loop_stall_ms", round(statistics.median(worker_ms), 1), "ms"),
            "baseline_ms": round(statistics.median(thread_ms), 1), "idle_ms": round(statistics.median(idle_ms), 1),
            "worst_ms": round(max(worker_ms), 1), "baseline_worst_ms": round(max(thread_ms), 1),
            "body_bytes": len(body), "runs": runs}


def measure(quick: bool) -> list[dict]:
    stall = loop_stall(STALL_RUNS_QUICK if quick else STALL_RUNS)
    limits = QUICK_LIMITS if quick else {}
    rows = {}
    for name, body in shapes(_pipeline(limits).limits).items():
        growth, status, seconds, bound = _peak_growth(limits, body)
        rows[name] = (growth, len(body), status, seconds, bound)
    for name, (growth, size, status, seconds, bound) in rows.items():
        print(f"{name:50s} {size >> 20:5d} MiB  -> {status}  peak RSS +{growth >> 20} MiB ({growth / size:.2f}x; "
              f"sum of each process's peak {bound / size:.2f}x) {seconds:.1f} s", file=sys.stderr)
    clean_name = next(n for n in rows if n.startswith("clean"))
    hostile = {n: r for n, r in rows.items() if n != clean_name}
    worst = max(hostile, key=lambda n: hostile[n][0] / hostile[n][1])
    return [
        stall,
        {**figure("json_amplification.rss_over_body", round(hostile[worst][0] / hostile[worst][1], 2), "x"),
         "shape": worst, "body_bytes": hostile[worst][1], "status": hostile[worst][2],
         "sum_of_peaks_over_body": round(hostile[worst][4] / hostile[worst][1], 2)},
        {**figure("json_amplification.clean_rss_over_body", round(rows[clean_name][0] / rows[clean_name][1], 2),
                  "x"), "shape": clean_name, "body_bytes": rows[clean_name][1], "status": rows[clean_name][2],
         "sum_of_peaks_over_body": round(rows[clean_name][4] / rows[clean_name][1], 2)},
    ]


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        _serve(json.loads(sys.argv[2]))
        sys.exit(0)
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    print_table("JSON bodies: peak orchestrator RSS growth over body size", measure(ap.parse_args().quick))
