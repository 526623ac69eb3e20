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
from stage_service.engines.transformers.lm_steps import DecoderLm, TokenStep, kv_reserve
from stage_service.runtime import device
from stage_service.runtime.engine_process import CoreStates, RemoteState
from stage_service.runtime.errors import RequestFailed
from stage_service.runtime.quantize import quantize_weights


class LmCore(CoreStates):
    """In the engine process: the model and every live sequence, by id."""

    def __init__(self, model_dir: str, placement: DevicePlan, batch_invariant: bool, quantization: str = "",
                 stage: str = "", paged: bool = False):
        import torch
        from transformers import AutoModelForCausalLM

        super().__init__()
        device.apply(placement)
        model = AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=device.DTYPES[placement.dtype])
        model = quantize_weights(model.to(torch.device(placement.device)), quantization, stage)
        self.lm = DecoderLm(model, batch_invariant=batch_invariant, paged=paged)

    def info(self) -> dict:
        """What the stage process sizes the KV budget from (kv_budget.py): the weights' bytes and the GPU's."""
        return {"weights_bytes": device.weights_bytes(self.lm.model), "gpu_bytes": device.gpu_bytes(self.lm.device),
                "kv_per_token": self.lm.kv_per_token}

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
    # What the KV budget reads (the core's TokenState sizes its cache alike: lm_steps.kv_reserve).
    prompt_len: int = 0
    max_tokens: int = 0
    kv_pages: object | None = None  # KvPages under a budget
    preemptible: bool = False

    prefill: bool = True  # its next step feeds the prompt and every token so far (it joins, or was preempted)
    prefill_chunk: int = 0  # the most tokens a step feeds it (0: no bound), as the core's TokenState
    prefilled: int = 0  # of those, fed by earlier steps (a prompt prefilled in pieces)

    @property
    def cost(self) -> int:
        """Tokens its next step feeds, as the core's TokenState counts them."""
        if not self.prefill:
            return 1
        todo = self.prompt_len + len(self.generated) - self.prefilled
        return min(todo, self.prefill_chunk) if self.prefill_chunk else todo

    def took(self, token: int | None) -> TokenStep:
        if token is None:  # a piece of its prompt fed, nothing sampled
            self.prefilled += self.cost
            return TokenStep(None, None, None)
        self.generated.append(token)
        self.prefill, self.prefilled = False, 0
        return TokenStep(token, self.finish_reason, None)

    def kv_bytes(self) -> int:
        return self.child_bytes

    def kv_bytes_next(self) -> int:
        return kv_reserve(self.kv_pages, self.prompt_len, len(self.generated), self.max_tokens, self.preemptible)

    def preempt(self) -> None:
        self.child_bytes = 0  # as the core will hold: it drops the cache before the next step
        self.prefill, self.prefilled = True, 0
        self.core.preempt(self.seq)
