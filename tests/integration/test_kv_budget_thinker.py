"""The KV budget on the omni Thinkers of both families (`engineArgs.kvCacheBytes`): a Thinker's sequences
are admitted by their whole reservation (prompt + max_tokens, in pages) and never preempted (recomputing
one would need its media rows again and must not send the Talker rows twice). Several requests under a
budget that holds two: every one gets the tokens and rows it gets unbounded, the caches never hold more
than the budget, nothing was preempted; one that could never fit is refused at once with the numbers."""

from __future__ import annotations

import asyncio
import weakref

import grpc
import pytest
import torch

from stage_service.runtime.kv_budget import KvPages

from ..harness import all_queued, call_stage, example, header, stage_servers, tensor_of, token_ids
from .test_stage_support import assert_nothing_held

REQUESTS, ROOM_FOR, MAX_TOKENS = 6, 2, 12


def with_thinker(name: str, kv_cache_bytes: int | None = None):
    def edit(doc):
        if kv_cache_bytes is not None:
            doc["spec"]["deployment"]["stages"]["thinker"].setdefault("engineArgs", {})["kvCacheBytes"] = kv_cache_bytes
    return example(name, edit)


def ask(i: int):
    return header(f"t{i}", prompt=f"Count to {i}", max_tokens=MAX_TOKENS, ignore_eos=True)


def rows(chunks) -> torch.Tensor:
    return torch.cat([tensor_of(c, "hidden") for c in chunks])


@pytest.mark.parametrize("name", ["qwen3-omni-tiny", "qwen2.5-omni-tiny"])
async def test_thinker_requests_under_a_budget_for_two_get_their_unbounded_tokens(model_dir, name):
    async with stage_servers(with_thinker(name), model_dir, ("thinker",)) as servers:
        unbounded = await asyncio.gather(*(call_stage(servers["thinker"].port, ask(i)) for i in range(REQUESTS)))
        lm = servers["thinker"].engine.thinker
        longest = max(len(tensor_of(u[0], "prompt_token_ids")) for u in unbounded)
        budget = ROOM_FOR * KvPages(lm.kv_per_token).bytes_for(longest + MAX_TOKENS - 1)
    async with stage_servers(with_thinker(name, budget), model_dir, ("thinker",)) as servers:
        srv = servers["thinker"]
        sched = srv.engine.scheduler
        assert sched.kv_budget == budget
        states: list = []
        new_state = srv.engine.new_state

        def tracked(*a):
            st = new_state(*a)
            states.append(weakref.ref(st))
            return st
        srv.engine.new_state = tracked
        held: list[int] = []
        step = sched.step_fn

        def measured(batch):
            out = step(batch)
            held.append(sum(st.kv.nbytes for st in (r() for r in list(states)) if st is not None))
            return out
        sched.step_fn = measured
        bounded = await all_queued(sched, asyncio.gather(*(call_stage(srv.port, ask(i)) for i in range(REQUESTS))),
                                   REQUESTS)
        assert [token_ids(b) for b in bounded] == [token_ids(u) for u in unbounded]
        assert all(torch.equal(rows(b), rows(u)) for b, u in zip(bounded, unbounded))
        assert 0 < max(held) <= budget and sched.kv_peak <= budget
        assert max(held) > budget // ROOM_FOR  # all queued at once: it ran more than one at a time
        assert sched.preemptions == 0
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(srv.port, header("long", prompt="Count", max_tokens=40 * MAX_TOKENS))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "params.text.max_tokens: prompt (" in e.value.details()
        assert f"whole KV budget of {budget} bytes" in e.value.details()
        await assert_nothing_held(srv)
