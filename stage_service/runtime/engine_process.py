"""A stepped engine's model in a process of its own (`engineArgs.engine_process: true`).

In the stage process the gRPC service, the asyncio loop and the model's Python code share one
interpreter lock: on a small model, whose forward is mostly Python, the service's work per step
(results, detokenizing, chunks, gRPC writes) is time the model does not run. With this option the
model and its sequences (KV caches, generators) live in a child process, the "engine core"; the stage
process keeps what the service needs (tokenizer, requests' progress) and drives the core over a pipe,
one round trip per step from the scheduler's worker thread. While the core computes a step, the stage
process serves; the round trip itself costs a few pickled tuples.

A step may also be sent without waiting for its answer (`submit`, then `collect` from any thread): up to
`MAX_STEPS_IN_FLIGHT` steps are outstanding, so the core starts the next step while the stage process
still applies the one before (the VAE: its PNGs). The core answers in the order the messages went; a
reader takes the answers off the pipe in that order for whoever waits on them.

The stage process's interpreter switches threads every `SWITCH_INTERVAL_S` instead of Python's 5 ms:
its step thread, woken by the core's answer, would otherwise wait up to 5 ms for the event loop to
yield the lock while the core sits idle (measured on the tiny LM at 16 concurrent requests: 0.5 ms
gives about 10% more tokens/s; with the model in-process the shorter interval costs as much).

The core object (`factory`, "module:Class", built in the child from picklable arguments) implements
`info() -> dict`, `add(sid, spec)`, `release(sid)`, `preempt(sid)`, `step(sids, feeds) -> list` (feeds:
what streamed in for each sequence since its last step, or None) and `stats() -> (states, bytes)`.
Sequences are named by integer ids the stage process allocates; a new sequence's spec travels with the
first step that uses it; releases and preemptions (drop a sequence's KV cache under the stage's KV
budget, `kv_budget.py`) travel before the next message. The child exits when the pipe closes (the stage
process ended or was killed), so no core outlives its stage.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import signal
import sys
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from stage_service.runtime.errors import EngineConfigError, EngineDead, EngineError, RequestFailed
from stage_service.runtime.scheduler import StepState

log = logging.getLogger("omnistage.stage")
SWITCH_INTERVAL_S = 0.0005
# Steps sent and not yet answered: two keep the core busy (one computing, the next queued in the pipe) while
# the stage process applies the answer before; a third would only wait in the pipe, its inputs and answer
# held in memory besides (`submit` blocks until an answer is taken: backpressure).
MAX_STEPS_IN_FLIGHT = 2


def serve(conn, factory: Callable[..., Any], args: tuple) -> None:
    """The child's loop: build the core, then answer one message at a time until the pipe closes. Ctrl-C
    reaches the whole process group: the stage process drains on it, so the child ignores it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        core = factory(*args)
        conn.send(("ok", core.info()))
    except Exception as e:  # noqa: BLE001 - the stage process reports it and refuses to start
        conn.send(("load-failed", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    while True:
        try:
            op, *rest = conn.recv()
        except (EOFError, OSError):
            return  # the stage process is gone
        if op == "close":
            return
        released, preempted, *body = rest
        for sid in released:
            try:
                core.release(sid)
            except Exception:
                log.exception("engine process: releasing sequence %d failed", sid)
        for sid in preempted:  # before the step that readmits them: the room they left is free by then
            core.preempt(sid)  # unguarded: a cache left behind would corrupt the sequence's next step
        if op == "release":
            continue  # never answered: the stage process does not wait for it
        try:
            if op == "step":
                new, sids, feeds = body
                for sid, spec in new:
                    core.add(sid, spec)
                conn.send(("ok", core.step(sids, feeds)))
            elif op == "stats":
                conn.send(("ok", core.stats()))
            else:
                conn.send(("failed", f"unknown operation {op!r}", ""))
        except Exception as e:  # noqa: BLE001 - the step's failure, reported to the scheduler
            conn.send(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))


class CoreStates:
    """What every core keeps: its live states by id, freed on release, counted for the leak check."""

    def __init__(self):
        self.states: dict[int, Any] = {}

    def release(self, sid: int) -> None:
        st = self.states.pop(sid, None)
        if st is not None:
            st.release()

    def stats(self) -> tuple[int, int]:
        return len(self.states), sum(st.held_bytes() for st in self.states.values())

    def preempt(self, sid: int) -> None:
        st = self.states.get(sid)
        if st is not None:
            st.preempt()


class RemoteSequence:
    """The stage process's handle on one sequence of the core: its id and, until sent, its spec."""

    def __init__(self, sid: int, spec: Any):
        self.sid = sid
        self.spec = spec  # None once the core has it


class PendingReply:
    """A message the core will answer; its answer once taken off the pipe (`EngineProcess.collect`)."""

    __slots__ = ("op", "answer")

    def __init__(self, op: str):
        self.op = op
        self.answer: tuple | None = None  # ("ok", value) | ("failed", message, trace) | ("dead", why)


class EngineProcess:
    """The stage process's side: starts the core, sends steps, forwards releases. `step`, `submit`, `start`
    and `stats` run on the scheduler's worker thread (one at a time); `collect` on any thread; `release`
    may be called from any thread: it queues the id and asks `on_release` to flush it from that worker
    thread."""

    def __init__(self, stage: str, factory: Callable[..., Any], args: tuple):
        self.stage = stage
        self._factory, self._args = factory, args
        self._ids = itertools.count(1)
        self._released: deque[int] = deque()
        self._preempted: deque[int] = deque()
        self._lock = threading.Lock()  # one sender at a time: the answers come back in the order sent
        self._replies = threading.Condition()  # guards what follows; notified when an answer is taken
        self._pending: deque[PendingReply] = deque()  # sent and not yet answered, oldest first
        self._reading = False  # a thread waits on the pipe for the oldest answer
        self._dead: str | None = None  # why the pipe is gone, once a reader found it so
        self.steps_sent = 0
        self.peak_in_flight = 0  # the most messages outstanding at once (a step ahead shows as 2)
        self._conn = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        # Called after a release is queued: the owner flushes on its step thread (the queue also travels
        # with the next message). Never `flush` itself from the loop: it waits for a step in flight.
        self.on_release: Callable[[], None] = lambda: None

    def start(self) -> dict:
        """Start the child and wait for its core to load; returns the core's `info()`."""
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads and gRPC
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child, self._factory, self._args), daemon=True,
                                 name=f"engine-core-{self.stage}")
        self._proc.start()
        child.close()
        status, *rest = self._recv("loading the model")
        if status != "ok":
            message, trace = rest
            log.error("stage %s: the engine process failed to load\n%s", self.stage, trace.rstrip())
            raise EngineConfigError(f"the engine process could not load the model: {message}")
        return rest[0]

    def sequence(self, spec: Any) -> RemoteSequence:
        return RemoteSequence(next(self._ids), spec)

    def step(self, seqs: list[RemoteSequence], feeds: list | None = None) -> list:
        """One step of the core over these sequences: its list of results, one per sequence. `feeds`: what
        arrived for each sequence since its last step (streamed inputs), in the core's form."""
        return self.collect(self.submit(seqs, feeds))

    def submit(self, seqs: list[RemoteSequence], feeds: list | None = None) -> PendingReply:
        """Send a step without waiting for its results (`collect` takes them); blocks while
        `MAX_STEPS_IN_FLIGHT` are outstanding."""
        new = [(s.sid, s.spec) for s in seqs if s.spec is not None]
        reply = self._submit("step", new, [s.sid for s in seqs], feeds)
        for s in seqs:
            s.spec = None
        self.steps_sent += 1
        return reply

    @property
    def in_flight(self) -> int:
        """Messages sent and not yet answered."""
        return len(self._pending)

    def stats(self) -> tuple[int, int]:
        """(sequences the core holds, their bytes): a leak check."""
        return self._call("stats")

    def release(self, seq: RemoteSequence) -> None:
        self._released.append(seq.sid)
        self.on_release()

    def preempt(self, seq: RemoteSequence) -> None:
        """Drop the sequence's KV cache in the core (it keeps its tokens and generator), before the next step."""
        self._preempted.append(seq.sid)
        self.on_release()

    def flush(self) -> None:
        """Send queued releases and preemptions now (the core frees their memory before any later step)."""
        with self._lock:
            if (self._released or self._preempted) and self._alive():
                self._send("release")

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to exit (it ends once its steps in flight do), let their answers be collected, then
        end it if it has not exited."""
        if self._proc is None:
            return
        if self._lock.acquire(timeout=timeout):
            try:
                if self._alive():
                    with contextlib.suppress(OSError):
                        self._conn.send(("close",))
            finally:
                self._lock.release()
        with self._replies:  # answers still on their way go to those who wait on them, not to a closed pipe
            self._replies.wait_for(lambda: not self._pending or self._dead is not None, timeout)
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout)
        self._conn.close()

    def kill(self) -> None:
        """End the child now (a step that hangs): the step waiting on it gets `EngineDead`."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()

    # ------------------------------------------------------------------ the pipe

    def _call(self, op: str, *body) -> Any:
        return self.collect(self._submit(op, *body))

    def _submit(self, op: str, *body) -> PendingReply:
        with self._lock:
            with self._replies:
                while len(self._pending) >= MAX_STEPS_IN_FLIGHT and self._dead is None:
                    self._replies.wait()  # an answer taken makes room
                if self._dead is not None or not self._alive():
                    raise self._gone()
                reply = PendingReply(op)
                self._pending.append(reply)  # before sending: a reader may take its answer at once
                self.peak_in_flight = max(self.peak_in_flight, len(self._pending))
            try:
                self._send(op, *body)
            except BaseException:
                with self._replies:
                    if reply in self._pending:  # never sent: no answer comes for it (a reader may have failed it)
                        self._pending.remove(reply)
                    self._replies.notify_all()
                raise
        return reply

    def collect(self, reply: PendingReply) -> Any:
        """Wait for the answer to a message sent (`submit`) and return its value; raises the core's failure
        (`EngineError`), or `EngineDead` when the process exited first. Answers come in the order sent: the
        waiter that reads the pipe hands each answer to its own message and wakes the others."""
        with self._replies:
            while reply.answer is None:
                if self._reading:
                    self._replies.wait()
                    continue
                self._reading = True
                self._replies.release()  # read without the condition: others submit or wait meanwhile
                try:
                    answer = self._recv(f"running a {self._pending[0].op}")
                except EngineDead as e:
                    answer = ("dead", str(e))
                except BaseException as e:  # noqa: BLE001 - an answer taken off the pipe and not understood
                    # (unpickling it failed): what follows on the pipe no longer matches the messages sent, so
                    # no later answer can be handed to its own: the core is as good as gone
                    answer = ("dead", f"stage {self.stage}: an answer of the engine process could not be read "
                                      f"({type(e).__name__}: {e})")
                finally:
                    self._replies.acquire()
                    self._reading = False
                if answer[0] == "dead":  # every message outstanding fails the same way, and later ones too
                    self._dead = answer[1]
                    while self._pending:
                        self._pending.popleft().answer = answer
                else:
                    self._pending.popleft().answer = answer
                self._replies.notify_all()
        status, *rest = reply.answer
        if status == "ok":
            return rest[0]
        if status == "dead":
            raise EngineDead(rest[0])
        message, trace = rest
        log.error("stage %s: the engine process failed a %s\n%s", self.stage, reply.op, trace.rstrip())
        raise EngineError(message)

    def _send(self, op: str, *body) -> None:
        """One message, with the releases and preemptions queued so far (put back if it could not go)."""
        released, preempted = self._drain(self._released), self._drain(self._preempted)
        try:
            self._conn.send((op, released, preempted, *body))
        except BaseException as e:
            self._released.extendleft(reversed(released))
            self._preempted.extendleft(reversed(preempted))
            if isinstance(e, OSError):
                raise self._gone() from None
            raise

    def _recv(self, doing: str) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._gone(doing) from None

    @staticmethod
    def _drain(ids: deque[int]) -> list[int]:
        out = []
        while ids:
            out.append(ids.popleft())
        return out

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and not self._conn.closed

    def _gone(self, doing: str = "") -> EngineDead:
        if self._dead is not None:
            return EngineDead(self._dead)
        if self._proc is not None:
            self._proc.join(1.0)
        code = None if self._proc is None else self._proc.exitcode
        return EngineDead(f"the engine process exited (exit code {code}){f' while {doing}' if doing else ''}")


@dataclass(eq=False, kw_only=True)
class RemoteState(StepState):
    """A state stepped by the engine process, as the stage process sees it: its sequence, how it finished,
    the bytes the child holds for it. Subclasses turn a step's value into the engine's result (`took`)."""

    seq: RemoteSequence
    core: EngineProcess
    finish_reason: str | None = None
    finished: bool = False
    child_bytes: int = 0
    _released: bool = False

    def took(self, value: Any) -> Any:
        """This state's result of a step whose value (a token, a frame) the core sent."""
        raise NotImplementedError

    def held_bytes(self) -> int:
        # Nothing once released: a step's answer may be taken on another thread after the state left (the VAE's
        # decode sent ahead), and the bytes it reports are the ones the release freed.
        return 0 if self._released else self.child_bytes

    def release(self) -> None:
        if not self._released:
            self._released, self.child_bytes = True, 0
            self.core.release(self.seq)


def remote_step(core: EngineProcess, states: list[RemoteState], feeds: list | None = None) -> list:
    """One step of these states in the engine process (the core answers (value, finish reason, bytes)
    per state, or the state's own `RequestFailed`), applied to their stage-side states."""
    out = []
    for st, r in zip(states, core.step([st.seq for st in states], feeds)):
        if isinstance(r, RequestFailed):
            st.finished = True
            out.append(r)
            continue
        value, st.finish_reason, st.child_bytes = r
        st.finished = st.finish_reason is not None
        out.append(st.took(value))
    return out
