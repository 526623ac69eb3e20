"""Abuse benchmark, `omnistage serve`: one process dying under load stops nothing.

`omnistage serve` of the tiny Qwen3-Omni example (Thinker -> Talker -> Code2Wav, text and audio out) with the
Talker at 2 replicas. A closed loop of clients sends requests back to back. After a clean window (the
baseline), one Talker replica is killed with SIGKILL while it runs a call; serve restarts it with backoff
and keeps the other serving.

- serve_process_death.baseline_failed_requests: failed requests of the clean window (before the kill);
- serve_process_death.failed_requests: failed requests among those in flight at the kill or started before
  serve took the replica out of service (goal 0: the killed replica's calls are retried on the other one);
- serve_process_death.failed_after: failed requests among those started after serve took the replica out
  of service (goal 0), until the end of the run (with --full: until the replica is back and past it);
- serve_process_death.serve_running: 1 when serve still runs at the end (goal 1).
Each count comes with the number of requests it is out of.

    .venv/bin/python bench/abuse_serve.py [--full]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common import figure, print_table

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
CLIENTS = 3            # requests in flight: both Talker replicas have work
REQUEST = dict(max_tokens=8, max_codec_frames=25, timeout=180)
WINDOW_S = {True: 8.0, False: 30.0}   # each measured window (baseline, after the kill), quick or full


@dataclass
class Outcome:
    started: float
    ended: float
    ok: bool


class Serve:
    """`omnistage serve` as a user runs it, its output collected in a file."""

    def __init__(self, tmp: Path):
        self.out = tmp / "serve.out"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnistage.local.cli", "serve", str(ROOT / "examples" / "qwen3-omni-tiny.yaml"),
             "--models", str(MODELS), "--log-dir", str(tmp / "logs"), "--replicas", "talker=2", "--no-api",
             "--no-tls"], stdout=open(self.out, "w"), stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, self.out.read_text())
            if m:
                return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.out.read_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"{pattern!r} not seen in {timeout:.0f}s:\n{self.out.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def running(port: int) -> int:
    import grpc

    from omnistage.v1 import stage_pb2, stage_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return stage_pb2_grpc.StageServiceStub(ch).GetLoad(stage_pb2.GetLoadRequest(), timeout=5).running


def measure(quick: bool) -> list[dict]:
    from omnistage.client import OmniClient

    window = WINDOW_S[quick]
    with tempfile.TemporaryDirectory(prefix="abuse-serve-") as tmp:
        serve = Serve(Path(tmp))
        try:
            endpoint = serve.wait_for(r"serving on (127\.0\.0\.1:\d+)", 300).group(1)
            victim = int(serve.wait_for(r"stage talker\[1\]: ready on .* \(pid (\d+)\)", 5).group(1))
            port = int(serve.wait_for(r"stage talker\[1\]: ready on 127\.0\.0\.1:(\d+)", 5).group(1))
            stop, outcomes = threading.Event(), []

            def client():
                with OmniClient(endpoint) as c:
                    while not stop.is_set():
                        t0 = time.monotonic()
                        try:
                            ok = bool(c.generate("say something", **REQUEST).pcm)
                        except Exception:  # noqa: BLE001 - a failed request is what is counted
                            ok = False
                        outcomes.append(Outcome(t0, time.monotonic(), ok))

            threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
            for t in threads:
                t.start()
            time.sleep(window)   # the clean window: the baseline
            end = time.monotonic() + 60
            while running(port) == 0 and time.monotonic() < end:
                time.sleep(0.01)
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            serve.wait_for(rf"stage talker\[1\] \(pid {victim}\) exited .* out of service", 60)
            out_of_service = time.monotonic()
            if not quick:   # on until the replica is back, then a window past it
                serve.wait_for(r"stage talker\[1\]: ready on .* in service", 300)
            time.sleep(window)
            stop.set()
            for t in threads:
                t.join(240)
            alive = serve.proc.poll() is None
        finally:
            serve.stop()
    baseline = [o for o in outcomes if o.ended < killed]
    at_kill = [o for o in outcomes if o.started < out_of_service and o.ended >= killed]
    after = [o for o in outcomes if o.started >= out_of_service]
    name = "serve_process_death"
    return [
        figure(f"{name}.baseline_failed_requests", sum(not o.ok for o in baseline), "requests"),
        figure(f"{name}.baseline_requests", len(baseline), "requests"),
        figure(f"{name}.failed_requests", sum(not o.ok for o in at_kill), "requests"),
        figure(f"{name}.requests_in_flight_at_kill", len(at_kill), "requests"),
        figure(f"{name}.failed_after", sum(not o.ok for o in after), "requests"),
        figure(f"{name}.requests_after", len(after), "requests"),
        figure(f"{name}.serve_running", int(alive), "bool"),
    ]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="longer windows; wait for the replica to come back")
    args = ap.parse_args()
    print_table("omnistage serve: one of two Talker replicas killed under load", measure(quick=not args.full))
