"""The omni Talker's engine core: its model and states in a process of their own
(`engineArgs.engine_process: true`; the protocol is in `stage_service/runtime/engine_process.py`).

`TalkerCore` runs in the child: it builds the family's Talker as the in-process engine does
(`build_talker`) and steps its states with the same step code, so the codes are the same either way.
In the stage process, `RemoteTalker` stands where the family's Talker does for `FedTalkerEngine`, and a
`RemoteTalkerState` keeps what the scheduler reads: the Thinker rows that arrived and are not yet sent
(its inbox, fed as today), how many were sent, steps taken, the finish reason. Each step message carries
every state's newly arrived rows; the child appends them to its state's inbox before the step, where
the family's step takes them as it always does. Under a KV budget the child sizes its states' caches
by pages and reports each one's KV bytes with its frame; a preemption reaches it before the next step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omnistage.checkpoints.plan import kv_bytes_per_token
from omnistage.contract.devices import DevicePlan
from omnistage.contract.params import InvalidRequest
from stage_service.engines.omni.inbox import END_OF_TEXT, inbox_ended, speaks_next, step_rows
from stage_service.runtime import device
from stage_service.runtime.engine_process import CoreStates, EngineProcess, RemoteState, remote_step
from stage_service.runtime.errors import RequestFailed
from stage_service.runtime.kv_budget import KvPages
from stage_service.runtime.quantize import quantize_weights
from stage_service.runtime.sampling import SamplingSettings


class WireTensor:
    """A tensor as plain bytes for the pipe. multiprocessing pickles a torch tensor by moving it into
    shared memory and passing a file descriptor: right for big tensors, far too slow for a few rows a step."""

    def __init__(self, t):
        t = t.detach().cpu().contiguous()
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self.data = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""

    def tensor(self):
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(self.dtype).reshape(self.shape)


def wire(x):
    return x if x is END_OF_TEXT else WireTensor(x)


def unwire(x, device):
    return x if x is END_OF_TEXT else x.tensor().to(device)


def talker_kv_per_token(talker, dtype: torch.dtype) -> int:
    """KV bytes per token of a family's Talker decoder in `dtype` (kv_budget.py)."""
    return kv_bytes_per_token(talker.model.model.config.to_dict(), dtype.itemsize)


def speaker_names(talker) -> tuple[list[str], str]:
    """The speakers a Talker accepts (lower-case) and how its refusal lists them."""
    shown = [v["name"] if isinstance(v, dict) else k for k, v in talker.speakers.items()]
    return list(talker.speakers), ", ".join(sorted(shown))


class TalkerCore(CoreStates):
    """In the engine process: the family's Talker and every live state, by id."""

    def __init__(self, engine: type, model_dir: str, placement: DevicePlan, batch_invariant: bool,
                 quantization: str = "", stage: str = "", paged: bool = False):
        super().__init__()
        build = engine.build_talker
        device.apply(placement)
        self.device = torch.device(placement.device)
        self.talker = build(Path(model_dir), device.DTYPES[placement.dtype], batch_invariant, self.device)
        quantize_weights(self.talker.model, quantization, stage)
        self.refused: dict[int, RequestFailed] = {}  # states whose prompt the family refused
        self.kv_per_token = talker_kv_per_token(self.talker, device.DTYPES[placement.dtype])
        self.kv_pages = KvPages(self.kv_per_token) if paged else None  # under a KV budget (kv_budget.py)

    def info(self) -> dict:
        accepted, known = speaker_names(self.talker)
        return {"groups": self.talker.groups, "speakers": accepted, "known": known,
                "prompt_rows_beyond_ids": self.talker.prompt_rows_beyond_ids, "kv_per_token": self.kv_per_token,
                "weights_bytes": device.weights_bytes(self.talker.model), "gpu_bytes": device.gpu_bytes(self.device)}

    def add(self, sid: int, spec: tuple) -> None:
        prompt_ids, embeds, hidden, *rest = spec
        try:
            self.states[sid] = st = self.talker.new_state(prompt_ids, unwire(embeds, self.device),
                                                          unwire(hidden, self.device), *rest)
            if self.kv_pages is not None:
                st.bound_kv(self.kv_pages, len(prompt_ids) + self.talker.prompt_rows_beyond_ids)
        except Exception as e:  # noqa: BLE001 - a request's own prompt fails it alone, at its first step
            self.refused[sid] = RequestFailed(f"{type(e).__name__}: {e}")

    def release(self, sid: int) -> None:
        self.refused.pop(sid, None)
        super().release(sid)

    def step(self, sids: list[int], feeds: list[list]) -> list:
        """The step's ((frame, KV bytes), finish reason, bytes held), or a request's own failure."""
        live = [(i, self.states[s]) for i, s in enumerate(sids) if s not in self.refused]
        out: list = [self.refused.get(s) for s in sids]
        for i, st in live:
            st.inbox.extend(unwire(x, self.device) for x in feeds[i])
        stepped = self.talker.step_batch([st for _, st in live]) if live else []
        for (i, st), r in zip(live, stepped):
            out[i] = r if isinstance(r, RequestFailed) else ((r.frame, st.kv.nbytes), r.finish_reason, st.held_bytes())
        return out


@dataclass
class RemoteTalkerStep:
    frame: list[int] | None
    finish_reason: str | None


@dataclass(eq=False, kw_only=True)
class RemoteTalkerState(RemoteState):
    """A Talker state stepped by the engine process, as the stage process sees it: ready by the same rule
    as `FedTalkerState` (`speaks_next`), counting the rows sent instead of holding them."""

    inbox: deque = field(default_factory=deque)  # appended on the loop, drained on the step thread
    sent_rows: int = 0
    text_done: bool = False
    steps: int = 0
    # Under a KV budget, as FedTalkerState: how its cache is sized, at most its prompt rows; and the KV bytes
    # the child last said it holds.
    kv_pages: KvPages | None = None
    kv_rows: int = 0
    kv_held: int = 0

    recompute: bool = False  # preempted: its next step feeds every row again

    def bound_kv(self, pages: KvPages, prompt_rows: int) -> None:
        self.kv_pages, self.kv_rows = pages, prompt_rows

    @property
    def cost(self) -> int:
        """Rows its next step feeds, as the core's FedTalkerState counts them."""
        return step_rows(self.steps, self.kv_rows, self.recompute)

    @property
    def preemptible(self) -> bool:
        return self.kv_pages is not None

    def kv_bytes(self) -> int:
        return self.kv_held

    def kv_bytes_next(self) -> int:
        return 0 if self.kv_pages is None else self.kv_pages.bytes_for(self.kv_rows + self.steps)

    def preempt(self) -> None:
        self.kv_held = 0  # as the child will hold: it drops the cache before the next step
        self.recompute = True
        self.core.preempt(self.seq)

    def ready(self) -> bool:
        return speaks_next(self.steps, self.sent_rows, self.inbox, self.text_done)

    def text_ended(self) -> bool:
        return inbox_ended(self.inbox)

    def drain(self) -> list:
        """The rows (and end of text) that arrived since the last step, for the step message."""
        out = []
        while self.inbox:
            x = self.inbox.popleft()
            if x is END_OF_TEXT:
                self.text_done = True
            else:
                self.sent_rows += len(x)
            out.append(x)
        return out

    def took(self, value: tuple[list[int] | None, int]) -> RemoteTalkerStep:
        frame, self.kv_held = value
        self.steps += 1
        self.recompute = False
        return RemoteTalkerStep(frame, self.finish_reason)

    def held_bytes(self) -> int:
        return self.child_bytes + sum(x.nbytes for x in list(self.inbox) if x is not END_OF_TEXT)

    def release(self) -> None:
        self.inbox.clear()
        super().release()


class RemoteTalker:
    """What `FedTalkerEngine` asks of a Talker, with the Talker in the engine process."""

    def __init__(self, core: EngineProcess, info: dict):
        self.core = core
        self.groups = info["groups"]
        self.prompt_rows_beyond_ids = info["prompt_rows_beyond_ids"]
        self._speakers, self._known = frozenset(info["speakers"]), info["known"]

    def check_speaker(self, speaker: str) -> None:
        if speaker.lower() not in self._speakers:
            raise InvalidRequest("params.audio.speaker", f'unknown speaker "{speaker}" (known: {self._known})')

    def new_state(self, prompt_ids: list[int], embeds, hidden, sampling: SamplingSettings, max_frames: int,
                  speaker: str) -> RemoteTalkerState:
        self.check_speaker(speaker)
        spec = (list(prompt_ids), wire(embeds), wire(hidden), sampling, max_frames, speaker)
        return RemoteTalkerState(seq=self.core.sequence(spec), core=self.core)

    def step_batch(self, states: list[RemoteTalkerState]) -> list:
        return remote_step(self.core, states, [[wire(x) for x in st.drain()] for st in states])
