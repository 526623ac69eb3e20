"""A pool of spawned worker processes (the media decoders, the body parsers): one worker's start and end
(`SpawnedWorker`), and the pool's places (`WorkerSlots`), each holding an idle worker or None (none started,
or it ended); a call takes one place and gives it back. Shared by media_pool.py and http_api/parse_workers.py,
which differ in what their workers run."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import queue
from typing import Callable, Generic, Protocol, TypeVar

# How long a worker may take to start (its imports) before it is taken for broken.
WORKER_START_SECONDS = 120.0
# How long a worker whose pipe closed may take to finish dying (a crash) before it is killed: its exit code
# says what happened.
WORKER_EXIT_SECONDS = 10.0
_CONTEXT = multiprocessing.get_context("spawn")


class SpawnedWorker:
    """A worker process on a pipe: started with `target(conn, *args)`, which sends one message once ready;
    `failed(exitcode)` is what to raise when it does not start."""

    def __init__(self, target: Callable, args: tuple, name: str, failed: Callable[[int | None], Exception]):
        self.conn, child = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=target, args=(child, *args), daemon=True, name=name)
        try:
            self.process.start()
        except BaseException:   # no process (EAGAIN, ENOMEM): the pipe goes, both ends
            self.conn.close()
            raise
        finally:
            child.close()
        try:
            if not self.conn.poll(WORKER_START_SECONDS):
                raise EOFError
            self.conn.recv()  # ready: imports done, rlimits set
        except (EOFError, OSError):
            self.end(dying=True)
            raise failed(self.process.exitcode) from None

    def end(self, dying: bool = False) -> None:
        """Kill the worker; `dying`: its pipe closed, so it is ending on its own: let it, for its exit code."""
        if dying:
            self.process.join(WORKER_EXIT_SECONDS)
        self.process.kill()
        self.process.join()
        self.conn.close()

    @property
    def alive(self) -> bool:
        return not self.conn.closed and self.process.is_alive()


class _Process(Protocol):
    pid: int | None


class Worker(Protocol):
    process: _Process

    def end(self) -> None: ...


W = TypeVar("W", bound=Worker)


class WorkerSlots(Generic[W]):
    def __init__(self) -> None:
        self._idle: queue.SimpleQueue[W | None] = queue.SimpleQueue()

    def give(self, worker: W | None) -> None:
        """A place back (or a new one): its idle worker, or None."""
        self._idle.put(worker)

    def take(self) -> W | None:
        """A place, waiting for one to be given back when all are taken."""
        return self._idle.get()

    def pids(self) -> list[int]:
        """The process ids of the idle workers (for tests and diagnostics)."""
        seen = []
        while True:
            try:
                seen.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for w in seen:
            self._idle.put(w)
        return [w.process.pid for w in seen if w is not None and w.process.pid is not None]

    def end_idle(self) -> None:
        """End every idle worker (a pool closing: the places in use end theirs when given back)."""
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.end()
