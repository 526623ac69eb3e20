"""Hidden-state rows out of vLLM: the pure parts (engine arguments, slot arithmetic, request ids, the
Thinker's text-decoder config and checkpoint view, the CPU expand kernel) and the stage-side receiver
over a real ZMQ socket. The engine end to end: tests/integration/test_vllm_thinker.py."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stage_service.engines.vllm.rows import (
    LENGTH_MARGIN,
    RowsMissing,
    RowsReceiver,
    engine_length,
    gaps,
    ours,
    read_step,
    rows_engine_args,
    step_frames,
)
from stage_service.engines.vllm.rows_connector import Read, RowCursor, RowsConnector, expand_cpu, slots_of
from stage_service.engines.vllm.thinker import thinker_text_config, thinker_text_view
from stage_service.runtime.base import EngineConfigError


def test_the_engine_gets_room_for_the_last_rows_within_the_models_limit():
    assert engine_length(512, 32768) == (512 + LENGTH_MARGIN, 512)
    assert engine_length(32768, 32768) == (32768, 32768 - LENGTH_MARGIN)  # at the model's limit: the stage gives
    assert engine_length(512, None) == (512 + LENGTH_MARGIN, 512)


def test_engine_args_turn_on_extraction_of_the_asked_layers():
    args = rows_engine_args([0, 3], "ipc:///tmp/x.sock", 514)
    spec = args["speculative_config"]
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3]
    kv = args["kv_transfer_config"]
    assert kv["kv_connector_module_path"] == "stage_service.engines.vllm.rows_connector"
    assert kv["kv_connector_extra_config"] == {"endpoint": "ipc:///tmp/x.sock"}
    assert args["max_model_len"] == 514
    assert args["enable_prefix_caching"] is False and args["async_scheduling"] is False


@pytest.mark.parametrize("blocks,size,start,end,slots", [
    ([7], 4, 0, 3, [28, 29, 30]),
    ([7, 2], 4, 2, 6, [30, 31, 8, 9]),
    ([5, 0, 9], 2, 3, 5, [1, 18]),
    ([3], 16, 5, 5, []),
])
def test_slots_follow_the_block_table(blocks, size, start, end, slots):
    assert slots_of(blocks, size, start, end) == slots


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=8, unique=True), st.integers(1, 32), st.data())
def test_slots_are_distinct_and_inside_the_requests_blocks(blocks, size, data):
    end = data.draw(st.integers(0, len(blocks) * size))
    start = data.draw(st.integers(0, end))
    slots = slots_of(blocks, size, start, end)
    assert len(slots) == len(set(slots)) == end - start
    assert all(s // size in blocks for s in slots)


# ------------------------------------------------------------------ the connector's scheduler side

def _new(rid, blocks, computed=0):
    return SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)


def _output(new=(), cached=(), scheduled=None, drafts=None, resumed=()):
    """A SchedulerOutput's fields the cursor reads. `cached`: (rid, new blocks or None, computed tokens)."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[c[0] for c in cached], resumed_req_ids=set(resumed),
                                              new_block_ids=[None if c[1] is None else (c[1],) for c in cached],
                                              num_computed_tokens=[c[2] for c in cached]),
        num_scheduled_tokens=dict(scheduled or {}), scheduled_spec_decode_tokens=dict(drafts or {}))


def _reads(reads):
    return [(r.req_id, r.start, len(r.slots), r.done) for r in reads]


def test_the_cursor_reads_each_confirmed_position_once_through_prefill_drafts_and_finish():
    c = RowCursor(group=0, block_size=4)
    # prefill of 6 positions: all read
    assert _reads(c.step(_output(new=[_new("a", [3, 5])], scheduled={"a": 6}))) == [("a", 0, 6, False)]
    # decode: position 6 plus a draft at 7 (read next step)
    assert _reads(c.step(_output(cached=[("a", None, 6)], scheduled={"a": 2}, drafts={"a": [9]}))) == [
        ("a", 6, 1, False)]
    # the draft was accepted: positions 7 (the draft's) and 8 now, a new draft at 9
    assert _reads(c.step(_output(cached=[("a", [8], 8)], scheduled={"a": 2}, drafts={"a": [9]}))) == [
        ("a", 7, 2, False)]
    assert c.blocks["a"] == [3, 5, 8]
    # finished with 10 positions computed: the rest is read in the next step, the blocks held until then
    assert c.finished("a", 10, [3, 5, 8]) is True
    final = c.step(_output())
    assert _reads(final) == [("a", 9, 1, True)] and final[0].slots == [8 * 4 + 1]
    assert "a" not in c.blocks and "a" not in c.emitted


def test_a_rejected_draft_is_read_when_rewritten():
    c = RowCursor(group=0, block_size=16)
    c.step(_output(new=[_new("a", [0])], scheduled={"a": 3}))
    c.step(_output(cached=[("a", None, 3)], scheduled={"a": 2}, drafts={"a": [1]}))   # reads 3; draft at 4
    # rejected: vLLM rolled back to 4 computed; this step feeds 4 (rewritten) and a new draft at 5
    assert _reads(c.step(_output(cached=[("a", None, 4)], scheduled={"a": 2}, drafts={"a": [1]}))) == [
        ("a", 4, 1, False)]


def test_a_resumed_request_recomputing_in_chunks_is_not_read_twice():
    c = RowCursor(group=0, block_size=4)
    c.step(_output(new=[_new("a", [1, 2, 3])], scheduled={"a": 9}))                  # rows 0..8 read
    # preempted, then back with new blocks; its prefill recomputed 4 positions at a time
    assert c.step(_output(cached=[("a", [7, 8, 9], 0)], scheduled={"a": 4}, resumed=["a"])) == []
    assert c.blocks["a"] == [7, 8, 9] and c.emitted["a"] == 9
    assert c.step(_output(cached=[("a", None, 4)], scheduled={"a": 4})) == []
    assert _reads(c.step(_output(cached=[("a", None, 8)], scheduled={"a": 2}))) == [("a", 9, 1, False)]


def test_a_request_never_scheduled_holds_nothing():
    c = RowCursor(group=1, block_size=4)
    assert c.finished("never", 0, []) is False
    assert c.step(_output()) == []


def test_the_cursor_reads_the_rows_cache_group():
    c = RowCursor(group=1, block_size=2)
    new = SimpleNamespace(req_id="a", block_ids=([100], [4]), num_computed_tokens=0)
    reads = c.step(_output(new=[new], scheduled={"a": 2}))
    assert reads[0].slots == [8, 9]


def test_our_request_id_is_found_under_vllms_suffix():
    open_ids = {"req-1", "abc"}
    assert ours("req-1", open_ids) == "req-1"
    assert ours("req-1-0a1b2c3d", open_ids) == "req-1"
    assert ours("abc-0a1b2c3d", open_ids) == "abc"
    assert ours("abc-12", open_ids) is None          # not vLLM's 8-character suffix
    assert ours("gone-0a1b2c3d", open_ids) is None   # released


def _reference_expand(input_val, cu, replace_from, replace_to):
    out, prev = [], 0
    for v, c in zip(input_val.tolist(), cu.tolist()):
        out += [replace_to if v == replace_from else v] * (c - prev)
        prev = c
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_the_cpu_expand_kernel_writes_the_output_in_its_own_dtype(dtype):
    values = torch.tensor([1.0, 0.8, -1.0, 0.5]).to(dtype)
    cu = torch.tensor([2, 3, 3, 6], dtype=torch.int32)
    output = torch.full((8,), 99, dtype=dtype)
    expand_cpu(output, values, cu, -1, 7)
    assert output[:6].tolist() == pytest.approx(_reference_expand(values, cu, -1, 7))
    assert output[6:].tolist() == [99, 99]  # past the tokens: untouched


def qwen3_omni_config() -> dict:
    from omnistage.tiny_models import qwen3_omni

    return {**qwen3_omni.config().to_dict(), "architectures": ["Qwen3OmniMoeForConditionalGeneration"]}


def qwen2_5_omni_config() -> dict:
    from omnistage.tiny_models import qwen2_5_omni

    return {**qwen2_5_omni.config().to_dict(), "architectures": ["Qwen2_5OmniForConditionalGeneration"]}


def test_the_qwen2_5_thinkers_text_config_is_a_qwen2_with_its_tying():
    cfg = qwen2_5_omni_config()
    text = cfg["thinker_config"]["text_config"]
    out = thinker_text_config(cfg)
    assert out["architectures"] == ["OmnistageQwen2_5OmniThinkerText"] and out["model_type"] == "qwen2"
    assert out["tie_word_embeddings"] == text["tie_word_embeddings"]
    assert out["num_attention_heads"] == text["num_attention_heads"] and out["hidden_size"] == text["hidden_size"]


def test_a_checkpoint_of_another_family_is_refused_naming_the_ones_served():
    with pytest.raises(EngineConfigError, match="Qwen3-Omni and Qwen2.5-Omni.*LlamaForCausalLM"):
        thinker_text_config({"architectures": ["LlamaForCausalLM"], "thinker_config": {}})


def test_the_thinkers_text_config_is_a_qwen3_moe_with_plain_rope():
    cfg = qwen3_omni_config()
    text = cfg["thinker_config"]["text_config"]
    out = thinker_text_config(cfg)
    assert out["architectures"] == ["OmnistageQwen3OmniThinkerText"] and out["model_type"] == "qwen3_moe"
    assert out["rope_parameters"] == {"rope_type": "default", "rope_theta": text["rope_parameters"]["rope_theta"]}
    for key in ("hidden_size", "num_hidden_layers", "head_dim", "num_experts", "num_experts_per_tok", "vocab_size"):
        assert out[key] == text[key], key
    assert out["tie_word_embeddings"] is False


def test_a_text_config_without_rope_theta_is_refused():
    cfg = qwen3_omni_config()
    cfg["thinker_config"]["text_config"]["rope_parameters"] = {"rope_type": "default"}
    with pytest.raises(EngineConfigError, match="rope_theta"):
        thinker_text_config(cfg)


def test_the_checkpoint_view_links_every_file_and_copies_no_weight(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = qwen3_omni_config()
    (ckpt / "config.json").write_text(json.dumps(config))
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json",
                 "chat_template.json"):
        (ckpt / name).write_bytes(b"x" * 10)
    view = thinker_text_view(ckpt, config, tmp_path / "view")
    names = sorted(p.name for p in view.iterdir())
    assert names == sorted(p.name for p in ckpt.iterdir())
    for name in names:
        if name != "config.json":
            assert os.path.islink(view / name) and (view / name).resolve() == (ckpt / name).resolve()
    assert json.loads((view / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "qwen3_omni_moe"  # untouched


# ------------------------------------------------------------------ the receiver, over a real socket

def _push(endpoint: str):
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(endpoint)

    def send(rid: str, start: int, rows: torch.Tensor, done: bool = False):
        sock.send_multipart(step_frames([[rid, start, len(rows), done]], rows), copy=False)

    def send_step(reads: list[list], rows: torch.Tensor):
        sock.send_multipart(step_frames(reads, rows), copy=False)

    send.step = send_step
    return sock, send


@pytest.fixture
async def receiver(tmp_path):
    """A receiver bound on a real IPC socket, and a sender speaking the connector's messages to it."""
    dead: list[BaseException] = []
    rx = RowsReceiver(f"ipc://{tmp_path / 'rows.sock'}", lambda: dead[0] if dead else None)
    rx.dead = dead  # the test stops "the engine" by appending its error
    rx.start()
    sock, send = _push(rx.endpoint)
    try:
        yield rx, send
    finally:
        sock.close(linger=0)
        await rx.close()


async def test_the_receiver_hands_each_request_its_rows_in_position_order(receiver):
    rx, send = receiver
    rx.open("a")
    rx.open("b")
    rows = torch.arange(5 * 2 * 3, dtype=torch.float32).view(5, 2, 3)
    waiting = asyncio.ensure_future(rx.take("a", 0, 5))
    send("a-0a1b2c3d", 3, rows[3:])       # later positions first
    send("b-0a1b2c3d", 0, rows[:1] + 100)
    send("gone-0a1b2c3d", 0, rows[:2])    # not open: dropped
    await asyncio.sleep(0.05)
    assert not waiting.done()             # positions 0..2 missing
    send("a-0a1b2c3d", 0, rows[:3])
    got = await asyncio.wait_for(waiting, 5)
    assert torch.equal(got, rows)
    assert torch.equal(await rx.take("b", 0, 1), rows[:1] + 100)
    assert set(rx.open_requests) == {"a", "b"}
    rx.release("a")
    assert rx.open_requests == ["b"]


async def test_a_request_finished_without_its_rows_is_an_error_naming_the_positions(receiver):
    rx, send = receiver
    rx.open("r")
    send("r-0a1b2c3d", 0, torch.zeros(2, 1, 4, dtype=torch.bfloat16), done=True)
    with pytest.raises(RowsMissing, match=r"\[2, 3\]"):
        await rx.take("r", 0, 4)
    with pytest.raises(ValueError):
        await rx.take("r", 2, 2)
    rx.open("s")
    send("s-0a1b2c3d", 0, torch.zeros(0, 1, 4), done=True)  # a last read with no rows: the done mark alone
    with pytest.raises(RowsMissing, match=r"\[0\]"):
        await asyncio.wait_for(rx.take("s", 0, 1), 5)


async def test_a_waiting_take_fails_soon_after_the_engine_dies(receiver):
    rx, send = receiver
    rx.open("r")
    send("r-0a1b2c3d", 0, torch.zeros(1, 1, 4))
    waiting = asyncio.ensure_future(rx.take("r", 0, 3))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    rx.dead.append(RuntimeError("engine core died"))
    with pytest.raises(RowsMissing, match="engine stopped"):
        await asyncio.wait_for(waiting, 5)


async def test_one_message_carries_a_steps_rows_for_every_request_and_each_request_holds_one_part_a_step(receiver):
    rx, send = receiver
    for rid in ("a", "b", "c"):
        rx.open(rid)
    rows = torch.arange(12 * 2 * 3, dtype=torch.float32).view(12, 2, 3)
    # a prefill of 8 positions for "a", one decode position each for "b" and "c", a request not open between
    send.step([["a-0a1b2c3d", 0, 8, False], ["gone-0a1b2c3d", 0, 2, False], ["b-0a1b2c3d", 5, 1, False],
               ["c-0a1b2c3d", 9, 1, True]], rows)
    assert torch.equal(await asyncio.wait_for(rx.take("b", 5, 6), 5), rows[10:11])
    assert torch.equal(await rx.take("c", 9, 10), rows[11:12])
    assert rx.parts_held("a") == 1  # eight positions, one part (no object per position)
    # a message of several requests' rows is copied apart: "a"'s part holds its own 8 rows, not the message's 12
    assert rx._open["a"].parts[0][1].untyped_storage().nbytes() == 8 * 2 * 3 * 4
    assert torch.equal(await rx.take("a", 0, 6), rows[:6])
    assert rx.parts_held("a") == 1  # what is left of the part: positions 6 and 7, copied out of it
    assert rx._open["a"].parts[0][1].untyped_storage().nbytes() == 2 * 2 * 3 * 4
    send.step([["a-0a1b2c3d", 8, 1, False]], rows[:1] + 1000)
    assert torch.equal(await asyncio.wait_for(rx.take("a", 6, 9), 5), torch.cat([rows[6:8], rows[:1] + 1000]))
    assert rx.parts_held("a") == 0  # taken rows are let go
    assert rx.received_bytes == (8 + 1 + 1 + 1) * 2 * 3 * 4


async def test_a_recomputed_position_arriving_later_wins(receiver):
    rx, send = receiver
    rx.open("a")
    send("a-0a1b2c3d", 0, torch.zeros(3, 1, 2))
    send("a-0a1b2c3d", 1, torch.ones(1, 1, 2))
    await asyncio.sleep(0.05)
    got = await asyncio.wait_for(rx.take("a", 0, 3), 5)
    assert got[:, 0, 0].tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_message_round_trips_its_reads_and_rows(dtype):
    rows = torch.randn(5, 2, 4).to(dtype)
    reads = [["x", 3, 2, False], ["y", 0, 3, True]]
    got_reads, got = read_step(step_frames(reads, rows))
    assert got_reads == reads and got.dtype == dtype and torch.equal(got, rows)
    empty_reads, empty = read_step(step_frames([["z", 4, 0, True]], rows[:0]))
    assert empty_reads == [["z", 4, 0, True]] and empty.shape == (0, 2, 4)


def test_the_connector_gathers_a_steps_rows_once_from_the_paged_cache():
    blocks, layers, size, hidden = 4, 2, 3, 5
    cache = torch.arange(blocks * layers * size * hidden, dtype=torch.float32).view(blocks, layers, size, hidden)
    reads = [Read("a", 0, [3, 4, 9]), Read("b", 7, []), Read("c", 2, [11], done=True)]
    frames = RowsConnector._step(SimpleNamespace(rows=cache), reads)
    assert len(frames) == 2  # one header, one buffer for every request
    got_reads, rows = read_step(frames)
    assert got_reads == [["a", 0, 3, False], ["b", 7, 0, False], ["c", 2, 1, True]]
    for i, slot in enumerate([3, 4, 9, 11]):
        assert torch.equal(rows[i], cache[slot // size, :, slot % size])


@pytest.mark.parametrize("parts,start,end,missing", [
    ([], 0, 3, [(0, 3)]),
    ([(0, 2), (3, 1)], 0, 5, [(2, 3), (4, 5)]),
    ([(2, 4), (0, 3)], 0, 6, []),
    ([(10, 2)], 0, 4, [(0, 4)]),
])
def test_gaps_name_the_positions_no_part_covers(parts, start, end, missing):
    assert gaps([(s, torch.zeros(n, 1, 1)) for s, n in parts], start, end) == missing
