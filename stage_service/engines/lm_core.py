"""The causal LM's engine core: the model and its sequences in a process of their own
(`engineArgs.engine_process: true`; the protocol is in `stage_service/engine_process.py`).

`LmCore` runs in the child: it loads the model as the in-process engine does and steps its sequences
with the same `DecoderLm`, so tokens are the same either way. `RemoteTokenState` is a sequence's state
in the stage process: what the service reads (tokens so far, finish reason, bytes held), no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omnistage.devices import DevicePlan

from ..engine_process import EngineProcess, RemoteSequence
from ..errors import RequestFailed
from ..scheduler import StepState
from . import device
from .lm_steps import DecoderLm, TokenState, TokenStep


class LmCore:
    """In the engine process: the model and every live sequence, by id."""

    def __init__(self, model_dir: str, placement: DevicePlan, batch_invariant: bool):
        import torch
        from transformers import AutoModelForCausalLM

        device.apply(placement)
        model = AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=device.DTYPES[placement.dtype])
        self.lm = DecoderLm(model.to(torch.device(placement.device)), batch_invariant=batch_invariant)
        self.states: dict[int, TokenState] = {}

    def info(self) -> dict:
        return {}

    def add(self, sid: int, spec: tuple) -> None:
        self.states[sid] = self.lm.new_state(*spec)

    def release(self, sid: int) -> None:
        st = self.states.pop(sid, None)
        if st is not None:
            st.release()

    def step(self, sids: list[int], feeds=None) -> list[tuple[int, str | None, int] | RequestFailed]:
        """The step's tokens as (token, finish reason, KV bytes), or a request's own failure."""
        states = [self.states[s] for s in sids]
        return [r if isinstance(r, RequestFailed) else (r.token, r.finish_reason, st.kv.nbytes)
                for st, r in zip(states, self.lm.step_batch(states))]

    def stats(self) -> tuple[int, int]:
        return len(self.states), sum(st.held_bytes() for st in self.states.values())


@dataclass(eq=False)
class RemoteTokenState(StepState):
    """A sequence stepped by the engine process, as the stage process sees it."""

    seq: RemoteSequence
    core: EngineProcess
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    finished: bool = False
    prompt_rows: object | None = None  # always None: media prompts stay in-process (the Thinker)
    kv_bytes: int = 0
    _released: bool = False

    def held_bytes(self) -> int:
        return self.kv_bytes

    def release(self) -> None:
        if not self._released:
            self._released, self.kv_bytes = True, 0
            self.core.release(self.seq)


def remote_step(core: EngineProcess, states: list[RemoteTokenState]) -> list[TokenStep | RequestFailed]:
    """One step of these sequences in the engine process, applied to their stage-side states."""
    out: list[TokenStep | RequestFailed] = []
    for st, r in zip(states, core.step([st.seq for st in states])):
        if isinstance(r, RequestFailed):
            st.finished = True
            out.append(r)
            continue
        token, st.finish_reason, st.kv_bytes = r
        st.generated.append(token)
        st.finished = st.finish_reason is not None
        out.append(TokenStep(token, st.finish_reason, None))
    return out
