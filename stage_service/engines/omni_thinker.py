"""What every omni Thinker stage shares: a causal LM stage that also emits, per chunk, the rows the
Talker is conditioned on (`embeds` and `hidden` of every position fed).

A family's `load` hands `use_thinker` a `DecoderLm` with `tokenizer`, `chat_template`, `stop_ids`,
`vocab`, `new_thinker_state(ids, sampling, max_tokens, ignore_eos)` and `step_thinker(states)` (each
result with `token`, `finish_reason`, `embeds`, `hidden`), and sets `max_len`.
"""

from __future__ import annotations

import torch

from omnistage.params import RequestParams

from .hf_causal import CausalLmEngine, text_sampling


class OmniThinkerEngine(CausalLmEngine):
    """Emits per chunk: `token_ids` (new tokens), `embeds` and `hidden` (rows of every position fed),
    `prompt_token_ids` on the first chunk, and the text delta. The prompt goes through the checkpoint's
    chat template unless the request gives token ids or asks for the raw prompt (`chat.prompt_ids`)."""

    def use_thinker(self, thinker) -> None:
        self.thinker = thinker
        self.tokenizer, self.chat_template = thinker.tokenizer, thinker.chat_template
        self.vocab, self.stop_ids = thinker.vocab, thinker.stop_ids

    def step(self, states) -> list:
        return self.thinker.step_thinker(states)

    def new_state(self, ids, p: RequestParams):
        return self.thinker.new_thinker_state(ids, text_sampling(p), p.max_tokens, p.ignore_eos)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.stop_ids])

    def step_tensors(self, step) -> dict[str, torch.Tensor]:
        return {"embeds": step.embeds, "hidden": step.hidden}
