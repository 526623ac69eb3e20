"""The step scheduler every batching engine of a stage shares.

A request's engine state (a `StepState`) waits in a bounded queue (maxQueued),
joins the running set when there is room (maxBatch), and at every step the
scheduler runs the engine's step function, on the engine's one worker thread,
over the running states that are ready and share a batch key. Each result goes
to its request's `JobStream`. A state that finishes, fails or is cancelled
leaves at the step boundary and its memory (KV cache, latents) is released.

One shape for every paradigm: AR engines keep a state for many steps
(continuous batching: join at the next step, leave when done), the denoise
loop keeps one per image, decoders submit one-step states (batch what is
queued). When the scheduler wakes from idle it waits up to maxWaitMs for a
batch to fill.

Stepping ahead: while nothing changes (no arrival, departure, cancellation,
newly ready state or reader that caught up; no state finished; every ready
state in the batch; each reader at most one undelivered step behind), the
worker runs the same batch's next step as soon as the last returns, and the
event loop delivers the previous step's results meanwhile. The model does not
wait for the loop between steps (with the model in a process of its own,
`engine_process.py`, the two run at once); any change ends the run at the
next step boundary, where the loop picks again. A state the loop gives up
(cancelled) during a run is released only when the run ends.

KV memory (`kv_budget.py`): with a `kv_budget` (bytes), a queued state joins only while the running
states' KV after their next step plus its own fit, and before each step (stepping ahead included: the run
ends at the boundary where the next step would not fit) the most recently admitted states that can be
recomputed are preempted: their KV is dropped and they wait at the front of the queue, keeping what they
generated. Decisions are taken on the loop between steps, so no state in a step is ever preempted. After
every step the worker measures the bytes the states' caches hold (`kv_peak`).

Deadlines: where states carry a `due` time (audio decoders: when the listener's audio runs out), queued
states are admitted and ready states stepped earliest due first, instead of in arrival order. Under load a
decoder's step cannot take every queued chunk; in arrival order a request's first chunk waits behind the later
chunks of requests whose listeners still have seconds of audio to play, while nothing plays for it yet. The
first chunk is due at once and so goes first, and a chunk whose audio is about to run out goes before one
whose listener has plenty left; among states due at the same time, the order is their arrival.

Work units: a step is one unit of the engine's `unit` per request in it, counted in the stage's
metrics and, per request, in the engine's tally (work_tally.py) for the request's trace.

Failure: a step that raises fails the requests in that step; `max_failed_steps`
failed steps in a row, or one step that raises `EngineDead` (the engine's own
process is gone), mean the engine cannot recover: every request held fails
with `EngineDead` and new ones are refused.

Liveness: a step that never returns (a hung kernel, a deadlock in model code)
fails nothing, so it is watched instead. The step thread stamps when a step starts
and ends, the loop when it goes idle or wakes; `stalled(now)` reads those stamps (from any
thread) and names a step running longer than stallSeconds, or requests held
that long while the loop neither stepped nor waited. Waiting is not stalling:
a state whose input has not arrived, or whose reader fell behind, is another
party's delay, bounded by the request's deadline.

Parking: a state whose reader is `max_pending_results` results behind (a client that stopped reading, far down
the request's path) leaves the running set for the parked set when a queued state waits for a slot, so its
batch slot goes to that state instead of being pinned until the request's deadline (with nobody waiting it
keeps its slot, skipped by the steps until its reader takes results again). Once its reader has taken half of
what waits, it goes back to the front of the queue (it was admitted before anything queued, as a preempted
state is) and continues where it stopped: its state is untouched, and the engines are batch-invariant, so it
makes what it would have made unparked. Parked states count against maxQueued as queued ones do, so a replica
holds at most maxBatch + maxQueued requests, as before (parking one moves a queued one into the batch: the
count stays); the front door's consumer pace ends the requests of clients that do not read. Under a KV budget
a parked state keeps its KV, reserved out of the budget (at its most, `kv_bytes_next`, for one that cannot be
recomputed), as does a state queued again that still holds its KV: admission and preemption count only the
rest, and the "one always runs" rules of kv_budget.py apply only while nothing is reserved, so no state runs
on memory another still holds. When the queue's head does not fit, the parked states that can be recomputed
give their KV back first (they recompute it when they resume); slow readers with nobody waiting recompute
nothing. Without a budget a parked state keeps its memory, as a running one does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Hashable

from omnistage.api import SchedulerSettings
from stage_service.runtime import kv_budget
from stage_service.runtime.errors import EngineDead, EngineError, EngineOverloaded
from stage_service.runtime.work_tally import WorkTally

log = logging.getLogger("omnistage.stage")
_END = object()  # after a state's last result


class StepState:
    """What one request carries through the scheduler. Engines subclass it.

    Read by the scheduler on the event loop (`held_bytes`, `finished` and `ready` also
    while a run steps ahead, so they must be safe to read during a step); changed by
    the engine's step on the worker thread. Code that feeds a state while it may be in a step
    must only append to a thread-safe inbox (a deque) that the step drains.
    """

    finished: bool = False    # set by the step that produced the last result
    key: Hashable = None      # states with equal keys may share a step
    cost: int = 1             # its share of a step's work, against the scheduler's max_step_cost
    # When a listener needs its result (time.perf_counter seconds): an audio decoder's chunk is due when the
    # audio before it runs out, a request's first chunk as soon as it is submitted (nothing plays yet). States
    # that are due are admitted and stepped earliest due first (see Deadlines); None: in arrival order.
    due: float | None = None

    def ready(self) -> bool:
        """True when the next step has what it needs (inputs that stream in may not have arrived)."""
        return True

    def held_bytes(self) -> int:
        """Bytes of tensors this state holds (KV cache, latents)."""
        return 0

    def release(self) -> None:
        """Drop every tensor held; called once, when the state leaves the scheduler."""

    # KV memory, asked only under a budget (kv_budget.py).
    preemptible: bool = False  # whether `preempt` may drop its KV (it recomputes it when readmitted)

    def kv_bytes(self) -> int:
        """Bytes its KV cache really holds now."""
        return 0

    def kv_bytes_next(self) -> int:
        """Bytes its KV cache will hold after its next step (a state that cannot be preempted: at most ever)."""
        return 0

    def preempt(self) -> None:
        """Drop its KV cache, keeping what it generated: its next step recomputes the cache first. Called on the
        loop between steps, never while it is in one."""
        raise NotImplementedError(f"{type(self).__name__} cannot be preempted")


StepFn = Callable[[list[StepState]], list[Any]]


@dataclass(eq=False)
class _Job:
    request_id: str
    state: StepState
    seq: int
    submitted: float = field(default_factory=time.perf_counter)
    results: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_step: float | None = None
    compute_s: float = 0.0  # wall time of the steps it took part in
    last_step: int = -1
    cancelled: bool = False
    gone: bool = False  # left the scheduler


def _due_first(job: _Job) -> tuple:
    """Admission order among queued states: earliest due (states with no due time after those with one),
    then arrival."""
    due = job.state.due
    return (due is None, due or 0.0, job.seq)


def _step_order(job: _Job) -> tuple:
    """Step order among ready states: earliest due, then the one that waited longest for a step."""
    due = job.state.due
    return (due is None, due or 0.0, job.last_step, job.seq)


class JobStream:
    """One request's results, one per step it took part in, in order; errors are raised."""

    def __init__(self, job: _Job, wake: Callable[[], None]):
        self._job = job
        self._wake = wake

    def __aiter__(self) -> "JobStream":
        return self

    async def __anext__(self) -> Any:
        item = await self._job.results.get()
        self._wake()  # a consumer that fell behind makes its state ready again
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def next(self) -> Any:
        """The next result (for one-step states: the only one)."""
        return await self.__anext__()

    def fail(self, error: BaseException) -> None:
        """Something outside the engine (a bad input chunk) ends this request: its reader gets `error`."""
        self._job.results.put_nowait(error)

    @property
    def queue_ms(self) -> float:
        """Time from submission to the first step."""
        j = self._job
        return ((j.first_step or j.submitted) - j.submitted) * 1e3

    @property
    def compute_ms(self) -> float:
        """Time of the steps it took part in so far (each shared with its batch)."""
        return self._job.compute_s * 1e3


class StepScheduler:
    def __init__(self, stage: str, settings: SchedulerSettings, step: StepFn, *, unit: str = "steps",
                 metrics=None, tally: WorkTally | None = None, max_failed_steps: int = 3,
                 max_pending_results: int = 16,
                 max_step_cost: int | None = None, on_dead: Callable[[BaseException], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.stage = stage
        self.max_batch = settings.max_batch
        self.max_queued = settings.max_queued
        self.max_wait = settings.max_wait_ms / 1e3
        self.stall_seconds = settings.stall_seconds
        self.step_fn = step
        self.unit = unit
        self.metrics = metrics
        self.tally = tally if tally is not None else WorkTally()  # units per request, beside the metric
        self.max_failed_steps = max_failed_steps
        self.max_pending_results = max_pending_results
        self.max_step_cost = max_step_cost  # None: as many as maxBatch allows
        self.on_dead = on_dead
        self.failed: BaseException | None = None
        self.steps = 0
        self.kv_budget: int | None = None  # bytes of KV the running states may hold (None: maxBatch alone)
        self.preemptions = 0
        self.kv_peak = 0  # the most KV bytes the states held after a step
        self._queue: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._parked: list[_Job] = []  # out of the batch until their readers catch up (see Parking)
        self._in_step: tuple[_Job, ...] = ()
        # Stepping ahead: set on the loop when something changed (the run ends at the next step boundary);
        # results the worker posted for the run in flight and those the loop delivered (ints: one writer each).
        self._dirty = False
        self._delivered = 0
        self._deliver_failed: Exception | None = None
        self._failed_in_a_row = 0
        self._seq = 0
        self._wake = asyncio.Event()
        self._live: weakref.WeakSet[StepState] = weakref.WeakSet()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"engine-{stage}")
        self._task: asyncio.Task | None = None
        self._closed = False
        # Progress stamps (clock() seconds), written by the step thread (steps) and the loop (idle, wake-up),
        # read by `stalled` on any thread.
        self.clock = clock
        self._step_started: float | None = None  # the step in flight began then
        self._progress_at = clock()              # a step ended, or the loop went idle or woke
        self._idle = False                       # waiting for a wake-up with nothing it could step

    # ------------------------------------------------------------ the engine's side

    async def run_on_worker(self, fn: Callable[..., Any], *args) -> Any:
        """Run blocking model code (loading) on the thread the steps run on, at the next step boundary."""
        self._dirty = True  # a run stepping ahead yields the thread
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def call_on_worker(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the step thread between steps, without waiting for it (nothing after shutdown)."""
        with contextlib.suppress(RuntimeError):  # the pool is shut down
            self._pool.submit(fn)

    def start(self) -> None:
        if not self._closed:
            self._task = asyncio.create_task(self._loop(), name=f"scheduler-{self.stage}")

    async def shutdown(self) -> None:
        self._closed = True
        self._dirty = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for job in [*self._queue, *self._running, *self._parked]:
            job.results.put_nowait(EngineDead("the stage shut down"))
            self._remove(job)
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)  # lets a running step end

    # ------------------------------------------------------------ the request's side

    @contextlib.asynccontextmanager
    async def submit(self, request_id: str, state: StepState, *, admitted: bool = False) -> AsyncIterator[JobStream]:
        """Queue a state; yields its result stream. Leaving the block (done, error, cancel) frees the state
        at the next step boundary. `admitted`: a later part of a request already admitted (no queue limit)."""
        if self.failed is not None:
            raise EngineDead(f"{type(self.failed).__name__}: {self.failed}")
        if self._closed:
            raise EngineDead("the stage shut down")
        # Waiting: those queued and parked, less the batch slots free for them; under a KV budget a free slot is no
        # room (the budget admits), so every queued state waits.
        free = 0 if self.kv_budget is not None else max(0, self.max_batch - len(self._running))
        waiting = len(self._queue) + len(self._parked) + 1 - free
        if not admitted and waiting > self.max_queued:
            parked = f" and {len(self._parked)} parked for slow readers" if self._parked else ""
            raise EngineOverloaded(f"stage {self.stage}: {len(self._queue)} requests queued{parked} "
                                   f"(maxQueued {self.max_queued}, maxBatch {self.max_batch})")
        self._seq += 1
        job = _Job(request_id, state, self._seq)
        self._queue.append(job)
        self._live.add(state)
        self._changed()
        try:
            yield JobStream(job, lambda: self._consumed(job))
        finally:
            self._leave(job)

    def notify(self, state: StepState | None = None) -> None:
        """A state (`state`, or any) may have become ready (its input arrived). A state in the run stepping
        ahead does not end it: the step thread asks each of them `ready()` before every step."""
        if state is None or not any(j.state is state for j in self._in_step):
            self._dirty = True
        self._wake.set()

    def _consumed(self, job: _Job) -> None:
        """A reader took a result: a state held back for its reader may step again."""
        if not job.gone and job not in self._in_step:
            self._dirty = True  # it may join the batch; a state in the run is checked by the worker itself
        self._wake.set()

    # ------------------------------------------------------------ what it holds

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def parked(self) -> int:
        """States out of the batch until their readers catch up (they hold no batch slot)."""
        return len(self._parked)

    def unfinished(self) -> int:
        return len(self._running) + len(self._queue) + len(self._parked)

    def held_bytes(self, request_id: str | None = None) -> int:
        """Bytes the states hold: every live state's, or those of one request's states still in use
        (not those already leaving at the end of the step in flight)."""
        if request_id is None:
            return sum(s.held_bytes() for s in list(self._live))
        return sum(j.state.held_bytes() for j in [*self._queue, *self._running, *self._parked]
                   if j.request_id == request_id and not j.cancelled)

    def live_states(self) -> int:
        """States not yet garbage-collected (a leak check for tests: 0 once every request is gone)."""
        return len(self._live)

    def stalled(self, now: float) -> str | None:
        """Why the engine makes no progress at `now` (a `clock()` time), or None while it does: a step
        running longer than stallSeconds, or requests held that long while the loop neither stepped nor
        waited for input. Reads only stamps the loop writes, so any thread may ask."""
        if self.failed is not None or self._closed:
            return None  # not a stall: the stage is failing or stopping on its own
        started = self._step_started
        if started is not None:
            if now - started > self.stall_seconds:
                return (f"stage {self.stage}: an engine step has been running for {now - started:.0f}s "
                        f"(stallSeconds {self.stall_seconds:g})")
            return None
        held = len(self._running) + len(self._queue)
        # A wake-up may spend up to maxWaitMs filling a batch before its step.
        if held and not self._idle and now - self._progress_at > self.stall_seconds + self.max_wait:
            return (f"stage {self.stage}: {held} request{'s' if held != 1 else ''} held and no engine step for "
                    f"{now - self._progress_at:.0f}s (stallSeconds {self.stall_seconds:g})")
        return None

    # ------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        try:
            await self._serve()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must fail requests, never strand them
            log.error("stage %s: scheduler loop failed\n%s", self.stage, "".join(traceback.format_exception(e)))
            self._die(e.with_traceback(None))

    async def _serve(self) -> None:
        while self.failed is None:
            self._admit()
            batch, alone = self._pick()
            if not batch:
                idle = not self._running
                self._wake.clear()
                self._idle, self._progress_at = True, self.clock()
                await self._wake.wait()
                self._idle, self._progress_at = False, self.clock()
                if idle and self.max_wait > 0:
                    await self._fill()
                continue
            await self._step(batch, alone)

    async def _fill(self) -> None:
        """Coming out of idle: give a batch up to maxWaitMs to fill."""
        deadline = time.monotonic() + self.max_wait
        while len(self._queue) + len(self._running) < self.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    def _admit(self) -> None:
        """Move queued states into the running set while there is room: under maxBatch and, with a KV budget,
        in the budget after preempting the running states that outgrew it. First, states whose readers fell
        behind are parked and those whose readers caught up go back to the front of the queue."""
        moved = self._park()
        if self.kv_budget is not None:
            moved = self._preempt() or moved
        while self._queue and len(self._running) < self.max_batch:
            if self.kv_budget is not None and not self._fits(self._queue[0]):
                moved = self._free_parked() or moved
                if not self._fits(self._queue[0]):
                    break  # in order: the head of the queue waits for room, nobody overtakes it
            self._running.append(self._pop_queued())
            moved = True
        if moved:
            self._changed()

    def _pop_queued(self) -> _Job:
        """The queued state to admit next: the head (preempted and parked states wait at the front, in order), or
        where the states are due (see Deadlines) the earliest due."""
        if self.kv_budget is None and self._queue[0].state.due is not None:
            job = min(self._queue, key=_due_first)
            self._queue.remove(job)
            return job
        return self._queue.popleft()

    def _fits(self, job: _Job) -> bool:
        """Whether a queued state fits the KV budget beside the running states and what is reserved (with
        nothing reserved, kv_budget.admits lets it in when nothing runs)."""
        assert self.kv_budget is not None
        reserved = self._reserved(job)
        running = [j.state.kv_bytes_next() for j in self._running]
        return kv_budget.admits([*running, reserved] if reserved else running, job.state.kv_bytes_next(),
                                self.kv_budget)

    def _free_parked(self) -> bool:
        """Preempt the parked states that can be recomputed and hold KV (their memory goes to the queue's head;
        they recompute it when they resume). Whether any was."""
        freed = [j for j in self._parked if j.state.preemptible and j.state.kv_bytes()]
        for job in freed:
            job.state.preempt()
        self._count_preemptions(len(freed))
        return bool(freed)

    def _count_preemptions(self, n: int) -> None:
        self.preemptions += n
        if n and self.metrics is not None:
            self.metrics.preemptions.labels(self.stage).inc(n)

    def _park(self) -> bool:
        """Park the running states whose readers are `max_pending_results` behind (their batch slots go to
        the queue) and queue again, in front and oldest first, the parked ones whose readers took half of
        what waited. On the loop between steps, so no parked state is in a step. Whether anything moved."""
        resume_at = self.max_pending_results // 2
        back = [j for j in self._parked if j.results.qsize() <= resume_at]
        for job in sorted(back, key=lambda j: j.seq, reverse=True):  # each in front of the older ones
            self._parked.remove(job)
            self._queue.appendleft(job)
        # only when someone waits for the slot: a slow reader with nobody waiting keeps it (and its KV)
        stalled = [j for j in self._running if j.results.qsize() >= self.max_pending_results] if self._queue else []
        for job in stalled:
            self._running.remove(job)
            self._parked.append(job)
        return bool(back or stalled)

    def _reserved(self, skip: _Job | None = None) -> int:
        """KV held out of the running set (see Parking): parked states (at their most when they cannot be
        recomputed) and queued states that still hold theirs; `skip` (the state being admitted) not counted."""
        held = [j for j in list(self._parked) if j is not skip]
        return (sum(j.state.kv_bytes() if j.state.preemptible else j.state.kv_bytes_next() for j in held) +
                sum(j.state.kv_bytes() for j in list(self._queue) if j is not skip))

    def _running_budget(self) -> int:
        """The KV budget left to the running states: what states out of the running set hold is theirs."""
        assert self.kv_budget is not None
        return self.kv_budget - self._reserved()

    def _preempt(self) -> bool:
        """Preempt the running states the budget has no room for after the next step (see kv_budget.py);
        they go back to the front of the queue, the oldest of them first."""
        budget = self._running_budget()
        # the oldest always stays (kv_budget.to_preempt) only while nothing is reserved: else it too may go
        victims = kv_budget.to_preempt([j.state.kv_bytes_next() for j in self._running],
                                       [j.state.preemptible for j in self._running],  # between steps only
                                       budget, keep_oldest=budget == self.kv_budget)
        for i in victims:  # newest first: each goes in front of the one preempted before it
            job = self._running.pop(i)
            job.state.preempt()
            self._queue.appendleft(job)
        self._count_preemptions(len(victims))
        return bool(victims)

    def kv_held(self) -> int:
        """Bytes the states' KV caches hold now (those running, parked, and those waiting preempted, which hold
        none)."""
        return sum(j.state.kv_bytes() for j in [*list(self._running), *list(self._queue), *list(self._parked)])

    def _kv_fits_next(self) -> bool:
        """Whether the running states' KV after their next step fits the budget (read on the worker)."""
        return self.kv_budget is None or \
            sum(j.state.kv_bytes_next() for j in list(self._running)) <= self._running_budget()

    def _pick(self) -> tuple[list[_Job], bool]:
        """The ready running states that share a key with the one that waited longest for a step (or is due
        first: see Deadlines), in that order while their cost fits `max_step_cost` (the first always fits); and whether
        that is every ready state (then the batch may step ahead: it keeps no one waiting)."""
        ready = [j for j in self._running
                 if j.results.qsize() < self.max_pending_results and j.state.ready()]
        if not ready:
            return [], False
        first = min(ready, key=_step_order)
        same = [j for j in ready if j.state.key == first.state.key]
        if self.max_step_cost is not None:
            chosen, cost = set(), 0
            for j in sorted(same, key=_step_order):
                if chosen and cost + j.state.cost > self.max_step_cost:
                    break
                chosen.add(j)
                cost += j.state.cost
            same = [j for j in same if j in chosen]
        return same, len(same) == len(ready)

    async def _step(self, batch: list[_Job], alone: bool) -> None:
        """Run the batch's steps on the worker: one, or while nothing changes several (`alone`: the batch
        holds every ready state, so stepping it on starves no one)."""
        t0 = time.perf_counter()
        for j in batch:
            if j.first_step is None:
                j.first_step = t0
        self._in_step = tuple(batch)
        self._dirty, self._delivered = False, 0
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, self._run, batch, alone, loop)
        except Exception as e:  # noqa: BLE001 - the step's failure is the requests' failure
            self._in_step = ()
            self._step_ended()
            self._step_failed([j for j in batch if not j.gone], e)
            return
        self._in_step = ()
        self._step_ended()
        for j in batch:
            if j.cancelled:
                self._remove(j)  # given up during the run: its state is free now that no step uses it
        if self._deliver_failed is not None:
            self._die(self._deliver_failed)

    def _run(self, batch: list[_Job], ahead: bool, loop: asyncio.AbstractEventLoop) -> None:
        """On the worker: step the batch, post the results to the loop, step again while `_may_go_on`."""
        states = [j.state for j in batch]
        shape = [(st.key, st.cost) for st in states]
        posted = 0
        while True:
            self._step_started = self.clock()
            t0 = time.perf_counter()
            results = self.step_fn(states)
            took = time.perf_counter() - t0
            if len(results) != len(batch):
                raise RuntimeError(f"step returned {len(results)} results for {len(batch)} requests")
            self._progress_at, self._step_started = self.clock(), None
            if self.kv_budget is not None:
                self.kv_peak = max(self.kv_peak, self.kv_held())
            posted += 1
            # Whether each finished with this step, read now: the next step may change the states.
            loop.call_soon_threadsafe(self._deliver, batch, results, [st.finished for st in states], took)
            if not (ahead and self._may_go_on(batch, states, shape, results, posted)):
                return

    def _may_go_on(self, batch: list[_Job], states: list[StepState], shape: list, results: list, posted: int) -> bool:
        """Whether the worker may step the same batch again at once (read on the worker between steps)."""
        behind = posted - self._delivered  # steps whose results the loop has not delivered yet
        return (not self._dirty and not self._closed and behind <= 1
                and not any(isinstance(r, BaseException) for r in results)
                and all(not st.finished and st.ready() for st in states)
                and [(st.key, st.cost) for st in states] == shape
                and self._kv_fits_next()
                and all(j.results.qsize() + behind < self.max_pending_results for j in batch))

    def _deliver(self, batch: list[_Job], results: list, finished: list[bool], took: float) -> None:
        """On the loop: one step's results to their requests. A callback, not the loop task: a bug here
        must still fail the requests (and stop the run) rather than strand them."""
        try:
            self._deliver_step(batch, results, finished, took)
        except Exception as e:  # noqa: BLE001
            log.error("stage %s: delivering a step's results failed\n%s", self.stage,
                      "".join(traceback.format_exception(e)))
            self._dirty = True  # the run ends at the next boundary; `_step` then declares the engine dead
            self._deliver_failed = e.with_traceback(None)

    def _deliver_step(self, batch: list[_Job], results: list, finished: list[bool], took: float) -> None:
        self._failed_in_a_row = 0
        self.steps += 1
        for j, r, done in zip(batch, results, finished):
            j.last_step = self.steps
            j.compute_s += took
            if j.gone or j.cancelled:
                continue  # removed when the run ends (its call is over: nobody takes its tally)
            self.tally.add(j.request_id)  # before its result: the chunk that ends the call carries it
            j.results.put_nowait(r)
            if isinstance(r, BaseException) or done:
                j.results.put_nowait(_END)
                self._remove(j)  # the worker steps no finished state again
        if self.metrics is not None:
            self.metrics.step(len(batch), took, self.unit)
        # Counted last: a delivery that fails part way is not delivered, so the worker, which may step on
        # only while the loop is at most one step behind, stops at the next boundary even before `_dirty`.
        self._delivered += 1

    def _step_ended(self) -> None:
        # The stamp first: a reader that sees no step in flight also sees when the last one ended.
        self._progress_at = self.clock()
        self._step_started = None

    def _step_failed(self, batch: list[_Job], error: Exception) -> None:
        # EngineDead: the engine said it cannot recover (its process is gone): no further step is tried.
        self._failed_in_a_row = self.max_failed_steps if isinstance(error, EngineDead) else self._failed_in_a_row + 1
        # Logged as text and kept without its traceback: the traceback's frames hold the batch's states.
        log.error("stage %s: step failed for %d requests (%d in a row)\n%s", self.stage, len(batch),
                  self._failed_in_a_row, "".join(traceback.format_exception(error)).rstrip())
        error = error.with_traceback(None)
        if self.metrics is not None:
            self.metrics.failed_steps.labels(self.stage).inc()
        for j in batch:  # one exception each: raising one in many readers would chain their tracebacks
            j.results.put_nowait(EngineDead(str(error)) if isinstance(error, EngineDead)
                                 else EngineError(f"step failed: {type(error).__name__}: {error}"))
            self._remove(j)
        if self._failed_in_a_row >= self.max_failed_steps:
            self._die(error)

    def _die(self, error: Exception) -> None:
        self.failed = error
        log.error("stage %s: %d failed steps in a row; the engine cannot recover", self.stage, self._failed_in_a_row)
        for j in [*self._queue, *self._running, *self._parked]:
            j.results.put_nowait(EngineDead(f"{type(error).__name__}: {error}"))
            self._remove(j)
        if self.on_dead is not None:
            self.on_dead(error)

    # ------------------------------------------------------------ leaving

    def _leave(self, job: _Job) -> None:
        """The request is done with its state (finished, failed, cancelled, deadline passed)."""
        if job.gone:
            return
        if job in self._in_step:
            job.cancelled = True  # the step in flight still uses it: it leaves when that step returns
            self._dirty = True
            return
        self._remove(job)

    def _remove(self, job: _Job) -> None:
        if job.gone:
            return
        job.gone = True
        if job in self._running:
            self._running.remove(job)
        elif job in self._parked:
            self._parked.remove(job)
        else:
            with contextlib.suppress(ValueError):
                self._queue.remove(job)
        job.state.release()
        self._changed()

    def _changed(self) -> None:
        self._dirty = True
        self._wake.set()
        if self.metrics is not None:
            self.metrics.load(len(self._running), len(self._queue), len(self._parked))
