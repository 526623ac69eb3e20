"""Worker processes that parse and translate the API's large request bodies, so that a parse does not hold
the orchestrator's event loop.

Parsing (pydantic-core reading the JSON into strings) and the translation (base64 decoding of media parts)
hold Python's lock for as long as each native call runs: on a thread of the orchestrator, a body at the chat
limit stops every other stream's tokens for a few hundred milliseconds at a time. In a worker process they stop
nothing. What crosses the pipe is cheap for the orchestrator to handle: the body goes out as it is (written from
a view of its bytes, not copied), and the plan comes back as its small part (pickled, with its media parts'
bytes taken out) followed by each media part's bytes on their own, read and set into the request one part at a
time on a waiting thread: no single step holds the lock longer than copying one part.

A refusal (the body's shape, a field the translation refuses, an unknown model) is made into its OpenAI error
in the worker by the same mapping as in the process (`errors.from_exception`), and raised here as that error.
Workers start with the API, in the background (a request waits for a starting one rather than starting its
own), one for each body the body budget lets be read at once; each bounds its own address space. A worker that
dies or outlives PARSE_SECONDS is ended and its place starts a fresh one. Like media_pool's decoders, they are
started with `spawn`: forking a process that runs asyncio and gRPC threads is unsafe.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import resource
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from pydantic import BaseModel

from omnistage.api import Pipeline

from ..worker_slots import SpawnedWorker, WorkerSlots
from .errors import ApiError

log = logging.getLogger("omnistage.orchestrator.http_api")

# How long one parse may take in a worker before it is ended: a body at the chat limit (170 MiB of media
# parts) takes about 1.5 s on a loaded core; this bounds a parser gone wrong, not a slow one.
PARSE_SECONDS = 60.0
# What a worker may map: the interpreter and its imports, then a body at the limit held as bytes, as the
# parsed strings, as the decoded parts and as the request that carries them, with room to spare.
WORKER_BASE_ADDRESS_SPACE = 2 << 30
BODY_COPIES = 6
# A parse is background work next to the streams the event loop serves: where the two compete for a core, the
# loop goes first.
PARSER_NICENESS = 5
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20  # blocks from this size get a mapping of their own, unmapped when freed
_MEDIA = ("image", "audio", "video")  # the content parts whose bytes travel apart from the plan


def address_space_for(body_limit: int) -> int:
    return WORKER_BASE_ADDRESS_SPACE + BODY_COPIES * body_limit


class _Worker(SpawnedWorker):
    def __init__(self, pipeline: Pipeline, address_space: int):
        super().__init__(_serve, (pipeline, address_space), "body-parse",
                         lambda code: _unavailable(f"a body parser did not start (exit code {code})"))

    def parse(self, held: list[bytes], model: type[BaseModel], translation: Callable) -> Any:
        """The plan of the body in `held` (taken: this process holds it only until it is sent; blocking), or the
        ApiError its refusal is; a worker that fails is ended first."""
        try:
            self.conn.send((model, translation))
        except OSError:  # it died since it was last seen alive (a broken pipe): the body is still here
            self.end(dying=True)
            raise _Gone from None
        try:
            body = held.pop()
            self.conn.send_bytes(body)
            del body
            if not self.conn.poll(PARSE_SECONDS):
                self.end()
                raise ApiError(413, f"the body took longer than {PARSE_SECONDS:g} s to parse",
                               code="request_too_large")
            kind, value = self.conn.recv()
            if kind == "refused":
                raise ApiError(**value)
            if kind == "fault":
                raise ParserFault(value)
            blobs = [self.conn.recv_bytes() for _ in value]
            plan = self.conn.recv()
            plans = plan if isinstance(plan, list) else [plan]
            for plan_at, part_at, kind_ in value:  # each part's bytes set in one step of its own
                getattr(plans[plan_at].request.params.parts[part_at], kind_).data = blobs.pop(0)
            return plan
        except (EOFError, OSError):  # it died: a native crash or its address-space bound
            self.end(dying=True)
            raise ApiError(413, f"the body could not be parsed within this server's bounds (the parser ended with "
                                f"exit code {self.process.exitcode})", code="request_too_large") from None
        except (ApiError, ParserFault):  # its whole answer was read: the pipe is in step for the next body
            raise
        except BaseException:  # anything else mid-exchange (MemoryError here) leaves bytes unread: not reused
            self.end()
            raise



class _Gone(Exception):
    """The worker was dead before it took the body."""


class ParserFault(RuntimeError):
    """The parser failed on its own (not a refusal of the body); its traceback, for the log."""


def _unavailable(message: str) -> ApiError:
    return ApiError(503, f"{message}; retry", "service_unavailable_error", code="unavailable",
                    headers={"Retry-After": "1"})


class ParseWorkers:
    """`workers` parser processes, started in the background by `start`; `parse` runs one body in one of them
    (at most `workers` at once; the others wait for a free one)."""

    def __init__(self, pipeline: Pipeline, workers: int, address_space: int):
        self.pipeline, self.workers, self.address_space = pipeline, workers, address_space
        self._idle: WorkerSlots[_Worker] = WorkerSlots()
        self._waiters = ThreadPoolExecutor(workers, thread_name_prefix="body-parse")
        self._slots = asyncio.Semaphore(workers)
        self._closed = self._starting = False
        self.parsed = 0  # bodies parsed (or refused) by a worker: for tests and diagnostics
        self.parsed_by: set[int] = set()  # the process ids that parsed them

    def start(self) -> None:
        """Start the workers on a thread of their own: the API serves while they start (once)."""
        if not self._starting:
            self._starting = True
            threading.Thread(target=self._start_all, name="body-parse-start", daemon=True).start()

    def _start_all(self) -> None:
        for _ in range(self.workers):
            self._idle.give(self._started())

    def _started(self) -> _Worker | None:
        """A new worker; None (its place, started on use) when it fails to, or the pool closed meanwhile."""
        try:
            worker = _Worker(self.pipeline, self.address_space)
        except Exception as e:  # noqa: BLE001 - whatever stops a start, its place still goes in (start on use)
            if self._closed:  # ended by the close
                return None
            log.warning("HTTP API: %s", e.message if isinstance(e, ApiError) else f"a body parser did not start: {e}")
            return None
        if self._closed:
            worker.end()
            return None
        return worker

    async def parse(self, body: io.BytesIO, model: type[BaseModel], translation: Callable) -> Any:
        """`body` (taken: closed) parsed as `model` and translated by `translation` (a module-level function)
        in a worker: the plan, or the ApiError of its refusal, as the in-process parse would answer."""
        held = [body.getvalue()]  # the only reference: the worker's send drops it once the body is out
        body.close()
        self.start()  # (started with the API; here only where an app was built without one)
        await self._slots.acquire()
        try:
            if self._closed:
                raise _unavailable("the API is stopping")
            parsing = asyncio.get_running_loop().run_in_executor(self._waiters, self._call, held, model, translation)
        except BaseException:
            self._slots.release()
            raise
        del held
        parsing.add_done_callback(self._parsed)
        # Shielded: a request that goes away leaves its parse to end (within PARSE_SECONDS), which frees the slot.
        return await asyncio.shield(parsing)

    def _parsed(self, parsing: asyncio.Future) -> None:
        self._slots.release()
        if not parsing.cancelled():
            parsing.exception()  # retrieved: a parse whose request went away is not reported as unhandled

    def _call(self, held: list[bytes], model: type[BaseModel], translation: Callable) -> Any:
        worker = self._idle.take()  # a starting worker is waited for
        try:
            if self._closed:
                raise _unavailable("the API is stopping")
            if worker is not None and not worker.alive:  # died while idle (killed from outside)
                worker.end(dying=True)
                worker = None
            if worker is None:
                worker = _Worker(self.pipeline, self.address_space)
            try:
                return self._parse(worker, held, model, translation)
            except _Gone:  # died while idle, unseen (killed from outside): a fresh one takes the body
                worker = _Worker(self.pipeline, self.address_space)
                return self._parse(worker, held, model, translation)
        finally:
            if worker is not None and (self._closed or not worker.alive):
                if self._closed and worker.alive:
                    worker.end()
                worker = None
            self._idle.give(worker)

    def _parse(self, worker: _Worker, held: list[bytes], model: type[BaseModel], translation: Callable) -> Any:
        pid = worker.process.pid
        try:
            return worker.parse(held, model, translation)
        finally:
            self.parsed += 1
            if pid is not None:
                self.parsed_by.add(pid)

    def pids(self) -> list[int]:
        """The process ids of the idle workers (for tests and diagnostics)."""
        return self._idle.pids()

    def close(self) -> None:
        self._closed = True
        self._waiters.shutdown(wait=False, cancel_futures=True)
        self._idle.end_idle()


def _serve(conn: multiprocessing.connection.Connection, pipeline: Pipeline, address_space: int) -> None:
    """A worker's loop: bound itself, import the parser, say ready, then parse bodies until the pipe closes."""
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash on request bytes leaves no core file of them
    _return_freed_memory()
    os.nice(PARSER_NICENESS)
    from .body_models import bounded
    from .errors import from_exception

    schemas = bounded(pipeline.limits)
    conn.send(True)
    while True:
        try:
            model, translation = conn.recv()
            held = [conn.recv_bytes()]
        except EOFError:
            return
        # A function of its own: what it built is freed when it returns (an idle worker holds no body).
        _answer(conn, held, schemas[model], translation, pipeline, from_exception)


def _answer(conn: multiprocessing.connection.Connection, held: list[bytes], model: type[BaseModel],
            translation: Callable, pipeline: Pipeline, from_exception: Callable[[BaseException], ApiError]) -> None:
    """Parse and translate the body in `held` (taken) and send the answer: the plan, its media parts' bytes
    after it; or the refusal as its OpenAI error; or the fault's traceback."""
    try:
        request = model.model_validate_json(held.pop(), strict=True)
        plan = translation(request, pipeline)
        del request
    except MemoryError:
        conn.send(("refused", dataclasses.asdict(ApiError(
            413, "the body takes more memory to parse than this server allows", code="request_too_large"))))
        return
    except Exception as e:  # noqa: BLE001 - a refusal goes back as its OpenAI error, a fault with its traceback
        conn.send(("fault", traceback.format_exc()) if _fault(e) else
                  ("refused", dataclasses.asdict(from_exception(e))))
        return
    # Where the media parts are, then their bytes one at a time (a part's copy only while it is sent), then the
    # plan without them.
    media = [(plan_at, part_at, part) for plan_at, translated in enumerate(plan if isinstance(plan, list) else [plan])
             for part_at, part in enumerate(translated.request.params.parts)
             if part.WhichOneof("part") in _MEDIA and getattr(part, part.WhichOneof("part")).data]
    conn.send(("plan", [(plan_at, part_at, part.WhichOneof("part")) for plan_at, part_at, part in media]))
    for _, _, part in media:
        conn.send_bytes(getattr(part, part.WhichOneof("part")).data)
    for _, _, part in media:
        getattr(part, part.WhichOneof("part")).data = b""
    del media
    conn.send(plan)


def _return_freed_memory() -> None:
    """Large blocks from their own mappings, always: glibc otherwise raises its threshold after freeing one
    (up to 32 MiB), and an idle worker would keep a parsed body's parts' worth of heap."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc: its allocator's own policy
        pass


def _fault(e: Exception) -> bool:
    """Whether `e` is the parser's own failure rather than a refusal of the body (from_exception's reading)."""
    from pydantic import ValidationError

    from omnistage.contract.params import InvalidRequest

    from .errors import UnknownModel

    return not isinstance(e, (ApiError, ValidationError, InvalidRequest, UnknownModel))
