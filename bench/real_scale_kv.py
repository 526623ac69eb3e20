"""The KV budget of a transformers AR stage (`engineArgs.kvCacheBytes`, stage_service/runtime/kv_budget.py)
under many long requests: admitted by KV bytes, preempted by recompute, none failing.

The Qwen3-Omni Talker (the tiny model) as a real stage service in this process (gRPC on loopback, maxBatch
32), fed the rows the tiny Thinker made for `REQUESTS` prompts: every request at once, each asking for as
many codec frames as `FRAMES_PER_PROMPT_ROW` times its prompt rows, first with a budget that holds `ROOM_FOR`
of them at their longest, then the same requests with no budget, side by side in one run:

    kv_budget.peak_over_budget      the most KV bytes the requests' caches held after any step (the stage's
        own measure: every state's SequenceKV bytes, spare room included) over the budget (goal <= 1.0);
    kv_budget.completed_fraction    requests that ended with all their frames, or stopped as they stop
        unbounded (goal 1.0);
    kv_budget.tokens_per_s_over_unbounded   codec frames/s under the budget over the same run unbounded;
    kv_budget.preemptions           running requests preempted (recomputed when readmitted);
    kv_budget.same_codes_fraction   requests whose codes equal the unbounded run's (goal 1.0: greedy).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from common import figure

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
EXAMPLE = "qwen3-omni-tiny"
REQUESTS, ROOM_FOR = 32, 4
PROMPT_ROWS_BEYOND_IDS = 9  # the Qwen3-Omni Talker's prompt rows beyond the Thinker's prompt ids


def _pipeline(kv_cache_bytes: int | None = None):
    import copy

    import yaml

    from omnistage.api import parse_pipeline

    doc = copy.deepcopy(yaml.safe_load((ROOT / "examples" / f"{EXAMPLE}.yaml").read_text()))
    sd = doc["spec"]["deployment"]["stages"]["talker"]
    sd["scheduler"] = {"maxBatch": REQUESTS, "maxQueued": REQUESTS}
    if kv_cache_bytes is not None:
        sd.setdefault("engineArgs", {})["kvCacheBytes"] = kv_cache_bytes
    return parse_pipeline(doc)


async def _call(port: int, request_id: str, chunks=(), timeout: float = 600, **params) -> list | None:
    """One Process call (the header, then `chunks`); its output chunks, or None if it failed."""
    import grpc

    from omnistage.client import build_request
    from omnistage.v1 import stage_pb2, stage_pb2_grpc

    p = build_request(**params).params
    first = [stage_pb2.StageInput(header=stage_pb2.StageRequestHeader(request_id=request_id, params=p))]
    inputs = first + [stage_pb2.StageInput(chunk=c) for c in chunks]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return [o.chunk async for o in stage_pb2_grpc.StageServiceStub(channel).Process(iter(inputs),
                                                                                           timeout=timeout)]
        except grpc.aio.AioRpcError:
            return None


def _tensor(chunk, name: str):
    from omnistage.contract import tensors

    return tensors.from_proto(next(t for t in chunk.tensors if t.name == name))


async def _serve(stage: str, kv_cache_bytes: int | None = None):
    from stage_service.server import StageServer

    srv = StageServer(_pipeline(kv_cache_bytes), stage, "127.0.0.1", 0, model_root=str(MODELS))
    await srv.start()
    return srv


async def _thinker_rows() -> list[list]:
    """The tiny Thinker's output for each request (its rows are what the Talker speaks)."""
    srv = await _serve("thinker")
    try:
        return await asyncio.gather(*(_call(srv.port, f"t{i}", prompt=f"Say {i}", max_tokens=8, ignore_eos=True)
                                      for i in range(REQUESTS)))
    finally:
        await srv.drain()


async def _talk(thinker: list[list], frames: int, kv_cache_bytes: int | None) -> dict:
    """Every request at once on a Talker with that budget: what came back, how long, what it held."""
    srv = await _serve("talker", kv_cache_bytes)
    try:
        started = time.perf_counter()
        outs = await asyncio.gather(*(_call(srv.port, f"s{i}", rows, prompt=f"Say {i}", max_codec_frames=frames)
                                      for i, rows in enumerate(thinker)))
        took = time.perf_counter() - started
        sched = srv.engine.scheduler
        codes = [None if o is None else [_tensor(c, "codes").tolist() for c in o] for o in outs]
        return {"codes": codes, "ends": [None if o is None else o[-1].finish_reason for o in outs],
                "frames": [sum(len(c[0]) for c in cs) if cs else 0 for cs in codes], "seconds": took,
                "peak": sched.kv_peak, "preemptions": sched.preemptions, "pages": srv.engine.kv_pages}
    finally:
        await srv.drain()


def kv_figures(quick: bool) -> list[dict]:
    """The kv_budget.* figures (see the module docstring); quick: shorter requests."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from stage_service.runtime.kv_budget import KvPages

    thinker = asyncio.run(_thinker_rows())
    longest = max(len(_tensor(t[0], "prompt_token_ids")) for t in thinker) + PROMPT_ROWS_BEYOND_IDS
    frames = (1 if quick else 4) * longest
    per_token = 2 * 2 * 16 * 2 * 4  # the tiny Talker in float32: layers x KV heads x head dim x (K, V) x bytes
    budget = ROOM_FOR * KvPages(per_token).bytes_for(longest + frames)
    bounded = asyncio.run(_talk(thinker, frames, budget))
    assert bounded["pages"].per_token == per_token, "the tiny Talker's KV bytes per token changed: update per_token"
    unbounded = asyncio.run(_talk(thinker, frames, None))
    done = [e is not None and (f == frames or e == u) for e, f, u in
            zip(bounded["ends"], bounded["frames"], unbounded["ends"])]
    same = [a is not None and a == b for a, b in zip(bounded["codes"], unbounded["codes"])]
    rate = sum(bounded["frames"]) / bounded["seconds"]
    rate_unbounded = sum(unbounded["frames"]) / unbounded["seconds"]
    return [figure("kv_budget.peak_over_budget", bounded["peak"] / budget, "ratio"),
            figure("kv_budget.completed_fraction", sum(done) / REQUESTS, "ratio"),
            figure("kv_budget.tokens_per_s_over_unbounded", rate / rate_unbounded, "ratio"),
            figure("kv_budget.preemptions", bounded["preemptions"], "preemptions"),
            figure("kv_budget.same_codes_fraction", sum(same) / REQUESTS, "ratio")]
