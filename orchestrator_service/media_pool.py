"""Worker processes that decode request media for the orchestrator, so that a hostile file's decode can
neither crash the orchestrator nor hold a decode slot past its bound.

Each worker is a process of its own (started with `spawn`: forking a process that runs asyncio and gRPC
threads is unsafe), with its address space and CPU time bounded by rlimits it sets on itself before it
decodes anything. The orchestrator talks to it over a pipe, one call at a time. A call that outlives its
bound, or whose worker dies (a native crash, an rlimit), ends that worker; the next call starts a fresh
one. Workers start on first use, not with the server: a pipeline that never sees media pays nothing.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import multiprocessing.connection
import resource
from typing import Any, Callable

from .worker_slots import SpawnedWorker, WorkerSlots

# What one worker may map: the largest part's decode (a video is checked one frame at a time) with room
# for the decoders' own buffers and threads, which reserve address space well beyond what they touch.
WORKER_ADDRESS_SPACE = 4 << 30


class DecodeTimeout(Exception):
    """The call ran past its bound; its worker was ended."""


class DecoderCrashed(Exception):
    """The worker died during the call (a native crash or an rlimit); `exitcode` says how."""

    def __init__(self, exitcode: int | None):
        self.exitcode = exitcode
        super().__init__(f"the decoder process ended with exit code {exitcode}")


class WorkerStartFailed(RuntimeError):
    """A worker did not start (the server's fault, not the request's)."""


class _Worker(SpawnedWorker):
    def __init__(self, address_space: int, preload: tuple[str, ...]):
        super().__init__(_serve, (address_space, preload), "media-decode", lambda code: WorkerStartFailed(
            f"a media decode worker did not start (exit code {code})"))

    def call(self, timeout: float, fn: Callable, args: tuple) -> Any:
        try:
            self.conn.send((math.ceil(timeout) + 1, fn, args))
        except OSError:  # it died since it was last seen alive (a broken pipe)
            self.end(dying=True)
            raise DecoderCrashed(self.process.exitcode) from None
        if not self.conn.poll(timeout):
            self.end()
            raise DecodeTimeout()
        try:
            ok, value = self.conn.recv()
        except (EOFError, OSError):
            self.end(dying=True)
            raise DecoderCrashed(self.process.exitcode) from None
        if not ok:
            raise value
        return value



class MediaPool:
    """At most `workers` worker processes; `call` blocks (run it on a thread), one call per worker at a time.
    The caller bounds how many calls run at once to `workers`."""

    def __init__(self, workers: int, address_space: int = WORKER_ADDRESS_SPACE, preload: tuple[str, ...] = ()):
        """`preload`: modules a worker imports before it says it is ready (those of the functions it will be
        sent), so that no call's bound is spent importing them."""
        self.address_space, self.preload = address_space, preload
        self._idle: WorkerSlots[_Worker] = WorkerSlots()
        for _ in range(workers):
            self._idle.give(None)  # a place for a worker, started on first use
        self._closed = False

    def call(self, timeout: float, fn: Callable, *args) -> Any:
        """`fn(*args)` in a worker, which must end within `timeout` seconds: DecodeTimeout when it does not,
        DecoderCrashed when the worker dies, WorkerStartFailed when none starts; what `fn` raises is raised
        here (it must pickle)."""
        worker = self._idle.take()
        try:
            if worker is not None and not worker.process.is_alive():  # died while idle (killed from outside)
                worker.end(dying=True)
                worker = None
            if worker is None:
                worker = _Worker(self.address_space, self.preload)
            try:
                return worker.call(timeout, fn, args)
            except (DecodeTimeout, DecoderCrashed):
                worker = None  # ended: its place starts a fresh one
                raise
        finally:
            if self._closed and worker is not None:
                worker.end()
                worker = None
            self._idle.give(worker)

    def pids(self) -> list[int]:
        """The process ids of the idle workers (for tests and diagnostics)."""
        return self._idle.pids()

    def close(self) -> None:
        self._closed = True
        self._idle.end_idle()


def _serve(conn: multiprocessing.connection.Connection, address_space: int, preload: tuple[str, ...]) -> None:
    """A worker's loop: bound itself, say ready, then run calls until the pipe closes."""
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash on request bytes leaves no core file of them
    for module in ("omnistage.media", *preload):  # before the first call's clock starts
        importlib.import_module(module)
    try:
        importlib.import_module("av")  # the optional video decoder, where it is installed
    except ImportError:
        pass
    conn.send(True)
    while True:
        try:
            cpu_seconds, fn, args = conn.recv()
        except EOFError:
            return
        # RLIMIT_CPU counts the process's whole life: each call gets its bound on top of what is spent.
        usage = resource.getrusage(resource.RUSAGE_SELF)
        spent = math.ceil(usage.ru_utime + usage.ru_stime)
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        resource.setrlimit(resource.RLIMIT_CPU, (spent + cpu_seconds, hard))
        try:
            result = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 - sent back to the caller, which raises it
            result = (False, e)
        conn.send(result)
