"""Transcriptions through the HTTP door against the same work through the gRPC one.

One `omnistage serve` of the Qwen3-Omni tiny example (Thinker -> Talker -> Code2Wav, one torch thread per
process), warmed; the same requests go through both doors of the same orchestrator:
  HTTP: `POST /v1/audio/transcriptions`, the clip uploaded as multipart/form-data, response_format json,
        temperature 0, by a thin httpx client (not the openai SDK, whose own cost would weigh on the cores);
  gRPC: `Orchestrator.Generate` with what the HTTP door makes of that upload: the clip as an audio part, the
        transcription instruction as a text part, the same system prompt, text out only, temperature 0.
Both give the same text (checked on a probe), so the work behind them is identical: only the Thinker runs.

`transcriptions.rps_c8`: requests/s at concurrency 8, HTTP over gRPC, measured in alternating rounds so that
a noisy neighbour on the machine hits both alike (goal >= 0.9); `transcriptions.http_rps_c8` and
`transcriptions.grpc_rps_c8` are the two rates.

    .venv/bin/python bench/http_api_transcriptions.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import http_api
import numpy as np
import soundfile
from common import figure, finish, print_table
from http_api import level, total_rps
from omni_load import serve_omni

ROOT = Path(__file__).resolve().parent.parent
RATE = 16000  # the clips' sample rate: the Thinker's audio encoder hears 16 kHz


def clips(n: int, seed: int) -> list[tuple[bytes, int]]:
    """(WAV bytes, 0) for `level`: seeded tones of 1 to 3 s (the 0 is `level`'s token budget, unused here:
    the pipeline's default applies through both doors)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seconds, pitch = rng.uniform(1.0, 3.0), rng.uniform(4.0, 12.0)
        samples = (0.3 * np.sin(np.arange(int(RATE * seconds)) / pitch)).astype(np.float32)
        buf = io.BytesIO()
        soundfile.write(buf, samples, RATE, format="WAV")
        out.append((buf.getvalue(), 0))
    return out


class Doors(http_api.Doors):
    """One transcription through either door: returns (seconds to the whole text, the text, 0), the shape
    `level` reads."""

    async def via_grpc(self, clip: bytes, _: int) -> tuple[float, str, int]:
        from omnistage.v1 import common_pb2
        from orchestrator_service.http_api import transcriptions

        t0, text = time.perf_counter(), []
        parts = [common_pb2.ContentPart(audio=common_pb2.AudioPart(data=clip)),
                 transcriptions.instruction(transcriptions.TRANSCRIBE, "", "")]
        async for ev in self.grpc.stream(parts=parts, system_prompt=transcriptions.SYSTEM_PROMPT, temperature=0.0,
                                         outputs=["text"], timeout=600):
            if ev.WhichOneof("event") == "text":
                text.append(ev.text.text)
        return time.perf_counter() - t0, "".join(text).strip(), 0

    async def via_http(self, clip: bytes, _: int) -> tuple[float, str, int]:
        t0 = time.perf_counter()
        r = await self.http.post("/audio/transcriptions", files={"file": ("clip.wav", clip, "audio/wav")},
                                 data={"model": self.model, "response_format": "json", "temperature": "0"})
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        return time.perf_counter() - t0, r.json()["text"], 0


async def side_by_side(endpoint: str, api_url: str, model: str, rounds: int, per_round: int) -> dict:
    doors = Doors(endpoint, api_url, model)
    try:
        probe = clips(1, 5)[0]
        g, h = await doors.via_grpc(*probe), await doors.via_http(*probe)
        if g[1] != h[1]:  # else the comparison is void
            raise SystemExit(f"the doors disagree: gRPC {g[1]!r}, HTTP {h[1]!r}")
        for call in (doors.via_grpc, doors.via_http):  # warm both paths
            await level(call, clips(8, 99), 4)
        rps: dict[str, list[dict]] = {"grpc": [], "http": []}
        for r in range(rounds):
            load = clips(per_round, 100 + r)
            order = (("grpc", doors.via_grpc), ("http", doors.via_http))
            for name, call in (order if r % 2 == 0 else order[::-1]):
                rps[name].append(await level(call, load, 8))
        return rps
    finally:
        await doors.close()


def measure(quick: bool, models: Path = ROOT / "models") -> list[dict]:
    rounds, per_round = (2, 16) if quick else (8, 32)
    with serve_omni(models, api_port=0) as local:
        out = asyncio.run(side_by_side(local.endpoint, local.api_url, local.pipeline.name, rounds, per_round))
    rps = {k: total_rps(v) for k, v in out.items()}
    return [figure("transcriptions.rps_c8", round(rps["http"] / rps["grpc"], 3), "ratio"),
            figure("transcriptions.http_rps_c8", round(rps["http"], 2), "req/s"),
            figure("transcriptions.grpc_rps_c8", round(rps["grpc"], 2), "req/s")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=str(ROOT / "models"))
    args = ap.parse_args()
    started = time.perf_counter()
    figures = measure(args.quick, Path(args.models))
    print_table("HTTP transcriptions over gRPC", figures)
    finish("http_api_transcriptions", figures, started, {"quick": args.quick})


if __name__ == "__main__":
    main()
