"""AR stages on transformers for causal LMs vLLM does not serve (or to compare against vLLM)."""

from __future__ import annotations

from typing import AsyncIterator

import torch
from transformers.cache_utils import DynamicCache

from omnistage.params import InvalidRequest

from .base import OutputChunk, SerialEngine, StageInputs, StageRequest
from .qwen3_omni import TextDeltas, text_sampling
from .sampling import choose, new_generator


class HfCausalEngine(SerialEngine):
    def load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.vocab = self.model.config.vocab_size
        self.eos = self.model.config.eos_token_id

    def _step(self, state: dict) -> int:
        with torch.inference_mode():
            feed = state["ids"] if not state["generated"] else state["generated"][-1:]
            out = self.model(input_ids=torch.tensor([feed]), past_key_values=state["cache"], use_cache=True)
        token = choose(out.logits[0, -1], state["sampling"], state["generator"])
        state["generated"].append(token)
        return token

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        p = req.params
        ids = list(p.prompt_token_ids) or self.tokenizer(p.prompt)["input_ids"]
        if any(t >= self.vocab for t in ids):
            raise InvalidRequest("params.prompt_token_ids", f"token ids must be < {self.vocab}")
        sampling = text_sampling(p)
        async with self.slot() as queue_ms:
            state = {"ids": ids, "generated": [], "cache": DynamicCache(config=self.model.config),
                     "sampling": sampling, "generator": None if sampling.greedy else new_generator(p.seed)}
            deltas = TextDeltas(lambda toks: self.tokenizer.decode(toks, skip_special_tokens=True))
            chunk, tokens, compute, first = self.stage.chunk_size, [], 0.0, True
            while True:
                token, ms = await self.run(self._step, state)
                compute += ms
                tokens.append(token)
                finish = ("stop" if token == self.eos and not p.ignore_eos else
                          "length" if len(state["generated"]) >= p.max_tokens else "")
                if finish or (chunk and len(tokens) >= chunk):
                    out_t = {"token_ids": torch.tensor(tokens, dtype=torch.int64)}
                    if first:
                        out_t["prompt_token_ids"] = torch.tensor(ids, dtype=torch.int64)
                    yield OutputChunk(tensors=out_t,
                                      text=deltas.delta(state["generated"], bool(finish)), last=bool(finish),
                                      finish_reason=finish, queue_ms=queue_ms if first else 0.0, compute_ms=compute)
                    first, tokens, compute = False, [], 0.0
                if finish:
                    return
