"""The causal LM's engine core: the model and its sequences in a process of their own
(`engineArgs.engine_process: true`; the protocol is in `stage_service/runtime/engine_process.py`).

`LmCore` runs in the child: it loads the model as the in-process engine does and steps its sequences
with the same `DecoderLm`, so tokens are the same either way. `RemoteTokenState` is a sequence's state
in the stage process: what the service reads (tokens so far, finish reason, bytes held), no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omnistage.contract.devices import DevicePlan
from stage_service.engines.transformers.lm_steps import DecoderLm, TokenStep
from stage_service.runtime import device
from stage_service.runtime.engine_process import CoreStates, RemoteState
from stage_service.runtime.errors import RequestFailed


class LmCore(CoreStates):
    """In the engine process: the model and every live sequence, by id."""

    def __init__(self, model_dir: str, placement: DevicePlan, batch_invariant: bool):
        import torch
        from transformers import AutoModelForCausalLM

        super().__init__()
        device.apply(placement)
        model = AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=device.DTYPES[placement.dtype])
        self.lm = DecoderLm(model.to(torch.device(placement.device)), batch_invariant=batch_invariant)

    def info(self) -> dict:
        return {}

    def add(self, sid: int, spec: tuple) -> None:
        self.states[sid] = self.lm.new_state(*spec)

    def step(self, sids: list[int], feeds=None) -> list[tuple[int, str | None, int] | RequestFailed]:
        """The step's tokens as (token, finish reason, KV bytes), or a request's own failure."""
        states = [self.states[s] for s in sids]
        return [r if isinstance(r, RequestFailed) else (r.token, r.finish_reason, st.kv.nbytes)
                for st, r in zip(states, self.lm.step_batch(states))]


@dataclass(eq=False, kw_only=True)
class RemoteTokenState(RemoteState):
    """A sequence stepped by the engine process, as the stage process sees it."""

    generated: list[int] = field(default_factory=list)
    prompt_rows: object | None = None  # always None: media prompts stay in-process (the Thinker)

    def took(self, token: int) -> TokenStep:
        self.generated.append(token)
        return TokenStep(token, self.finish_reason, None)
