"""Transport benchmark: bandwidth and latency of the connector's backends (UCX, shared memory,
inline gRPC) from 4 KiB to 256 MiB, against memcpy and ucx_perftest (tcp) in the same run.

Every figure is one hand-off from a producer's tensor to the consumer's tensor: the producer is a
separate process (`tests/connector_peer.py`) that puts the tensor, this process gets it, and the
time is the producer's put plus the consumer's get. memcpy is a torch copy into an existing buffer
(`memcpy`) and into new memory (`memcpy_new`: what a receive into a fresh tensor also pays).
ucx_perftest is UCX's own tag bandwidth test between two processes on 127.0.0.1 with the same UCX
settings as the connector: as it ships (busy polling, no error handling), with peer error handling
(`-e`, as the connector's endpoints) and waiting for events (`-E sleep`, as the connector's event
loop does). The machine is shared and noisy, so the backends are measured interleaved, size by size,
for several rounds (the same-host ones in an order that rotates from round to round); a round's
figure is the median of its iterations, and each bandwidth figure is the best round (best of N: the
least disturbed). The UCX ratios the issue names,
`ucx.bw_<size>_over_perftest` (1 MiB and up), are medians over rounds of paired ratios: in each round
ucx_perftest and the connector's UCX get run back to back at the same size, and the run prints each
round's ratio. `ucx_over_perftest.<size>` (16 MiB and up) is best UCX round over best perftest round.
`--ucx-only` measures only those pairs (bench/results/transport_ucx.json).

Shared memory hands the consumer a tensor over a mapping of the segment (no copy); so that it is
compared with memcpy_new on equal terms, its time includes the consumer's first read of every page
(the mapping's page faults) and the drop of the tensor (whose unmap the connector hands to its
unmapping thread; memcpy_new's free is in its time). `shm` is the connector as shipped (reads below
`shm.MAPPED_FROM` copy the bytes out); `shm_copy` and `shm_map` are the same hand-off with every read
copied or mapped: mapped over copied at each size (`shm.map_over_copy.<size>`) is how that threshold
was chosen.
`shm_write_pwrite` / `shm_write_mapped` time the producer's one write of the bytes into a new
segment, with `pwrite` (what `put` does) and through a shared mapping. The shm ratios
(`shm.bw_<size>_over_memcpy_new`, `shm.map_over_copy.<size>`) are medians of per-round ratios.

`--device cuda` measures device memory instead: the producer's tensor and the consumer's on the GPU,
over UCX (device to device: CUDA IPC between the two processes of this host) beside `ucx_perftest -m
cuda` (when the binary is there and runs), shared memory (staged through host memory at both ends) and
a device-to-device copy; figures named `cuda.*`, written to bench/results/gpu/transport.json. Without
CUDA it exits with one line.

    .venv/bin/python bench/transport.py [--quick] [--ucx-only] [--device cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # traffic stays on 127.0.0.0/8
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import grpc
import torch
from common import add_device_argument, exit_on_sigterm, figure, require_device, results_name, write_results

from omnistage.connector import TensorKey, make_connector, shm
from omnistage.connector.ucx import UCX_DEFAULTS
from omnistage.connector.wire import HEADER_BYTES, TensorHeader
from omnistage.v1 import tensor_pb2
from tests.connector_peer import PeerProcess, decode, make_tensor

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"4KiB": 4 * KiB, "64KiB": 64 * KiB, "256KiB": 256 * KiB, "1MiB": MiB, "16MiB": 16 * MiB, "64MiB": 64 * MiB,
         "256MiB": 256 * MiB}
QUICK_SIZES = ("4KiB", "1MiB", "16MiB", "64MiB")
BACKENDS = ("ucx_perftest", "ucx", "shm", "shm_copy", "shm_map", "inline_grpc", "memcpy", "memcpy_new")
SHM_RATIO_SIZES = ("1MiB", "16MiB", "64MiB")  # shm.bw_<size>_over_memcpy_new
CUDA_BACKENDS = ("ucx_perftest", "ucx", "shm", "memcpy")  # with --device cuda, figures named cuda.<backend>...
UCX_TLS = {"cpu": "tcp", "cuda": "tcp,cuda_copy,cuda_ipc"}  # shared-memory transports alone time out on listeners
FETCH = "/omnistage.bench.Transport/Fetch"
GRPC_OPTIONS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
LIBUCX = Path(__import__("libucx").__file__).parent
PERFTEST = LIBUCX / "bin" / "ucx_perftest"


def ucx_env() -> dict[str, str]:
    """The environment both the connector's processes and ucx_perftest run with: the same UCX settings."""
    env = dict(os.environ)
    for k, v in UCX_DEFAULTS.items():
        env.setdefault(f"UCX_{k}", v)
    return env


def iterations(nbytes: int) -> int:
    return max(3, min(100, (128 * MiB) // nbytes))


# ---- measurements: each returns seconds per hand-off (median of its iterations) ----------------

def measure_memcpy(nbytes: int, fresh: bool, device: str = "cpu") -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iterations(nbytes) + 1):
        t0 = time.perf_counter()
        if fresh:
            src.clone()
        else:
            dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


async def measure_connector(producer: PeerProcess, consumer, transport: str, nbytes: int, tag: str,
                            first_read: bool = False) -> float:
    """first_read: the time includes the consumer reading one byte of every page of what it got (a mapped
    tensor's page faults; nearly nothing for a copied one)."""
    times = []
    for i in range(iterations(nbytes) + 1):
        r = await producer.call(op="put", key=[tag, "producer", i, "x"], dtype="uint8", shape=[nbytes], seed=1,
                                transport=transport)
        msg = decode(r["tensor"])
        t0 = time.perf_counter()
        got = await consumer.get(msg)
        if first_read:
            got.reshape(-1).view(torch.uint8)[::PAGE].sum()
        del got  # a mapped tensor is unmapped (and the consumed segment's pages freed) here
        _sync(consumer.device)
        times.append(r["seconds"] + time.perf_counter() - t0)
    return statistics.median(times[1:])


PAGE = 4096


@contextlib.contextmanager
def shm_reads(mapped: bool):
    """Shared-memory gets in this process map the bytes (mapped) or copy them out, whatever their size."""
    mapped_from, shm.MAPPED_FROM = shm.MAPPED_FROM, 0 if mapped else 1 << 62
    try:
        yield
    finally:
        shm.MAPPED_FROM = mapped_from


def measure_shm_write(nbytes: int, mapped: bool) -> float:
    """The producer's one write of `nbytes` into a new segment: pwrite (as `put`), or through a shared mapping."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    header = TensorHeader.of(src, 1)
    times = []
    for i in range(iterations(nbytes) + 1):
        path = Path(f"/dev/shm/omnistage-bench-{os.getpid()}-{i}")
        t0 = time.perf_counter()
        if mapped:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, HEADER_BYTES + nbytes)
                os.pwrite(fd, header.pack(), 0)
                dst = torch.from_file(str(path), shared=True, size=HEADER_BYTES + nbytes, dtype=torch.uint8)
                dst[HEADER_BYTES:].copy_(src)
                del dst
            finally:
                os.close(fd)
        else:
            shm._write_segment(path, header, src)
        times.append(time.perf_counter() - t0)
        path.unlink()
    return statistics.median(times[1:])


async def _done(value: float) -> float:
    return value


async def _shm_forced(producer: PeerProcess, consumer, nbytes: int, tag: str, mapped: bool) -> float:
    with shm_reads(mapped=mapped):
        return await measure_connector(producer, consumer, "shm", nbytes, tag, first_read=True)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


async def measure_inline_grpc(stub, consumer, nbytes: int) -> float:
    request = json.dumps({"nbytes": nbytes}).encode()
    times = []
    for _ in range(iterations(nbytes) + 1):
        t0 = time.perf_counter()
        msg = tensor_pb2.Tensor.FromString(await stub(request))
        await consumer.get(msg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


async def measure_perftest(nbytes: int, *options: str) -> float:
    """ucx_perftest tag_bw (bandwidth, seconds per message) or, at 4 KiB, tag_lat as a round trip.
    options: "-e" peer error handling (as the connector's endpoints have), "-E sleep" wait for
    events instead of busy polling (as the connector's event loop does)."""
    latency = nbytes <= 4 * KiB
    port = _free_port()
    env = {**ucx_env(), "LD_LIBRARY_PATH": str(LIBUCX / "lib")}
    exe = str(PERFTEST)
    common = ["-p", str(port)] + [word for o in options for word in o.split()]
    # plain subprocess (not asyncio's child watcher): UCX in this process may reap children first
    server = subprocess.Popen([exe, *common], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await _until_listening(port, server)
        n = 2000 if latency else max(8, min(400, (2 * 1024 * MiB) // nbytes))
        client = await asyncio.to_thread(
            subprocess.run, [exe, "127.0.0.1", *common, "-t", "tag_lat" if latency else "tag_bw", "-s", str(nbytes),
                             "-n", str(n), "-w", str(max(2, n // 10)), "-f"],
            env=env, capture_output=True, text=True, timeout=300)
    finally:
        server.kill()
        server.wait()
    out = client.stdout
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    if not rows:
        raise RuntimeError(f"ucx_perftest printed no result (exit {client.returncode}): {out[-400:]}")
    row = [float(x) for x in rows[-1]]  # iterations, overhead 50%/avg/overall (us), bw avg/overall (MiB/s), ...
    if latency:
        return 2 * row[2] / 1e6  # one-way latency: a fetch is a round trip
    return nbytes / (row[5] * MiB)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until_listening(port: int, server: subprocess.Popen | None = None, timeout: float = 30) -> None:
    """Poll /proc/net/tcp until something listens on `port` (state 0A); RuntimeError at once if `server`
    exited first (e.g. its UCX could not load a memory type)."""
    want = f":{port:04X} "
    async with asyncio.timeout(timeout):
        while True:
            if server is not None and server.poll() is not None:
                raise RuntimeError(f"ucx_perftest server exited with {server.returncode} before listening")
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                with open(table) as f:
                    if any(want in line and line.split()[3] == "0A" for line in f):
                        return
            await asyncio.sleep(0.02)


# ---- the inline gRPC producer (a process of its own) --------------------------------------------

async def serve_inline() -> None:
    conn = await make_connector("producer", ())
    tensors: dict[int, torch.Tensor] = {}

    async def fetch(request: bytes, context) -> bytes:
        nbytes = json.loads(request)["nbytes"]
        if nbytes not in tensors:
            tensors.clear()
            tensors[nbytes] = make_tensor("uint8", [nbytes], 1)
        msg = await conn.put(TensorKey("bench", "producer", 0, "x"), tensors[nbytes], transport="inline")
        return msg.SerializeToString()

    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "omnistage.bench.Transport", {"Fetch": grpc.unary_unary_rpc_method_handler(fetch)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print("@@ " + json.dumps({"port": port}), flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # until the driver closes our stdin
    await server.stop(1)


async def start_inline_server():
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "--serve-inline",
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    while not (line := await proc.stdout.readline()).startswith(b"@@ "):
        if not line:
            raise RuntimeError("inline gRPC server exited")
    return proc, json.loads(line[3:])["port"]


# ---- the run ------------------------------------------------------------------------------------

async def run(sizes: list[str], rounds: int, fragment_bytes: int, ucx_only: bool = False) -> dict:
    env = ucx_env()
    os.environ.update({k: v for k, v in env.items() if k.startswith("UCX_")})
    producer = PeerProcess("producer", "shm,ucx", host_id="bench", fragment_bytes=fragment_bytes, env=env)
    await producer.start()
    consumer = await make_connector("consumer", ("shm", "ucx"), host_id="bench", fragment_bytes=fragment_bytes)
    inline_proc, port = await start_inline_server()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    stub = channel.unary_unary(FETCH)
    seconds: dict[tuple[str, str], list[float]] = {}
    ratios: dict[str, list[float]] = {}
    shm_ratios: dict[str, list[float]] = {}
    try:
        for rnd in range(rounds):
            for label in sizes:
                n = SIZES[label]
                # the pair the UCX ratio is made of: perftest and the connector back to back, same size
                t = {"ucx_perftest": await measure_perftest(n),
                     "ucx": await measure_connector(producer, consumer, "ucx", n, f"ucx{rnd}{label}")}
                ratios.setdefault(label, []).append(t["ucx_perftest"] / t["ucx"])
                if not ucx_only:
                    # The same-host backends in an order that rotates from round to round: measured in a
                    # fixed order, `shm` always followed the UCX pair and ran 6-24% slower at 64 MiB than
                    # `shm_map`, the same code measured later in the round (2026-12-02, five rounds of five).
                    same_host = {
                        "shm": lambda: measure_connector(producer, consumer, "shm", n, f"shm{rnd}{label}",
                                                         first_read=True),
                        "inline_grpc": lambda: measure_inline_grpc(stub, consumer, n),
                        "memcpy": lambda: _done(measure_memcpy(n, fresh=False)),
                        "memcpy_new": lambda: _done(measure_memcpy(n, fresh=True)),
                        "shm_copy": lambda: _shm_forced(producer, consumer, n, f"shmcopy{rnd}{label}", False),
                        "shm_map": lambda: _shm_forced(producer, consumer, n, f"shmmap{rnd}{label}", True)}
                    names = list(same_host)
                    shift = rnd % len(names)
                    for backend in names[shift:] + names[:shift]:
                        t[backend] = await same_host[backend]()
                    if n >= MiB:
                        t["shm_write_pwrite"] = measure_shm_write(n, mapped=False)
                        t["shm_write_mapped"] = measure_shm_write(n, mapped=True)
                    if n >= 16 * MiB:
                        t["ucx_perftest_e"] = await measure_perftest(n, "-e")
                        t["ucx_perftest_sleep"] = await measure_perftest(n, "-E sleep")
                    shm_ratios.setdefault(f"over_memcpy_new.{label}", []).append(t["memcpy_new"] / t["shm"])
                    shm_ratios.setdefault(f"map_over_copy.{label}", []).append(t["shm_copy"] / t["shm_map"])
                for backend, s in t.items():
                    seconds.setdefault((backend, label), []).append(s)
                print(f"  round {rnd + 1}/{rounds} {label:>6}: " + "  ".join(
                    f"{b} {n / s / 1e9:.2f}" for b, s in t.items()) + f" GB/s  ucx/perftest {ratios[label][-1]:.2f}",
                    flush=True)
    finally:
        await channel.close()
        inline_proc.stdin.close()
        await inline_proc.wait()
        await consumer.close()
        await producer.close()
    return {"seconds": {k: min(v) for k, v in seconds.items()},
            "ratios": {k: statistics.median(v) for k, v in ratios.items()}, "round_ratios": ratios,
            "shm_ratios": {k: statistics.median(v) for k, v in shm_ratios.items()}, "env": env}


async def run_cuda(sizes: list[str], rounds: int, fragment_bytes: int) -> dict:
    """Device memory at both ends: a producer process and this one, both on the first GPU."""
    env = ucx_env()
    os.environ.update({k: v for k, v in env.items() if k.startswith("UCX_")})
    producer = PeerProcess("producer", "shm,ucx", host_id="bench", fragment_bytes=fragment_bytes, env=env,
                           device="cuda")
    ready = await producer.start()
    consumer = await make_connector("consumer", ("shm", "ucx"), host_id="bench", fragment_bytes=fragment_bytes,
                                    device="cuda")
    perftest = PERFTEST.exists()
    notes = [] if perftest else [f"no ucx_perftest at {PERFTEST}: measured without it"]
    if not (ready["ucx_device_memory"] and consumer.ucx_device_memory):
        notes.append("UCX here does not carry device memory: the ucx figures are staged through host memory")
    seconds: dict[tuple[str, str], list[float]] = {}
    paths: dict[str, str] = {}
    try:
        for rnd in range(rounds):
            for label in sizes:
                n = SIZES[label]
                t = {}
                if perftest:
                    try:
                        t["ucx_perftest"] = await measure_perftest(n, "-m cuda")
                    except (RuntimeError, subprocess.SubprocessError, TimeoutError, OSError) as e:  # no CUDA module
                        perftest = False
                        notes.append(f"ucx_perftest -m cuda failed, measured without it: {str(e)[:200]}")
                for backend in ("ucx", "shm"):
                    t[backend] = await measure_connector(producer, consumer, backend, n, f"{backend}{rnd}{label}")
                    r = await producer.call(op="put", key=[f"path{rnd}{label}", "producer", 0, backend], dtype="uint8",
                                            shape=[n], seed=1, transport=backend)
                    msg = decode(r["tensor"])
                    paths[backend] = consumer.path_of(msg)
                    await consumer.get(msg)
                t["memcpy"] = measure_memcpy(n, fresh=False, device="cuda")
                for backend, s in t.items():
                    seconds.setdefault((backend, label), []).append(s)
                print(f"  cuda round {rnd + 1}/{rounds} {label:>6}: " + "  ".join(
                    f"{b} {n / s / 1e9:.2f}" for b, s in t.items()) + " GB/s", flush=True)
    finally:
        await consumer.close()
        await producer.close()
    for note in notes:
        print(f"  note: {note}")
    return {"seconds": {k: min(v) for k, v in seconds.items()}, "env": env, "paths": paths, "notes": notes}


def cuda_figures_of(result: dict, sizes: list[str]) -> list[dict]:
    sec = result["seconds"]
    figs = [figure(f"cuda.{backend}.bw_{label}_GBps", SIZES[label] / s / 1e9, "GB/s")
            for (backend, label), s in sorted(sec.items(), key=lambda kv: (kv[0][0], SIZES[kv[0][1]]))]
    for label in sizes:
        if SIZES[label] >= 16 * MiB and ("ucx_perftest", label) in sec:
            figs.append(figure(f"cuda.ucx.bw_{label}_over_perftest", sec[("ucx_perftest", label)] / sec[("ucx", label)],
                               "ratio"))
    return figs


def figures_of(result: dict, sizes: list[str]) -> list[dict]:
    sec, ratios = result["seconds"], result["ratios"]
    figs = []
    for (backend, label), s in sorted(sec.items(), key=lambda kv: (kv[0][0], SIZES[kv[0][1]])):
        figs.append(figure(f"{backend}.bw_{label}_GBps", SIZES[label] / s / 1e9, "GB/s"))
    if "4KiB" in sizes:
        for backend in BACKENDS:
            if (backend, "4KiB") in sec:
                name = "ucx_perftest.rtt_4KiB_us" if backend == "ucx_perftest" else f"{backend}.lat_4KiB_us"
                figs.append(figure(name, sec[(backend, "4KiB")] * 1e6, "us"))
    for label, r in ratios.items():
        if SIZES[label] >= MiB:  # the figures: medians of paired rounds (goal: >= 0.8 at 16 MiB, 0.9 at 64)
            figs.append(figure(f"ucx.bw_{label}_over_perftest", r, "ratio"))
        if SIZES[label] >= 16 * MiB:
            figs.append(figure(f"ucx_over_perftest.{label}", sec[("ucx_perftest", label)] / sec[("ucx", label)],
                               "ratio"))  # best round over best round
            figs.append(figure(f"ucx_over_perftest_paired_median.{label}", r, "ratio"))
            if ("ucx_perftest_sleep", label) in sec:
                figs.append(figure(f"ucx_over_perftest_sleep.{label}",
                                   sec[("ucx_perftest_sleep", label)] / sec[("ucx", label)], "ratio"))
    if ("shm", "64MiB") in sec:
        figs.append(figure("shm.bw_64MiB_over_memcpy", sec[("memcpy", "64MiB")] / sec[("shm", "64MiB")], "ratio"))
    for label in sizes:  # medians of paired rounds
        if label in SHM_RATIO_SIZES and f"over_memcpy_new.{label}" in result["shm_ratios"]:
            figs.append(figure(f"shm.bw_{label}_over_memcpy_new", result["shm_ratios"][f"over_memcpy_new.{label}"],
                               "ratio"))
        if f"map_over_copy.{label}" in result["shm_ratios"]:
            figs.append(figure(f"shm.map_over_copy.{label}", result["shm_ratios"][f"map_over_copy.{label}"], "ratio"))
    if ("inline_grpc", "1MiB") in sec:
        figs.append(figure("inline.bw_1MiB_GBps", MiB / sec[("inline_grpc", "1MiB")] / 1e9, "GB/s"))
    return figs


def print_table(result: dict, sizes: list[str]) -> None:
    sec = result["seconds"]
    cols = [b for b in BACKENDS + ("ucx_perftest_e", "ucx_perftest_sleep", "shm_write_pwrite", "shm_write_mapped")
            if any((b, s) in sec for s in sizes)]
    print("\nbest of rounds: bandwidth, GB/s (4 KiB: latency, us; ucx_perftest at 4 KiB: round trip)")
    print(f"{'size':>7} " + " ".join(f"{c:>14}" for c in cols) + f" {'ucx/perftest':>13}")
    for label in sizes:
        cells = []
        for c in cols:
            s = sec.get((c, label))
            cells.append("-" if s is None else f"{s * 1e6:.0f} us" if label == "4KiB"
                         else f"{SIZES[label] / s / 1e9:.2f}")
        ratio = (f"{sec[('ucx_perftest', label)] / sec[('ucx', label)]:.2f}"
                 if SIZES[label] > 4 * KiB and ("ucx_perftest", label) in sec else "-")
        print(f"{label:>7} " + " ".join(f"{c:>14}" for c in cells) + f" {ratio:>13}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 KiB to 64 MiB, two rounds")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--sizes", default=None, help="comma-separated, e.g. 16MiB,64MiB")
    p.add_argument("--fragment-bytes", type=int, default=0, help="UCX fragment size (0: the connector's default)")
    p.add_argument("--ucx-only", action="store_true",
                   help="only the UCX pairs (ucx_perftest, ucx); writes bench/results/transport_ucx.json")
    p.add_argument("--serve-inline", action="store_true", help=argparse.SUPPRESS)
    add_device_argument(p)
    args = p.parse_args()
    exit_on_sigterm()
    os.environ.setdefault("UCX_TLS", UCX_TLS[args.device])  # before ucxx loads; peer processes inherit it
    if args.serve_inline:
        asyncio.run(serve_inline())
        return
    require_device(args.device)
    sizes = args.sizes.split(",") if args.sizes else list(QUICK_SIZES if args.quick else SIZES)
    rounds = args.rounds or (2 if args.quick else 5)
    load_before = os.getloadavg()
    if args.device == "cuda":
        main_cuda(args, sizes, rounds, load_before)
        return
    result = asyncio.run(run(sizes, rounds, args.fragment_bytes, args.ucx_only))
    print_table(result, sizes)
    print("ucx / perftest per round: " + "; ".join(
        f"{label} " + " ".join(f"{r:.2f}" for r in rs) for label, rs in result["round_ratios"].items()))
    figs = figures_of(result, sizes)
    for f in figs:
        if "over" in f["name"] or f["name"].startswith("inline."):
            print(f"  {f['name']}: {f['value']}")
    ucx = {k: v for k, v in result["env"].items() if k.startswith("UCX_")}
    settings = {
        "quick": args.quick, "ucx_only": args.ucx_only, "rounds": rounds, "sizes": sizes, "ucx_env": ucx,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "ucx_over_perftest_per_round": result["round_ratios"],
        "method": "best over interleaved rounds of each round's median hand-off time (producer put + consumer "
                  "get; shm, shm_copy, shm_map: + the consumer's first read of every page); "
                  "ucx.bw_<size>_over_perftest, ucx_over_perftest_paired_median and the shm ratios: medians of "
                  "per-round ratios, each round's ucx_perftest and ucx measured back to back at that size"}
    path = write_results("transport_ucx" if args.ucx_only else "transport", figs, {"settings": settings})
    print(f"wrote {path}")


def main_cuda(args, sizes: list[str], rounds: int, load_before) -> None:
    result = asyncio.run(run_cuda(sizes, rounds, args.fragment_bytes))
    print_table(result, sizes)
    print(f"  paths taken: {result['paths']}")
    figs = cuda_figures_of(result, sizes)
    ucx = {k: v for k, v in result["env"].items() if k.startswith("UCX_")}
    path = write_results(results_name("transport", "cuda"), figs, {"run": {
        "quick": args.quick, "rounds": rounds, "sizes": sizes, "ucx_env": ucx, "device": "cuda",
        "paths": result["paths"], "notes": result["notes"],
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "method": "best over interleaved rounds of each round's median hand-off time (producer put + consumer "
                  "get), producer and consumer tensors on the first GPU"}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
