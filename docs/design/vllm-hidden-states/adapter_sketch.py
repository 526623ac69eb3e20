"""Sketch (not wired in): what stage_service/engines/vllm_ar.py would add for a Thinker on vLLM.

Engine args added when the stage's consumers ask for rows (e.g. component: thinker):
    speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, K]}}},
    kv_transfer_config={"kv_connector": "HiddenStreamConnector",
                        "kv_connector_module_path": "stage_service.engines.vllm_hidden",
                        "kv_role": "kv_producer", "kv_connector_extra_config": {"endpoint": ENDPOINT}},
    enable_prefix_caching=False, async_scheduling=False, max_model_len=limit + 2
(K: Qwen3-Omni talker_config.accept_hidden_layer; Qwen2.5-Omni: N = num_hidden_layers, then the stage applies the
Thinker's final RMSNorm (thinker.model.norm.weight, rms_norm_eps) since vLLM's aux rows are taken before it.)
"""
import asyncio, json

import numpy as np
import torch
import zmq
import zmq.asyncio


class HiddenRows:
    """Receives the connector's messages in the stage process and hands each request its rows in order."""

    def __init__(self, endpoint: str):
        self.sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self.sock.bind(endpoint)
        self.rows: dict[str, dict[int, torch.Tensor]] = {}   # req -> position -> [layers, H]
        self.done: dict[str, asyncio.Event] = {}
        self.changed: dict[str, asyncio.Event] = {}
        self.task = asyncio.create_task(self._pump())

    def open(self, rid: str):
        self.rows[rid], self.done[rid], self.changed[rid] = {}, asyncio.Event(), asyncio.Event()

    async def _pump(self):
        while True:
            rid, hdr, raw = await self.sock.recv_multipart()
            rid, h = rid.decode(), json.loads(hdr)
            if rid not in self.rows:
                continue  # released (aborted) request
            if h["n"]:
                t = torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy()).view(*h["shape"])
                for i in range(h["n"]):
                    self.rows[rid][h["start"] + i] = t[i]   # a recomputed position (preemption) overwrites
            if h["done"]:
                self.done[rid].set()
            self.changed[rid].set()

    async def take(self, rid: str, start: int, end: int, timeout: float = 30.0) -> torch.Tensor:
        """Rows of positions [start, end) as [end - start, layers, H], waiting for the ones not yet here."""
        have = self.rows[rid]
        while any(p not in have for p in range(start, end)):
            if self.done[rid].is_set():
                raise RuntimeError(f"{rid}: engine finished without rows {start}..{end}")
            self.changed[rid].clear()
            await asyncio.wait_for(self.changed[rid].wait(), timeout)
        out = torch.stack([have.pop(p) for p in range(start, end)]) if end > start else None
        return out

    def release(self, rid: str):
        for d in (self.rows, self.done, self.changed):
            d.pop(rid, None)

# In VllmEngine.generate, per chunk of tokens [i, j) (0-based generated indices) of a prompt of P positions:
#   rows = await hidden.take(rid, 0 if first else P + i - 1, P + j - 1)
#   out_t["embeds"], out_t["hidden"] = rows[:, 0], rows[:, 1]        (Qwen2.5: hidden = rms_norm(rows[:, 1]))
# and hidden.release(rid) in the finally block (also on abort).
