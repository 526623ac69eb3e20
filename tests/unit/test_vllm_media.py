"""Images and video on the vLLM Thinker, the pure parts: the request's payload and its per-step slices,
the connector's scheduler-side cursor, laying a step's positions and deepstack rows over the batch, the
M-RoPE key of the decoder's config, and the weightless stand-in that computes the prompt's positions as
the Thinker model does. The engine end to end: tests/integration/test_vllm_thinker.py."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from stage_service.engines.omni.media import EncodedPrompt, prompt_rows
from stage_service.engines.vllm.media import (
    EXTRA_KEY,
    MediaCursor,
    MediaPrompt,
    MediaStep,
    PositionsOnly,
    batch_inputs,
    media_payload,
    media_refusal,
    slots_of,
)
from stage_service.engines.vllm.thinker import FAMILIES, thinker_text_config
from stage_service.engines.vllm.thinker_text import MROPE_KEY

H = 4
P = 6
POSITIONS = torch.tensor([[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]])  # an image of 2x2 at 1..4
DELTA = -1
VISUAL = torch.tensor([False, True, True, True, True, False])


def _deepstack(layers=2):
    return [torch.arange(4 * H, dtype=torch.float32).view(4, H) + 100 * layer for layer in range(layers)]


def _payload(deep=True):
    return media_payload(POSITIONS, DELTA, VISUAL, _deepstack() if deep else None)


def test_the_payload_survives_vllms_transport_and_decodes_to_what_was_computed():
    payload = _payload()
    assert json.dumps({k: v for k, v in payload.items() if not isinstance(v, bytes)})  # plain values, bytes
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    back = MsgpackDecoder(dict).decode(MsgpackEncoder().encode({EXTRA_KEY: payload}))[EXTRA_KEY]
    prompt = MediaPrompt(back)
    assert torch.equal(prompt.positions, POSITIONS) and prompt.delta == DELTA and prompt.prompt_len == P
    assert prompt.visual.tolist() == [1, 2, 3, 4]
    assert torch.equal(prompt.deepstack, torch.stack(_deepstack()))
    assert MediaPrompt(_payload(deep=False)).deepstack is None


@pytest.mark.parametrize("start,end,positions,visual", [
    (0, 6, POSITIONS.tolist(), [1, 2, 3, 4]),                                  # the whole prefill
    (0, 3, POSITIONS[:, :3].tolist(), [1, 2]),                                 # a chunk of it
    (3, 8, [[1, 1, 3, 5, 6], [2, 2, 3, 5, 6], [1, 2, 3, 5, 6]], [0, 1]),      # its end, the first decodes
    (7, 9, [[6, 7]] * 3, None),                                                # decode (and a draft): p + delta
])
def test_a_step_slice_has_its_positions_and_the_deepstack_rows_of_its_visual_positions(start, end, positions, visual):
    step = MediaPrompt(_payload()).step("r", start, end, list(range(end - start)))
    assert step.positions.tolist() == positions
    if visual is None:
        assert step.visual is None and step.deepstack is None
        return
    assert step.visual.tolist() == visual
    first = max(start, 1) - 1  # the deepstack row of the first visual position in the slice
    assert torch.equal(step.deepstack, torch.stack(_deepstack())[:, first:first + len(visual)])


def test_slots_follow_the_block_table():
    assert slots_of([7, 2], 4, 2, 6) == [30, 31, 8, 9]


# ------------------------------------------------------------------ the scheduler side

def _new(rid, blocks, computed=0, extra=None):
    return SimpleNamespace(req_id=rid, block_ids=(blocks, [99]), num_computed_tokens=computed,
                           sampling_params=SimpleNamespace(extra_args=extra))


def _output(new=(), cached=(), scheduled=None, resumed=()):
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[c[0] for c in cached], resumed_req_ids=set(resumed),
                                              new_block_ids=[None if c[1] is None else (c[1], [99]) for c in cached],
                                              num_computed_tokens=[c[2] for c in cached]),
        num_scheduled_tokens=dict(scheduled or {}))


def test_the_cursor_follows_media_requests_only_through_chunks_decode_preemption_and_finish():
    c = MediaCursor(group=0, block_size=4)
    extra = {EXTRA_KEY: _payload(), "other": 1}
    steps = c.step(_output(new=[_new("img", [3], extra=extra), _new("txt", [5])],
                           scheduled={"img": 4, "txt": 3}))
    assert [(s.req_id, s.slots) for s in steps] == [("img", [12, 13, 14, 15])]  # a text request costs nothing
    assert extra == {"other": 1}  # the payload is taken out: not shipped to the workers nor held twice
    assert "txt" not in c.blocks
    steps = c.step(_output(cached=[("img", [8], 4), ("txt", None, 3)], scheduled={"img": 3, "txt": 1}))
    assert steps[0].slots == [32, 33, 34] and steps[0].positions.tolist() == [[1, 3, 5], [2, 3, 5], [2, 3, 5]]
    # preempted and back: new blocks, recomputed from 0
    steps = c.step(_output(cached=[("img", [1, 2], 0)], scheduled={"img": 7}, resumed=["img"]))
    assert steps[0].slots == list(range(4, 12))[:7] and steps[0].positions[:, :P].tolist() == POSITIONS.tolist()
    c.finished("img")
    assert not c.prompts and not c.blocks
    c.finished("never")  # nothing to drop


# ------------------------------------------------------------------ the worker side

def test_each_requests_positions_and_deepstack_rows_reach_its_rows_of_the_batch_whatever_the_order():
    prompt = MediaPrompt(_payload())
    a = prompt.step("a", 0, P, [40 + i for i in range(P)])   # a's prefill
    b = prompt.step("b", 8, 9, [71])                          # b decoding
    # the batch: text-only request t (1-D positions 0..2, slots 10..12) between them, in vLLM's order
    order = [("t", 10, 0), ("b", 71, 8)] + [("a", 40 + i, i) for i in range(P)] + [("t", 11, 1), ("t", 12, 2)]
    random.Random(3).shuffle(order)
    slots = torch.tensor([o[1] for o in order] + [-1, -1])  # padded past the batch
    positions = torch.tensor([o[2] for o in order])
    out, deep = batch_inputs([a, b], slots, positions)
    assert out.shape == (3, len(order)) and len(deep) == 2
    for row, (rid, _, p) in enumerate(order):
        want = POSITIONS[:, p].tolist() if rid == "a" else [p + DELTA] * 3 if rid == "b" else [p] * 3
        assert out[:, row].tolist() == want
        for layer in range(2):
            expected = _deepstack()[layer][p - 1] if rid == "a" and VISUAL[p] else torch.zeros(H)
            assert torch.equal(deep[layer][row], expected)


def test_text_and_decode_steps_add_no_deepstack_rows():
    step = MediaPrompt(_payload()).step("b", 8, 10, [5, 6])
    out, deep = batch_inputs([step], torch.tensor([6, 5]), torch.tensor([9, 8]))
    assert out.tolist() == [[8, 7]] * 3 and deep == []


def test_a_slot_outside_the_batch_is_an_error_not_a_wrong_row():
    step = MediaStep("r", [7], torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="slot 7"):
        batch_inputs([step], torch.tensor([1, 2]), torch.tensor([0, 1]))


# ------------------------------------------------------------------ the decoder's config and the positions

@pytest.mark.parametrize("model,interleaved", [("qwen3-omni-tiny", True), ("qwen2.5-omni-tiny", False)])
def test_the_decoder_config_names_the_mrope_sections_under_our_key_only(model_dir, model, interleaved):
    config = json.loads((model_dir / model / "config.json").read_text())
    out = thinker_text_config(config)
    rope = config["thinker_config"]["text_config"]
    section = (rope.get("rope_parameters") or rope.get("rope_scaling"))["mrope_section"]
    assert out[MROPE_KEY] == {"section": section, "interleaved": interleaved}
    assert "mrope_section" not in out["rope_parameters"]  # else vLLM computes positions from its processor


@pytest.mark.parametrize("model,family", [("qwen3-omni-tiny", "qwen3_omni"), ("qwen2.5-omni-tiny", "qwen2_5_omni")])
def test_the_weightless_stand_in_gives_the_thinker_models_positions(model_dir, model, family):
    from stage_service.runtime.components import read_config

    config_cls, thinker_cls = FAMILIES[family].transformers_classes()
    cfg = read_config(model_dir / model, config_cls).thinker_config
    torch.manual_seed(0)
    real = thinker_cls._from_config(cfg).eval()
    stand_in = PositionsOnly(thinker_cls, cfg)
    # text, an image of 4x4 patches (4 rows after the 2x2 merge), text, a video of 2x2x4 patches (4 rows)
    image_id, video_id = cfg.image_token_id, cfg.video_token_id
    start, end = cfg.vision_start_token_id, cfg.vision_end_token_id
    ids = [1, 2, start] + [image_id] * 4 + [end, 3, start] + [video_id] * 4 + [end, 4, 5]
    hidden = cfg.text_config.hidden_size
    enc = EncodedPrompt(ids=torch.tensor(ids), image=torch.randn(4, hidden), video=torch.randn(4, hidden),
                        image_grid_thw=torch.tensor([[1, 4, 4]]), video_grid_thw=torch.tensor([[2, 2, 4]]),
                        video_second_per_grid=torch.tensor([1.0]))
    if family == "qwen3_omni":
        layers = len(cfg.vision_config.deepstack_visual_indexes)
        enc.image_deepstack, enc.video_deepstack = torch.randn(layers, 4, hidden), torch.randn(layers, 4, hidden)
    want, got = prompt_rows(real, enc), prompt_rows(stand_in, enc)
    assert torch.equal(got.positions, want.positions) and got.rope_delta == want.rope_delta
    assert not torch.equal(want.positions[0], want.positions[1])  # the case has 3-D positions
    media = (torch.tensor(ids) == image_id) | (torch.tensor(ids) == video_id)
    assert torch.equal(got.embeds[media], want.embeds[media]) and not got.embeds[~media].any()
    assert len(got.deepstack) == len(want.deepstack)
    for g, w in zip(got.deepstack, want.deepstack):
        assert torch.equal(g, w)


def _config(eager=True, ubatching=False, dcp=1):
    return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=eager),
                           parallel_config=SimpleNamespace(use_ubatching=ubatching, decode_context_parallel_size=dcp))


@pytest.mark.parametrize("config, says", [
    (_config(), None),
    (_config(eager=False), "enforce_eager: true"),
    (_config(ubatching=True), "micro-batching"),
    (_config(dcp=2), "decode context parallelism"),
])
def test_images_and_video_are_refused_with_the_reason_where_the_forward_cannot_carry_them(config, says):
    refusal = media_refusal(config)
    assert (refusal is None) if says is None else (says in refusal and "engine: transformers" in refusal)
