"""Next-token choice shared by the AR engines: greedy, or seeded sampling per request.

Each request owns its torch.Generator, so a request's tokens do not depend on
what else shares its batch. The generator lives on the device of the logits it
samples (a CUDA generator for an engine on CUDA: torch.multinomial needs them
together); on the CPU the draws are those of a plain `torch.Generator()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.contract.params import is_greedy


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float | None = None  # None, 0 or below params.MIN_TEMPERATURE: greedy
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


def new_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def apply_repetition_penalty(logits: torch.Tensor, previous: list[int], penalty: float) -> torch.Tensor:
    """As transformers' RepetitionPenaltyLogitsProcessor: shrink the scores of tokens already produced."""
    if penalty == 1.0 or not previous:
        return logits
    idx = torch.tensor(sorted(set(previous)), dtype=torch.long, device=logits.device)
    picked = logits[idx]
    logits = logits.clone()
    logits[idx] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits


def choose(logits: torch.Tensor, s: SamplingSettings, generator: torch.Generator | None) -> int:
    """One token from a 1-D logits vector."""
    if s.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > s.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
