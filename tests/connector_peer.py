"""A connector in a process of its own, driven by JSON lines on stdin: for cross-process tests
and the transport benchmark (bench/transport.py). Replies are stdout lines starting with "@@ " (UCX
may print too). `PeerProcess` starts and drives one; by hand:

    python tests/connector_peer.py --stage thinker --transports shm,ucx --host-id h1 [--device cuda]

ops: put {key, dtype, shape, seed, transport, readers} -> {tensor, sha256, seconds}; get {tensor}
-> {sha256, seconds, dtype, shape, device, path}; held -> {held_bytes, held_tensors, endpoints};
release_request {request_id} -> {freed}; quit. `tensor` is a serialized omnistage.v1.Tensor,
base64-encoded; put tensors are random bytes made from (dtype, shape, seed), on the peer's device.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import signal
import sys
import time

import torch

from omnistage.connector import Connector, TensorKey, make_connector
from omnistage.connector.wire import as_bytes
from omnistage.v1 import tensor_pb2

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def make_tensor(dtype: str, shape: list[int], seed: int) -> torch.Tensor:
    """Random bytes of every bit pattern (0/1 for bool), the same for the same arguments anywhere."""
    dt = DTYPES[dtype]
    numel = 1
    for d in shape:
        numel *= d
    g = torch.Generator().manual_seed(seed)
    if dt == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g, dtype=torch.uint8).bool().reshape(shape)
    size = torch.empty((), dtype=dt).element_size()
    raw = torch.randint(0, 256, (numel * size,), generator=g, dtype=torch.uint8)
    return raw.view(dt).reshape(shape)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(as_bytes(t.contiguous().cpu()).numpy()).hexdigest()


def encode(msg: tensor_pb2.Tensor) -> str:
    return base64.b64encode(msg.SerializeToString()).decode()


def decode(text: str) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor.FromString(base64.b64decode(text))


_last: dict[tuple, tuple[torch.Tensor, str]] = {}  # the last tensor made and its digest, for repeated puts


def cached_tensor(dtype: str, shape: list[int], seed: int, device: str = "cpu") -> tuple[torch.Tensor, str]:
    key = (dtype, tuple(shape), seed, device)
    if key not in _last:
        _last.clear()
        t = make_tensor(dtype, shape, seed)
        _last[key] = (t.to(device), digest(t))
    return _last[key]


async def handle(conn: Connector, cmd: dict) -> dict:
    op = cmd["op"]
    if op == "put":
        t, sha256 = cached_tensor(cmd["dtype"], cmd["shape"], cmd.get("seed", 0), conn.device)
        key = TensorKey(*cmd["key"])
        t0 = time.perf_counter()
        msg = await conn.put(key, t, transport=cmd.get("transport", "auto"), readers=cmd.get("readers", 1))
        return {"tensor": encode(msg), "seconds": time.perf_counter() - t0, "sha256": sha256}
    if op == "get":
        t0 = time.perf_counter()
        msg = decode(cmd["tensor"])
        out = await conn.get(msg)
        seconds = time.perf_counter() - t0
        return {"sha256": digest(out), "seconds": seconds, "dtype": str(out.dtype), "shape": list(out.shape),
                "device": out.device.type, "path": conn.path_of(msg)}
    if op == "held":
        return {"held_bytes": conn.held_bytes, "held_tensors": conn.held_tensors, "endpoints": conn.endpoints}
    if op == "release_request":
        return {"freed": conn.release_request(cmd["request_id"])}
    raise ValueError(f"unknown op {op!r}")


async def serve(args) -> None:
    conn = await make_connector(args.stage, tuple(t for t in args.transports.split(",") if t), host_id=args.host_id,
                                fragment_bytes=args.fragment_bytes, device=args.device)
    reply({"ready": True, "ucx_address": conn.ucx_address, "ucx_device_memory": conn.ucx_device_memory})
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            try:
                reply({"ok": True, **await handle(conn, cmd)})
            except Exception as e:  # noqa: BLE001 - reported to the driving process
                reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        await conn.close()
        reply({"closed": True})


def reply(obj: dict) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


class PeerProcess:
    """Starts and drives a peer in a subprocess (asyncio, so this process's own connector keeps serving)."""

    def __init__(self, stage: str, transports: str = "shm,ucx", host_id: str | None = None,
                 fragment_bytes: int = 0, env: dict | None = None, device: str = "cpu"):
        # Run by path: the peer needs only the installed omnistage, whatever the working directory.
        self.args = [sys.executable, os.path.abspath(__file__), "--stage", stage, "--transports", transports,
                     "--fragment-bytes", str(fragment_bytes), "--device", device] + (
                         ["--host-id", host_id] if host_id else [])
        self.env = {**os.environ, **(env or {})}
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: dict = {}

    async def start(self, timeout: float = 60) -> dict:
        self.proc = await asyncio.create_subprocess_exec(*self.args, stdin=asyncio.subprocess.PIPE,
                                                         stdout=asyncio.subprocess.PIPE, env=self.env)
        self.ready = await self._reply(timeout)
        return self.ready

    async def call(self, timeout: float = 120, **cmd) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        out = await self._reply(timeout)
        if not out.get("ok"):
            raise RuntimeError(f"peer {cmd['op']} failed: {out.get('error')}")
        return out

    async def _reply(self, timeout: float) -> dict:
        async with asyncio.timeout(timeout):
            while True:
                line = await self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"peer exited with {await self.proc.wait()}")
                if line.startswith(b"@@ "):
                    return json.loads(line[3:])

    def kill(self) -> None:
        """SIGKILL: the peer vanishes without closing anything."""
        self.proc.send_signal(signal.SIGKILL)

    async def close(self, timeout: float = 30) -> int:
        if self.proc.returncode is None:
            try:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                await self.proc.stdin.drain()
                async with asyncio.timeout(timeout):
                    return await self.proc.wait()
            except (TimeoutError, ConnectionError):
                self.proc.kill()
        return await self.proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", required=True)
    p.add_argument("--transports", default="shm,ucx")
    p.add_argument("--host-id", default=None)
    p.add_argument("--fragment-bytes", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the peer's tensors live: cpu or cuda")
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
