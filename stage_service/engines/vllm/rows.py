"""Hidden-state rows from a vLLM engine, stage side: the engine arguments that make vLLM's engine core
send them (`rows_engine_args`), and the receiver that hands each request its rows in order
(`RowsReceiver`). The engine-core side is `vllm_rows_connector`.

Why this route (docs/stages.md, "Hidden states out of vLLM"): vLLM's outputs carry tokens only; its
`extract_hidden_states` speculative method captures chosen layers per token into a paged cache, and a KV
connector of ours (a public plugin point, loaded by module path) reads that cache each step. No vLLM
file is patched. Costs: each decode step computes one draft position more; the rows' cache shares the
KV memory budget; prefix caching and async scheduling are off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, Callable

import torch

CONNECTOR_MODULE = "stage_service.engines.vllm.rows_connector"
# At the length limit vLLM skips the drafter and with it the last rows: the engine gets this much room more.
LENGTH_MARGIN = 2
POLL_S = 0.5  # how often a waiting take() looks whether the engine is still alive


def engine_length(stage_limit: int | None, model_limit: int | None) -> tuple[int, int]:
    """(vLLM's max_model_len, the stage's admission limit) for a stage asking `stage_limit` of a model that
    takes `model_limit` positions (pure): vLLM gets LENGTH_MARGIN more, within the model's limit. A stage that
    asks no limit gets the model's."""
    if stage_limit is None:
        if model_limit is None:
            raise ValueError("the Thinker's config declares no max_position_embeddings: set engineArgs.max_model_len")
        stage_limit = model_limit
    engine = stage_limit + LENGTH_MARGIN if model_limit is None else min(stage_limit + LENGTH_MARGIN, model_limit)
    return engine, engine - LENGTH_MARGIN


def rows_engine_args(layers: list[int], endpoint: str, engine_max_len: int) -> dict[str, Any]:
    """AsyncEngineArgs keywords that make vLLM send the rows of `layers` (0: input embeddings, i: the
    residual stream after decoder layer i) to `endpoint`, the engine taking `engine_max_len` positions
    (`engine_length`) (pure)."""
    return {
        "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                               "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}},
        "kv_transfer_config": {"kv_connector": "RowsConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                               "kv_role": "kv_producer", "kv_connector_extra_config": {"endpoint": endpoint}},
        "enable_prefix_caching": False,  # a cached prefix would skip its positions' rows
        "async_scheduling": False,
        "max_model_len": engine_max_len,
    }


def ours(vllm_id: str, open_ids) -> str | None:
    """The call id we gave vLLM for vLLM's own (which may carry a `-<8 hex>` suffix vLLM appends), if open."""
    if vllm_id in open_ids:
        return vllm_id
    head, _, tail = vllm_id.rpartition("-")
    return head if head in open_ids and len(tail) == 8 else None


# The connector's message, one per engine step for all the requests it read (`step_frames`, `read_step`):
# [json {"dtype", "row": [layers, hidden], "reads": [[vLLM request id, first position, count, done], ...]},
#  the reads' rows back to back, [sum of counts, layers, hidden], raw bytes].


def step_frames(reads: list[list], rows: torch.Tensor) -> list:
    """One step's message: `reads` as [vLLM request id, first position, count, done], `rows` (on the CPU)
    their rows in that order. The rows go as a view of the tensor's memory (no copy: send with copy=False)."""
    head = {"dtype": str(rows.dtype).removeprefix("torch."), "row": list(rows.shape[1:]), "reads": reads}
    return [json.dumps(head).encode(), rows.contiguous().view(torch.uint8).numpy()]


def read_step(frames) -> tuple[list[list], torch.Tensor]:
    """(reads, rows) of a `step_frames` message (frames: bytes or ZMQ frames); the rows are a view of the
    message's memory."""
    head = json.loads(bytes(frames[0]))
    dtype, row = getattr(torch, head["dtype"]), head["row"]
    raw = memoryview(frames[1])
    rows = torch.frombuffer(raw, dtype=dtype).view(-1, *row) if len(raw) else torch.empty((0, *row), dtype=dtype)
    return head["reads"], rows


class RowsMissing(RuntimeError):
    pass


def gaps(parts: list[tuple[int, torch.Tensor]], start: int, end: int) -> list[tuple[int, int]]:
    """The ranges of [start, end) that no part (first position, rows) covers (pure)."""
    spans = sorted((max(s, start), min(s + len(r), end)) for s, r in parts if s < end and s + len(r) > start)
    out, at = [], start
    for lo, hi in spans:
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < end:
        out.append((at, end))
    return out


class _Rows:
    __slots__ = ("parts", "done", "changed")

    def __init__(self):
        # (first position, rows [n, layers, hidden]) in arrival order: a recomputed position (after preemption)
        # arrives later and wins. One part per step that read the request, a view of that step's message.
        self.parts: list[tuple[int, torch.Tensor]] = []
        self.done = False
        self.changed = asyncio.Event()

    def cut(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) (all there), out of the parts; parts before `end` are dropped."""
        first = self.parts[0][1]
        out = first.new_empty((end - start, *first.shape[1:]))
        kept = []
        for s, r in self.parts:
            lo, hi = max(s, start), min(s + len(r), end)
            if lo < hi:
                out[lo - start:hi - start] = r[lo - s:hi - s]
            if s + len(r) > end:
                # what is left of a part partly taken is copied out: as a view it would keep the whole step's
                # message alive until the last of its rows is taken
                tail = r[max(0, end - s):]
                kept.append((max(s, end), tail if len(tail) == len(r) else tail.clone()))
        self.parts = kept
        return out


class RowsReceiver:
    """Binds `endpoint` (ZMQ PULL) in the stage process; each open request gets its rows by position.
    Rows of requests not open (released, aborted) are dropped on arrival."""

    def __init__(self, endpoint: str, engine_dead: Callable[[], BaseException | None] = lambda: None):
        """`engine_dead`: the error that ended the engine, or None while it runs (a waiting `take` checks it
        every `POLL_S`, so rows that will never come fail their call at once)."""
        import zmq
        import zmq.asyncio

        self.endpoint = endpoint
        self._engine_dead = engine_dead
        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._sock.bind(endpoint)
        self._open: dict[str, _Rows] = {}
        self._task: asyncio.Task | None = None
        self.received_bytes = 0

    @property
    def open_requests(self) -> list[str]:
        return list(self._open)

    def parts_held(self, request_id: str) -> int:
        """How many received parts request `request_id` holds (rows not taken yet)."""
        return len(self._open[request_id].parts)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._pump())

    def open(self, request_id: str) -> None:
        self._open[request_id] = _Rows()

    def release(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    async def _pump(self) -> None:
        while True:
            reads, rows = read_step(await self._sock.recv_multipart(copy=False))
            # One request's rows are a view of the message; several requests' are copied apart: as views, one
            # request whose rows wait (a slow reader) would keep every other request's rows of the step alive.
            shared = sum(1 for _, _, n, _ in reads if n) > 1
            at = 0
            for vid, start, n, done in reads:
                rid = ours(vid, self._open)
                if rid is not None:
                    entry = self._open[rid]
                    if n:
                        part = rows[at:at + n].clone() if shared else rows[at:at + n]
                        entry.parts.append((start, part))
                        self.received_bytes += part.nbytes
                    entry.done = entry.done or done
                    entry.changed.set()
                at += n

    async def take(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Rows of positions [start, end) as [end - start, layers, hidden], waiting for those not here yet:
        until they come, the engine is dead, or the call ends (its deadline cancels it). Takes go forward:
        rows before `end` are let go."""
        entry = self._open[request_id]
        if end <= start:
            raise ValueError(f"no positions in [{start}, {end})")
        while missing := gaps(entry.parts, start, end):
            if entry.done:
                positions = [p for lo, hi in missing for p in range(lo, hi)]
                raise RowsMissing(f"vLLM finished request {request_id} without the rows of positions {positions}")
            dead = self._engine_dead()
            if dead is not None:
                raise RowsMissing(f"the vLLM engine stopped ({type(dead).__name__}) before the rows of request "
                                  f"{request_id} came") from dead
            entry.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.changed.wait(), POLL_S)
        return entry.cut(start, end)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close(linger=0)
