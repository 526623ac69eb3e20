"""The KV budget on the omni Talkers of both families (`engineArgs.kvCacheBytes`, kv_budget.py), behind real
stage services with the tiny models: the Thinker's rows of several requests, then the Talker speaking them
all at once under a budget that holds two: every request gets the codes it gets unbounded, the caches never
hold more than the budget, some were preempted on the way (their rows fed again); a request that could never
fit is refused at once."""

from __future__ import annotations

import asyncio
import weakref

import grpc
import pytest
import torch

from stage_service.engines.omni.talker_core import talker_kv_per_token
from stage_service.runtime.kv_budget import KvPages

from ..harness import all_queued, call_stage, example, header, stage_servers, tensor_of
from .test_stage_support import assert_nothing_held

REQUESTS, ROOM_FOR = 8, 2
FAMILIES = {"qwen3-omni-tiny": 9, "qwen2.5-omni-tiny": 2}  # example -> the Talker's prompt rows beyond its ids


def with_talker(name: str, kv_cache_bytes: int | None = None, engine_process: bool = False):
    def edit(doc):
        args = doc["spec"]["deployment"]["stages"]["talker"].setdefault("engineArgs", {})
        args["engine_process"] = engine_process
        if kv_cache_bytes is not None:
            args["kvCacheBytes"] = kv_cache_bytes
    return example(name, edit)


def codes(chunks) -> torch.Tensor:
    return torch.cat([tensor_of(c, "codes") for c in chunks], 1)


@pytest.fixture(scope="module", params=list(FAMILIES))
async def spoken(request, model_dir):
    """A family: the Thinker's output for each request, the codec frames each asks for (twice its prompt rows, so
    that each grows to three times what it first holds), the budget (room for ROOM_FOR of them at their longest)
    and the codes the Talker makes of them unbounded."""
    name = request.param
    async with stage_servers(with_talker(name), model_dir, ("thinker", "talker")) as servers:
        thinker = await asyncio.gather(*(call_stage(servers["thinker"].port, header(
            f"t{i}", prompt=f"Say {i}", max_tokens=8, ignore_eos=True)) for i in range(REQUESTS)))
        longest = max(len(tensor_of(t[0], "prompt_token_ids")) for t in thinker) + FAMILIES[name]
        frames = 2 * longest
        talker = servers["talker"]
        unbounded = await asyncio.gather(*(call_stage(talker.port, header(f"s{i}", max_codec_frames=frames), t)
                                           for i, t in enumerate(thinker)))
        pages = KvPages(talker_kv_per_token(talker.engine.talker, talker.engine.dtype))
    yield name, thinker, frames, ROOM_FOR * pages.bytes_for(longest + frames), pages, [codes(u) for u in unbounded]


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
async def test_talker_requests_under_a_budget_for_two_get_their_unbounded_codes(model_dir, spoken, engine_process):
    name, thinker, frames, budget, pages, unbounded = spoken
    async with stage_servers(with_talker(name, budget, engine_process), model_dir, ("talker",)) as servers:
        srv = servers["talker"]
        engine, sched = srv.engine, srv.engine.scheduler
        assert sched.kv_budget == budget and engine.kv_pages == pages
        held: list[int] = []
        if not engine_process:  # every state's SequenceKV bytes after every step, read on the step thread
            states, new_state, step = [], engine.talker.new_state, sched.step_fn

            def tracked(*a):
                st = new_state(*a)
                states.append(weakref.ref(st))
                return st

            def measured(batch):
                out = step(batch)
                held.append(sum(st.kv.nbytes for st in (r() for r in list(states)) if st is not None))
                return out
            engine.talker.new_state, sched.step_fn = tracked, measured
        calls = (call_stage(srv.port, header(f"s{i}", max_codec_frames=frames), t) for i, t in enumerate(thinker))
        outs = await all_queued(sched, asyncio.gather(*calls), REQUESTS)
        assert all(torch.equal(codes(o), u) for o, u in zip(outs, unbounded))
        assert sched.preemptions > 0 and 0 < sched.kv_peak <= budget
        assert not held or 0 < max(held) <= budget
        await assert_nothing_held(srv)


async def test_a_talker_request_that_could_never_fit_is_refused_with_the_numbers(model_dir, spoken):
    name, thinker, _, budget, pages, _ = spoken
    async with stage_servers(with_talker(name, budget), model_dir, ("talker",)) as servers:
        too_many = budget // pages.per_token
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(servers["talker"].port, header("long", max_codec_frames=too_many), thinker[0])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "params.audio.max_codec_frames: a prompt of" in e.value.details()
        assert f"plus max_codec_frames ({too_many}) needs" in e.value.details()
        assert f"whole KV budget of {budget} bytes" in e.value.details()
        await assert_nothing_held(servers["talker"])
