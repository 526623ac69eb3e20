"""The causal LM and the Talker with their model in a process of their own (`engineArgs.engine_process:
true`), behind real stage services: the same tokens and codes as in the stage process, sequences freed in
the child, the child's death taken as the engine's. (The staged-equals-monolith tests run the Talker of
both omni families in an engine process too.)"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading

import grpc
import psutil
import pytest

from stage_service.engines.registry import create_engine
from stage_service.runtime.engine_process import MAX_STEPS_IN_FLIGHT, EngineProcess, RemoteState
from stage_service.runtime.errors import EngineConfigError, EngineDead

from ..harness import call_stage, example, header, in_engine_process, stage_servers, start_stage, tensor_of, token_ids
from .test_stage_batching import joins_a_running_batch
from .test_stage_cancel import run_hundred, scheduler
from .test_stage_support import Call, assert_engine_death_ends_the_stage, assert_nothing_held


def transformers_lm(engine_process: bool):
    def edit(doc):
        doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
        args = doc["spec"]["deployment"]["stages"]["llm"]["engineArgs"]
        args["engine_process"] = engine_process
        args.pop("max_model_len", None)
        scheduler("llm")(doc)  # room for a hundred requests at once
    return example("llm-tiny", edit)


async def core_stats(srv) -> tuple[int, int]:
    """(sequences, bytes) the engine process holds, asked between steps."""
    return await srv.engine.scheduler.run_on_worker(srv.engine.core.stats)


@pytest.fixture(scope="module")
async def both(model_dir):
    """The same LM twice: its model in the stage process, and in an engine process."""
    inproc = await start_stage(transformers_lm(False), "llm", model_dir)
    remote = await start_stage(transformers_lm(True), "llm", model_dir)
    yield inproc, remote
    await remote.drain()
    await inproc.drain()


async def test_the_engine_process_gives_the_tokens_of_the_stage_process(both):
    inproc, remote = both
    assert inproc.engine.core is None and remote.engine.core is not None
    requests = [header(f"g{i}", prompt=f"greedy {i}", max_tokens=20, ignore_eos=True) for i in range(4)]
    requests += [header(f"s{i}", prompt=f"sampled {i}", max_tokens=20, ignore_eos=True, temperature=0.9, seed=i)
                 for i in range(4)]
    want = await asyncio.gather(*(call_stage(inproc.port, h) for h in requests))
    got = await asyncio.gather(*(call_stage(remote.port, h) for h in requests))
    assert [token_ids(c) for c in got] == [token_ids(c) for c in want]
    assert [c[-1].finish_reason for c in got] == ["length"] * len(requests)
    assert "".join(c.text for c in got[0]) == "".join(c.text for c in want[0])
    # its work units: counted by the scheduler in the stage process, on each call's last chunk alone
    for calls in (want, got):
        assert [[(c.timing.units, c.timing.unit) for c in chunks] for chunks in calls] == \
            [[(0, "")] * (len(chunks) - 1) + [(20, "tokens")] for chunks in calls]
    assert len(remote.engine.tally) == 0
    assert await core_stats(remote) == (0, 0)


async def test_a_request_joining_a_batch_in_the_engine_process_gets_what_it_gets_alone(both):
    _, remote = both
    probe = (header("probe", prompt="The probe", max_tokens=30, ignore_eos=True, temperature=0.9, seed=5), ())
    fillers = [(header(f"f{i}", prompt=f"filler {i}", max_tokens=250, ignore_eos=True), ()) for i in range(6)]
    alone, joined = await joins_a_running_batch(remote, probe, fillers, token_ids)
    assert len(alone) == 30 and joined == alone
    assert await core_stats(remote) == (0, 0)


async def test_hundred_requests_ten_cancelled_leave_nothing_in_the_engine_process(both):
    _, remote = both

    def make(ch, i, cancel):
        return Call(ch, header(f"c{i}", prompt=f"request {i}", max_tokens=200 if cancel else 12, ignore_eos=True))

    def check(i, chunks):
        assert len(token_ids(chunks)) == 12 and chunks[-1].finish_reason == "length"

    await run_hundred(remote, make, check)
    assert await core_stats(remote) == (0, 0)  # the cancelled sequences' KV caches are freed in the child


async def test_held_bytes_are_the_engine_process_kv_caches(both):
    _, remote = both
    async with grpc.aio.insecure_channel(f"127.0.0.1:{remote.port}") as ch:
        call = Call(ch, header("held", max_tokens=250, ignore_eos=True))
        await asyncio.wait_for(call.started.wait(), 60)
        held = remote.engine.held_bytes()
        sequences, child_bytes = await core_stats(remote)
        assert held > 0 and sequences == 1 and child_bytes >= held  # the child may be a step ahead
        call.cancel()
        await call.outcome()
    await assert_nothing_held(remote)
    assert await core_stats(remote) == (0, 0)


def test_an_engine_without_an_engine_process_refuses_the_option(model_dir):
    pipeline = example("qwen3-omni-tiny", lambda d: d["spec"]["deployment"]["stages"]["code2wav"].setdefault(
        "engineArgs", {}).update(engine_process=True))
    with pytest.raises(EngineConfigError, match=r"spec\.deployment\.stages\.code2wav\.engineArgs\.engine_process"):
        create_engine(pipeline, pipeline.stage("code2wav"), model_dir)


async def test_the_engine_process_dying_fails_requests_flips_health_and_stops(model_dir):
    srv = await start_stage(transformers_lm(True), "llm", model_dir)
    try:
        await assert_engine_death_ends_the_stage(srv, lambda: psutil.Process(srv.engine.core._proc.pid).kill(),
                                                 "the engine process exited")
    finally:
        await srv.drain()


async def test_a_talker_in_an_engine_process_speaks_as_in_the_stage_process(model_dir):
    """Thinker chunks fed to both Talkers; the codes agree, a bad speaker is refused before any input is
    read, cancelled requests free their states in the child."""
    async with stage_servers(example("qwen3-omni-tiny"), model_dir, ("thinker", "talker")) as inproc, \
            stage_servers(in_engine_process("qwen3-omni-tiny", "talker"), model_dir, ("talker",)) as remote:
        talker = remote["talker"]
        params = [dict(prompt=f"story {i}", max_tokens=8, ignore_eos=True, max_codec_frames=20) for i in range(4)]
        thinker_out = await asyncio.gather(*(call_stage(inproc["thinker"].port, header(f"t{i}", **p))
                                             for i, p in enumerate(params)))
        want = await asyncio.gather(*(call_stage(inproc["talker"].port, header(f"a{i}", **p), out)
                                      for i, (p, out) in enumerate(zip(params, thinker_out))))
        got = await asyncio.gather(*(call_stage(talker.port, header(f"b{i}", **p), out)
                                     for i, (p, out) in enumerate(zip(params, thinker_out))))
        codes = [[tensor_of(c, "codes").tolist() for c in out] for out in got]
        assert codes == [[tensor_of(c, "codes").tolist() for c in out] for out in want]
        assert all(sum(len(c[0]) for c in out) == 20 for out in codes)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            # the header alone: the refusal comes before any input is read, and a client still writing chunks
            # when the server ends the call may see gRPC's INTERNAL "Failed execute_batch" instead of its status
            await call_stage(talker.port, header("bad", speaker="nobody"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and 'unknown speaker "nobody"' in e.value.details()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{talker.port}") as ch:
            calls = [Call(ch, header(f"c{i}", max_codec_frames=500, ignore_eos=True), thinker_out[i]) for i in range(3)]
            await asyncio.wait_for(asyncio.gather(*(c.started.wait() for c in calls)), 60)
            for c in calls:
                c.cancel()
            await asyncio.gather(*(c.outcome() for c in calls))
        await assert_nothing_held(talker)
        assert await core_stats(talker) == (0, 0)


# ------------------------------------------------------------ steps in flight (GateCore: steps wait for the test)

@pytest.fixture
def gated():
    """An engine process on `GateCore` and the test's end of its gate: `let_go()` lets one step answer."""
    from .engine_process_gate import GateCore

    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    core = EngineProcess("gate", GateCore, (theirs,))
    assert core.start() == {"gate": True}
    theirs.close()
    core.let_go = lambda: ours.send_bytes(b"1")
    yield core
    for _ in range(core.in_flight):  # answers still owed: the child ends once it has sent them
        core.let_go()
    core.close()
    ours.close()


def test_two_steps_go_out_before_either_answer_and_come_back_in_order(gated):
    a, b = gated.sequence("a"), gated.sequence("b")
    first = gated.submit([a])
    second = gated.submit([a, b])
    assert gated.in_flight == 2 and gated.peak_in_flight == MAX_STEPS_IN_FLIGHT == 2
    # the later step's answer is asked for first, on another thread: it reads the earlier one off the pipe
    # for its owner and keeps waiting for its own
    got: dict[str, list] = {}
    reader = threading.Thread(target=lambda: got.update(second=gated.collect(second)))
    reader.start()
    gated.let_go()
    gated.let_go()
    reader.join(60)
    assert got["second"] == [("a", "done", 0), ("b", "done", 0)]
    assert gated.collect(first) == [("a", "done", 0)]
    assert gated.in_flight == 0 and gated.steps_sent == 2
    assert gated.stats() == (2, 0)


def test_a_third_step_waits_until_an_answer_is_taken(gated):
    seqs = [gated.sequence(i) for i in range(3)]
    pending = [gated.submit([seqs[0]]), gated.submit([seqs[1]])]
    third: list = []
    sender = threading.Thread(target=lambda: third.append(gated.submit([seqs[2]])))
    sender.start()
    sender.join(0.5)  # a safety look only: a third step may not go out while two are unanswered
    assert sender.is_alive() and gated.in_flight == 2
    gated.let_go()
    assert gated.collect(pending[0]) == [(0, "done", 0)]
    sender.join(60)
    assert not sender.is_alive() and gated.peak_in_flight == 2
    gated.let_go()
    gated.let_go()
    assert gated.collect(pending[1]) == [(1, "done", 0)] and gated.collect(third[0]) == [(2, "done", 0)]


def test_a_release_sent_while_a_step_is_out_reaches_the_core_after_that_step(gated):
    a, b = gated.sequence("a"), gated.sequence("b")
    pending = gated.submit([a, b])
    gated.release(a)  # the state left the stage while its step is still in the core
    gated.flush()
    gated.let_go()
    assert gated.collect(pending) == [("a", "done", 0), ("b", "done", 0)]
    assert gated.stats() == (1, 0)  # b alone is left


def test_an_answer_taken_after_its_state_left_counts_no_bytes(gated):
    """A step sent ahead (the VAE's next decode) is answered on another thread, possibly after its state left
    the scheduler and was released: the bytes the answer reports are the ones the release freed, so the state
    holds none (it stayed counted while it lived on)."""
    st = RemoteState(seq=gated.sequence("a"), core=gated)
    pending = gated.submit([st.seq])
    st.release()  # the request ended while its step was out
    gated.let_go()
    [(_, reason, _)] = gated.collect(pending)
    st.finish_reason, st.child_bytes = reason, 4096  # as the encoder thread applies a decode's answer
    assert st.held_bytes() == 0


def test_an_answer_that_cannot_be_read_fails_every_step_out_and_wakes_their_waiters(gated):
    """Past an answer it could not read, the pipe is out of step with the messages: every step outstanding
    fails (none gets another's answer) and whoever waits for one is woken to be told."""
    from .engine_process_gate import UnreadableIn

    a, bad = gated.sequence("a"), gated.sequence(UnreadableIn(os.getpid()))
    first, second = gated.submit([bad]), gated.submit([a])
    got: dict[str, object] = {}

    def wait_second() -> None:
        try:
            got["second"] = gated.collect(second)
        except EngineDead as e:
            got["second"] = e

    waiter = threading.Thread(target=wait_second)
    waiter.start()  # reads the pipe itself, or waits for the reader of the first answer
    gated.let_go()
    gated.let_go()
    with pytest.raises(EngineDead, match="could not be read"):
        gated.collect(first)
    waiter.join(60)
    assert not waiter.is_alive() and isinstance(got["second"], EngineDead), got
    assert gated.in_flight == 0
    with pytest.raises(EngineDead, match="could not be read"):
        gated.submit([a])


def test_a_child_dying_with_two_steps_out_fails_both_and_every_later_step(gated):
    a = gated.sequence("a")
    first, second = gated.submit([a]), gated.submit([a])
    psutil.Process(gated._proc.pid).kill()
    for pending in (second, first):  # whichever is asked first, both fail the same way
        with pytest.raises(EngineDead, match="the engine process exited"):
            gated.collect(pending)
    assert gated.in_flight == 0
    with pytest.raises(EngineDead, match="the engine process exited"):
        gated.submit([a])
    with pytest.raises(EngineDead, match="the engine process exited"):
        gated.step([a])
