"""Prototype: Qwen3-Omni's Talker on vLLM through public extension points only.

- `TalkerConnector` (kv_transfer_config.kv_connector_module_path): its scheduler side puts, for every
  scheduled request, the cache slots of the tokens it feeds this step (and, on a request's first step,
  its payload from SamplingParams.extra_args["kv_transfer_params"]: the Thinker's projected text rows)
  into the step's connector metadata; vLLM binds that metadata in the worker before the model's forward.
- `TalkerProto` (registered with ModelRegistry): vLLM's Qwen3-MoE decoder (the Talker's text model has its
  layout, shared expert included) plus transformers' code predictor. Its forward maps each input row to its
  request through the forward context's slot mapping, runs the code predictor for the decode rows (the
  previous frame's residual groups, from the previous step's hidden row and the fed first code's
  embedding), adds their embeddings and the text row, and then runs the decoder.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

TRACE = os.environ.get("TALKER_TRACE") == "1"


@dataclass
class Sched:
    req_id: str
    slots: list[int]          # cache slot of each token fed this step
    start: int                # position of the first of them
    payload: dict | None = None  # first step only
    new_rows: list | None = None  # streaming: Thinker rows arrived since the last step
    ended: bool = False           # streaming: the Thinker's text has ended


# Streaming Thinker rows, by key (the prototype's stand-in for a ZMQ socket from the stage process):
# {"rows": [row lists], "arrived": n, "ended": bool, "lock": threading.Lock()}
STREAM: dict[str, dict] = {}
DEFERRED = {"n": 0}


from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402


class TalkerScheduler(Scheduler):
    """vLLM's scheduler (SchedulerConfig.scheduler_cls), holding back for one schedule() call every running
    request whose next Thinker row has not arrived, as vLLM's own DiffusionAsyncScheduler defers a request."""

    def schedule(self, *args, **kwargs):
        if self.connector is not None:
            for request in self.running:
                if not self.connector.ready(request):
                    request.next_decode_eligible_step = max(request.next_decode_eligible_step,
                                                            self.current_step + 2)
                    DEFERRED["n"] += 1
        return super().schedule(*args, **kwargs)


@dataclass
class TalkerMeta(KVConnectorMetadata):
    reqs: list[Sched] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)


class TalkerConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.blocks: dict[str, list[int]] = {}
        self.stream_key: dict[str, str] = {}   # vLLM request id -> key in STREAM
        self.sent: dict[str, int] = {}
        self.block = None
        if kv_cache_config is not None:
            self.block = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, so) -> KVConnectorMetadata:
        meta = TalkerMeta(finished=set(so.finished_req_ids))
        start: dict[str, int] = {}
        payload: dict[str, dict] = {}
        for new in so.scheduled_new_reqs:
            self.blocks[new.req_id] = list(new.block_ids[0])
            start[new.req_id] = new.num_computed_tokens
            extra = (new.sampling_params.extra_args or {}) if new.sampling_params else {}
            payload[new.req_id] = extra.get("kv_transfer_params")
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            added = c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                self.blocks[rid] = list(added[0]) if added is not None else []
            elif added is not None:
                self.blocks[rid].extend(added[0])
            start[rid] = c.num_computed_tokens[i]
        for rid, n in so.num_scheduled_tokens.items():
            b, s = self.blocks[rid], start[rid]
            slots = [b[p // self.block] * self.block + p % self.block for p in range(s, s + n)]
            sched = Sched(rid, slots, s, payload.get(rid))
            if sched.payload and "stream_key" in sched.payload:
                self.stream_key[rid] = sched.payload["stream_key"]
                self.sent[rid] = 0
            if rid in self.stream_key:
                src = STREAM[self.stream_key[rid]]
                with src["lock"]:
                    arrived, ended = src["arrived"], src["ended"]
                sched.new_rows = src["rows"][self.sent[rid]:arrived]
                sched.ended = ended
                self.sent[rid] = arrived
            meta.reqs.append(sched)
        for rid in so.finished_req_ids:
            self.blocks.pop(rid, None)
        return meta

    def ready(self, request) -> bool:
        """Whether a running request's next step can run: a prefill, or the Thinker row its decode step
        speaks (row k for the token fed at position P + k) has arrived, or the text has ended."""
        rid = request.request_id
        key = self.stream_key.get(rid)
        if key is None or request.num_computed_tokens < request.num_prompt_tokens:
            return True
        src = STREAM[key]
        with src["lock"]:
            return src["ended"] or request.num_computed_tokens - request.num_prompt_tokens < src["arrived"]

    def request_finished(self, request, block_ids):
        self.blocks.pop(request.request_id, None)
        self.stream_key.pop(request.request_id, None)
        self.sent.pop(request.request_id, None)
        return False, None

    # worker side
    def current(self) -> TalkerMeta | None:
        return self._get_connector_metadata() if self.has_connector_metadata() else None

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass

    def wait_for_save(self):
        pass


@dataclass
class ReqState:
    prompt_len: int
    rows: list                # projected Thinker rows [H] (static: the end-of-text row last)
    pad: torch.Tensor         # [H]
    eos: torch.Tensor | None = None  # streaming: the end-of-text row, spoken once after the rows
    ended: bool = False
    past_hidden: torch.Tensor | None = None
    residual: list[list[int]] = field(default_factory=list)  # per decode step: the previous frame's residual codes


# What the model computed, by vLLM request id: read by the prototype's driver (same process).
RESULTS: dict[str, ReqState] = {}
TIMES = {'forward': 0.0, 'ours': 0.0, 'code_predictor': 0.0, 'decoder': 0.0, 'steps': 0}


class TalkerProto(Qwen3MoeForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import \
            Qwen3OmniMoeTalkerCodePredictorConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import \
            Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration
        cfg = vllm_config.model_config.hf_config
        cp_cfg = Qwen3OmniMoeTalkerCodePredictorConfig(**cfg.code_predictor_config)
        self.code_predictor = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(cp_cfg).float().eval()
        self.groups = cp_cfg.num_code_groups
        self.vocab = cfg.vocab_size
        self.eos = cfg.codec_eos_token_id
        sup = torch.zeros(self.vocab, dtype=torch.bool)
        sup[self.vocab - 1024:] = True
        sup[self.eos] = False
        self.register_buffer("suppress", sup, persistent=False)
        self.state: dict[str, ReqState] = RESULTS

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        cp_sd = {}

        def talker_text():
            for name, w in weights:
                if name.startswith("talker.code_predictor."):
                    cp_sd[name.removeprefix("talker.code_predictor.")] = w
                elif name == "talker.model.codec_embedding.weight":
                    yield "model.embed_tokens.weight", w
                elif name == "talker.codec_head.weight":
                    yield "lm_head.weight", w
                elif name.startswith("talker.model."):
                    yield name.removeprefix("talker."), w
        loaded = super().load_weights(talker_text())
        missing, unexpected = self.code_predictor.load_state_dict(cp_sd, strict=False)
        assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
        loaded |= {f"code_predictor.{k}" for k in self.code_predictor.state_dict()}
        return loaded

    # -------------------------------------------------------------- per step
    def _rows_of(self, meta: TalkerMeta, num_tokens: int) -> list[tuple[str, int]]:
        """(request id, position) of each input row, through the forward context's slot mapping."""
        from vllm.forward_context import get_forward_context
        sm = get_forward_context().slot_mapping
        slots = next(iter(sm.values()))[:num_tokens].tolist()
        where = {}
        for r in meta.reqs:
            for k, s in enumerate(r.slots):
                where[s] = (r.req_id, r.start + k)
        return [where[s] for s in slots]

    @torch.inference_mode()
    def _residuals(self, past: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy residual codes [n, G-1] of frames whose first code embeds as `first` [n, H], and the sum of
        the frames' code embeddings [n, H] (as the transformers Talker sums them)."""
        from transformers.cache_utils import DynamicCache
        cp = self.code_predictor
        cache = DynamicCache(config=cp.config)
        emb = torch.stack([past, first], dim=1)
        codes, tables = [], cp.get_input_embeddings()
        for g in range(self.groups - 1):
            out = cp.model(inputs_embeds=emb, past_key_values=cache, use_cache=True)
            c = cp.lm_head[g](out.last_hidden_state[:, -1]).argmax(-1)
            codes.append(c)
            emb = tables[g](c)[:, None]
        codes = torch.stack(codes, 1)
        summed = torch.stack([first] + [tables[g](codes[:, g]) for g in range(self.groups - 1)]).sum(0)
        return codes, summed

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        meta = get_kv_transfer_group().current() if has_kv_transfer_group() else None
        if meta is None or not meta.reqs:  # profiling / warm-up
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        import time
        t0 = time.perf_counter()
        for rid in meta.finished:
            pass  # the prototype's driver reads RESULTS after the run
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        inputs_embeds = inputs_embeds.clone()
        for r in meta.reqs:
            if r.payload is not None:
                p = r.payload
                if "stream_key" in p:
                    self.state[r.req_id] = ReqState(p["prompt_len"], [], torch.tensor(p["pad"]), torch.tensor(p["eos"]))
                else:
                    self.state[r.req_id] = ReqState(p["prompt_len"], list(torch.tensor(p["rows"]).unbind(0)),
                                                    torch.tensor(p["pad"]))
            if r.new_rows:
                self.state[r.req_id].rows.extend(torch.tensor(r.new_rows, dtype=torch.float32).unbind(0))
            if r.ended:
                self.state[r.req_id].ended = True
        n = sum(len(r.slots) for r in meta.reqs)
        owners = self._rows_of(meta, n)
        dec = [i for i, (rid, pos) in enumerate(owners) if pos >= self.state[rid].prompt_len]
        if dec:
            idx = torch.tensor(dec)
            past = torch.stack([self.state[owners[i][0]].past_hidden for i in dec])
            tc = time.perf_counter()
            codes, summed = self._residuals(past, inputs_embeds[idx])
            TIMES['code_predictor'] += time.perf_counter() - tc
            text = []
            for j, i in enumerate(dec):
                rid, pos = owners[i]
                st = self.state[rid]
                k = pos - st.prompt_len  # decode step s = k + 1 speaks text row k
                if k < len(st.rows):
                    text.append(st.rows[k])
                elif st.eos is not None and st.ended and k == len(st.rows):
                    text.append(st.eos)
                else:
                    assert st.eos is None or st.ended, f"request {rid} stepped before its Thinker row {k} came"
                    text.append(st.pad)
                st.residual.append(codes[j].tolist())
            inputs_embeds[idx] = summed + torch.stack(text)
            self._push([(owners[i][0], owners[i][1] - self.state[owners[i][0]].prompt_len, codes[j].tolist())
                        for j, i in enumerate(dec)])
        td = time.perf_counter()
        hidden = super().forward(None, positions, intermediate_tensors, inputs_embeds)
        TIMES['decoder'] += time.perf_counter() - td
        last = {}
        for i, (rid, _) in enumerate(owners):
            last[rid] = i
        for rid, i in last.items():
            self.state[rid].past_hidden = hidden[i].clone()
        TIMES['forward'] += time.perf_counter() - t0
        TIMES['steps'] += 1
        if TRACE:
            print("STEP", len(owners), len(dec), len(meta.reqs), flush=True)
        return hidden

    _sock = None

    def _push(self, items):
        """Residual codes out of the engine process: [(request, output index, codes)] over ZMQ, as the rows
        connector sends the Thinker's rows (TALKER_CODES_ENDPOINT; in-process runs read RESULTS instead)."""
        ep = os.environ.get("TALKER_CODES_ENDPOINT")
        if not ep:
            return
        if self._sock is None:
            import zmq
            self._sock = zmq.Context.instance().socket(zmq.PUSH)
            self._sock.connect(ep)
        import json
        self._sock.send(json.dumps(items).encode())

    def compute_logits(self, hidden_states):
        logits = super().compute_logits(hidden_states)
        if logits is not None:
            logits = logits.masked_fill(self.suppress[: logits.shape[-1]], float("-inf"))
        return logits


def register():
    from vllm import ModelRegistry
    if "TalkerProto" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("TalkerProto", "talker_plugin:TalkerProto")
