"""Hostile traffic on the orchestrator's gRPC front door: what callers without an API key can make it hold.

`grpc_unauthenticated.rss_growth_mib`: growth of an orchestrator process's peak RSS (VmHWM, reset before each
burst) while 16 clients without a key each send a 120 MiB GenerateRequest at once, each on its own connection;
beside it the growth for 16 keyless tiny requests. The orchestrator has API keys configured (through the
environment, never argv) and the default limits, whose receive limit (257 MiB) is above 120 MiB, so the large
requests are refused for the missing key and not for their size.

    .venv/bin/python bench/abuse_grpc.py
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml
from common import figure

from omnistage.api import parse_pipeline
from omnistage.contract import launch
from omnistage.v1 import orchestrator_pb2

ROOT = Path(__file__).resolve().parent.parent
GENERATE = "/omnistage.v1.Orchestrator/Generate"
CLIENTS = 16
LARGE_BYTES = 120 << 20
KEY = "bench-key"


def _pipeline_file(folder: Path) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "llm-tiny.yaml").read_text())
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    doc["spec"]["topology"].pop("limits", None)  # the defaults: a 257 MiB receive limit
    limits = parse_pipeline(doc).limits
    assert limits.max_request_bytes > LARGE_BYTES, "the large requests must be under the receive limit"
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class KeyedOrchestrator:
    """An orchestrator process with one API key (from $OMNISTAGE_API_KEYS) and no stage behind it: every
    request here is refused at the door, so no stage is needed."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="abuse-grpc-"))
        ready = self.tmp / "orc.ready"
        argv = launch.orchestrator_command(_pipeline_file(self.tmp), python=sys.executable, port=0,
                                           ready_file=ready, log_level="WARNING",
                                           stage_endpoints={"llm": ["127.0.0.1:9"]})
        env = {**os.environ, **launch.service_env(), launch.ENV_API_KEYS: KEY}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(self.tmp / "orc.log", "w"),
                                     stderr=subprocess.STDOUT)
        end = time.monotonic() + 120
        while (ports := launch.read_ready(ready)) is None:
            if self.proc.poll() is not None or time.monotonic() > end:
                self.close()
                raise RuntimeError(f"orchestrator did not start:\n{(self.tmp / 'orc.log').read_text()}")
            time.sleep(0.05)
        self.endpoint = f"127.0.0.1:{ports.grpc}"

    def _status(self, field: str) -> int:
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
        raise KeyError(field)

    def reset_peak(self) -> int:
        """Resets the process's peak RSS to its current RSS (Linux clear_refs 5); returns that RSS."""
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
            f.write("5")
        return self._status("VmRSS")

    def peak(self) -> int:
        return self._status("VmHWM")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def keyless_request(size: int) -> bytes:
    return orchestrator_pb2.GenerateRequest(params={"prompt": "x" * size}).SerializeToString()


async def keyless_burst(endpoint: str, body: bytes, clients: int = CLIENTS) -> dict[str, int]:
    """`clients` keyless calls at once, one connection each; their status codes, counted."""
    async def one() -> str:
        async with grpc.aio.insecure_channel(endpoint, options=[("grpc.max_send_message_length", -1)]) as ch:
            call = ch.unary_stream(GENERATE)  # bytes as they are: no serializer
            try:
                async for _ in call(body, timeout=120):
                    pass
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name
    codes: dict[str, int] = {}
    for code in await asyncio.gather(*(one() for _ in range(clients))):
        codes[code] = codes.get(code, 0) + 1
    return codes


def growth_mib(orc: KeyedOrchestrator, body: bytes) -> tuple[float, dict[str, int]]:
    before = orc.reset_peak()
    codes = asyncio.run(keyless_burst(orc.endpoint, body))
    return (orc.peak() - before) / (1 << 20), codes


def measure(quick: bool) -> list[dict]:
    orc = KeyedOrchestrator()
    try:
        tiny, tiny_codes = growth_mib(orc, keyless_request(16))
        large, large_codes = growth_mib(orc, keyless_request(LARGE_BYTES))
    finally:
        orc.close()
    for codes in (tiny_codes, large_codes):
        assert codes == {"UNAUTHENTICATED": CLIENTS}, codes
    return [figure("grpc_unauthenticated.rss_growth_mib", round(large, 1), "MiB"),
            figure("grpc_unauthenticated.baseline_rss_growth_mib", round(tiny, 1), "MiB")]


if __name__ == "__main__":
    for f in measure(quick="--quick" in sys.argv):
        print(f)
